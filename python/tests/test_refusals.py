"""The binding's own argument checks (shapes, dtypes, devices, the combine layout) refuse a call collectively: the
refusing rank joins the call's exchange as a refusal, so every rank raises InputError (the peers' naming the refusing
rank and its reason) and the next call is exact on every rank. Before, these checks were rank-local: the refusing
rank skipped the exchange and its peers' call paired with its next one (an error naming two different calls, or a
timeout): these tests failed so. And a dispatch that raised no longer leaves combine sized for it (SIGSEGV before)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import ferry
import reference as ref
from support import run_ranks

CONFIG = ref.Config(64, 8, 2, 8)
SEED = np.random.SeedSequence().entropy % (1 << 32)  # fresh inputs each run (the seed is in the test id on failure)

BAD = {
    "x dtype": ("dispatch", "x has dtype float32"),
    "topk_idx shape": ("dispatch", "topk_idx has shape [8, 1]"),
    "combine layout": ("combine", "layout='column' is not a combine layout"),
}


def _body(ctx, case, seed):
    comm = ctx.init()
    buf = ferry.EpBuffer(comm, **CONFIG.kwargs())
    inputs = ref.make_inputs(CONFIG, [8] * ctx.world, seed)
    received = [ref.dispatch(CONFIG, ctx.world, d, inputs) for d in range(ctx.world)]
    want = ref.combine(CONFIG, ctx.world, ctx.rank, inputs, received, [r.recv_x for r in received])
    mine = inputs[ctx.rank]
    leg, _ = BAD[case]
    outcomes = []
    for step in range(3):
        x, idx, w, layout = mine.x, mine.topk_idx, mine.topk_weights, "rank"
        if step == 1 and ctx.rank == 1:
            if case == "x dtype":
                x = x.astype(np.float32)
            elif case == "topk_idx shape":
                idx = np.ascontiguousarray(idx[:, :1])
            else:
                layout = "column"
        try:
            got = buf.dispatch(x, idx, w)
        except ferry.InputError as error:
            outcomes.append(("dispatch refused", str(error)))
            continue
        try:
            y = buf.combine(got.recv_x, layout)
        except ferry.InputError as error:
            outcomes.append(("combine refused", str(error)))
            continue
        outcomes.append(("exact", bool(np.array_equal(y, want))))
    return outcomes


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_binding_refusal_is_refused_on_every_rank(case):
    leg, reason = BAD[case]
    results = run_ranks(_body, 2, case, SEED, env={"FERRY_TIMEOUT_S": "5"}, timeout=60.0)
    for rank, outcomes in enumerate(results):
        assert outcomes[0] == ("exact", True), (rank, outcomes)
        kind, message = outcomes[1]
        assert kind == f"{leg} refused", (rank, outcomes)
        assert reason in message, (rank, message)
        if rank == 0:
            assert "rank 1" in message, message  # the peer names the refusing rank
        assert outcomes[2] == ("exact", True), (rank, outcomes)  # nothing paired up wrongly


# One rank: dispatch 30 tokens, then a dispatch of 2 with an id of 1234 (InputError), then combine(out=None). The
# binding sized y for the failed call's 2 tokens while C++ still held the 30-token dispatch and wrote 30 rows: heap
# corruption (SIGABRT / SIGSEGV, the interpreter died). Run in a subprocess so that a crash fails this test.
_AFTER_A_FAILED_DISPATCH = textwrap.dedent("""
    import numpy as np, ferry
    comm = ferry.init(backend="cpu", rank=0, world=1)
    buf = ferry.EpBuffer(comm, hidden=4096, num_experts=4, topk=2, max_tokens_per_rank=32, expert_capacity=64)
    expert_out = np.zeros((buf.num_local_experts, buf.expert_capacity, 4096), np.uint16)
    def inputs(n):
        x = np.ones((n, 4096), np.uint16)
        return x, np.tile(np.array([0, 3], np.int64), (n, 1)), np.full((n, 2), 0.5, np.float32)
    buf.dispatch(*inputs(30), expand=True)
    x, idx, w = inputs(2)
    idx[0, 0] = 1234
    try:
        buf.dispatch(x, idx, w, expand=True)
    except ferry.InputError as error:
        print("dispatch refused:", error)
    try:
        buf.combine(expert_out)
    except ferry.InputError as error:
        print("combine refused:", error)
    buf.dispatch(*inputs(2), expand=True)
    print("y shape after the next dispatch:", buf.combine(expert_out).shape)
""")


def test_combine_after_a_failed_dispatch_writes_nothing():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(ferry.__file__).resolve().parents[1])] +
                                                      [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]))
    done = subprocess.run([sys.executable, "-c", _AFTER_A_FAILED_DISPATCH], capture_output=True, text=True, timeout=60,
                          env=env)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}{done.stderr}"
    assert "dispatch refused:" in done.stdout and "topk_idx[0, 0]=1234" in done.stdout, done.stdout
    assert "combine refused:" in done.stdout and "without a successful dispatch" in done.stdout, done.stdout
    assert "y shape after the next dispatch: (2, 4096)" in done.stdout, done.stdout
