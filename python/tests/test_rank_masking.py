"""Rank masking and the wait statistics through the binding (cpu backend, ranks as processes, mode='ll'):
EpBuffer(rank_masking=True); a rank skips a call on purpose and the others finish it without it, report it masked
and return, row for row, the reference of the world without it; the masked rank's own call raises Error; clear_mask
brings every rank back. EpBuffer(wait_stats=True) counts one wait per source and call. Fresh data every run; the seed
is printed (FERRY_TEST_SEED replays it)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

import ferry
import reference as ref
from support import run_ranks

SEED = int(os.environ.get("FERRY_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
print(f"python tests: seed {SEED} (FERRY_TEST_SEED={SEED} replays it)")

POISON = 0xFFBF
WORLD = 4
SKIPPED = 3
# Not shorter: the ranks are processes of one machine, and on a loaded 2-core machine (CI's, with a compile beside it)
# a present rank missed a 0.5 s window and the others timed out waiting for it (as in test_rank_masking_cpu.cpp).
TIMEOUT = 2.0
TIMEOUT_S = str(TIMEOUT)


def _config(world: int) -> ref.Config:
    tokens = 6
    return ref.Config(64, 4 * world, 3, tokens, expert_capacity=world * tokens)


def _without(config: ref.Config, world: int, inputs: list[ref.RankInput], masked: set[int]):
    """The inputs of the world without `masked` (no tokens there; their experts' ids -1 elsewhere), and the entries
    each rank loses."""
    nl = config.num_local(world)
    out, lost = [], []
    for rank, inp in enumerate(inputs):
        if rank in masked:
            out.append(ref.RankInput(inp.x[:0], inp.topk_idx[:0], inp.topk_weights[:0]))
            lost.append(0)
            continue
        idx = inp.topk_idx.copy()
        gone = (idx >= 0) & np.isin(idx // nl, list(masked))
        idx[gone] = -1
        out.append(ref.RankInput(inp.x, idx, inp.topk_weights))
        lost.append(int(gone.sum()))
    return out, lost


def _call(buf, config, world, rank, mine, seed):
    got = buf.dispatch(mine.x, mine.topk_idx, mine.topk_weights)
    counts = np.array(got.expert_counts).copy()
    src = np.array(got.recv_src)[: got.num_recv_host].copy()
    y = np.full((len(mine.x), config.hidden), POISON, np.uint16)
    buf.combine(ref.expert_outputs(config, world, rank, seed), "expert", out=y)
    return {"counts": counts, "src": src, "y": y, "masked_entries": got.masked_entries,
            "status": buf.mask_status()}


def _body(ctx, config: ref.Config, num_tokens, seed):
    comm = ctx.init()
    buf = ferry.EpBuffer(comm, mode="ll", rank_masking=True, **config.kwargs())
    assert buf.config.rank_masking and not buf.config.wait_stats
    inputs = ref.make_inputs(config, num_tokens, seed, 0.1)
    out = {"first": _call(buf, config, ctx.world, ctx.rank, inputs[ctx.rank], seed)}
    if ctx.rank == SKIPPED:
        time.sleep(TIMEOUT + 3.0)  # the others finish call 2 without it meanwhile (one wait of FERRY_TIMEOUT_S)
        try:
            buf.dispatch(inputs[ctx.rank].x, inputs[ctx.rank].topk_idx, inputs[ctx.rank].topk_weights)
            out["own_call"] = "passed"
        except ferry.Error as error:
            out["own_call"] = str(error)
        out["own_status"] = buf.mask_status()
    else:
        start = time.monotonic()
        out["second"] = _call(buf, config, ctx.world, ctx.rank, inputs[ctx.rank], seed + 1)
        out["second_s"] = time.monotonic() - start
        out["masked"] = buf.masked_ranks()
    buf.clear_mask()
    out["cleared"] = buf.masked_ranks()
    out["third"] = _call(buf, config, ctx.world, ctx.rank, inputs[ctx.rank], seed + 2)
    return out


def _check(config, world, inputs, got, masked, seed, rank, what):
    kept, lost = _without(config, world, inputs, masked)
    received = [ref.dispatch(config, world, d, kept) for d in range(world)]
    want = received[rank]
    np.testing.assert_array_equal(got["counts"], want.expert_counts, err_msg=f"rank {rank} {what}: expert_counts")
    np.testing.assert_array_equal(got["src"], want.recv_src, err_msg=f"rank {rank} {what}: recv_src")
    rows = [ref.reduce_local_experts(config, received[d], ref.expert_outputs(config, world, d, seed))
            for d in range(world)]
    y = ref.combine(config, world, rank, kept, received, rows)
    np.testing.assert_array_equal(got["y"], y, err_msg=f"rank {rank} {what}: y")
    assert got["masked_entries"] == lost[rank], (rank, what, got["masked_entries"], lost[rank])
    assert got["status"]["last_combine_entries"] == lost[rank]


def test_a_skipped_rank_is_masked_and_the_others_match_the_reference():
    config = _config(WORLD)
    rng = np.random.default_rng(SEED)
    num_tokens = [int(rng.integers(1, config.max_tokens_per_rank + 1)) for _ in range(WORLD)]
    results = run_ranks(_body, WORLD, config, num_tokens, SEED, env={"FERRY_TIMEOUT_S": TIMEOUT_S})
    inputs = ref.make_inputs(config, num_tokens, SEED, 0.1)
    for rank, got in enumerate(results):
        _check(config, WORLD, inputs, got["first"], set(), SEED, rank, "call 1")
        _check(config, WORLD, inputs, got["third"], set(), SEED + 2, rank, "call 3 (after clear_mask)")
        assert got["cleared"] == []
        if rank == SKIPPED:
            assert f"rank {SKIPPED} is masked" in got["own_call"] and "clear_mask" in got["own_call"], got["own_call"]
            assert got["own_status"]["self"] and SKIPPED in got["own_status"]["ranks"]
            continue
        _check(config, WORLD, inputs, got["second"], {SKIPPED}, SEED + 1, rank, "call 2 (rank 3 masked)")
        assert got["masked"] == [SKIPPED]
        assert got["second_s"] < TIMEOUT + 1.5, got["second_s"]  # one wait of FERRY_TIMEOUT_S, not two


def _config_errors_body(ctx):
    comm = ctx.init()
    out = {}
    try:
        ferry.EpBuffer(comm, hidden=64, num_experts=8, topk=2, max_tokens_per_rank=4, rank_masking=True)
        out["normal"] = "accepted"
    except ferry.ConfigError as error:
        out["normal"] = str(error)
    buf = ferry.EpBuffer(comm, hidden=64, num_experts=8, topk=2, max_tokens_per_rank=4, mode="ll")
    for name, call in (("mask_ranks", lambda: buf.mask_ranks([1])), ("clear_mask", buf.clear_mask),
                       ("wait_stats", buf.wait_stats)):
        try:
            call()
            out[name] = "accepted"
        except ferry.ConfigError as error:
            out[name] = str(error)
    out["status"] = buf.mask_status()
    return out


def test_masking_and_stats_are_refused_where_they_do_not_apply():
    for got in run_ranks(_config_errors_body, 2):
        assert "rank_masking=true needs mode=ll" in got["normal"], got["normal"]
        assert "rank_masking=true" in got["mask_ranks"] and "rank masking is off" in got["clear_mask"]
        assert "wait_stats=true" in got["wait_stats"]
        assert got["status"]["enabled"] is False and got["status"]["ranks"] == []


def _stats_body(ctx, config, num_tokens, seed, calls):
    comm = ctx.init()
    buf = ferry.EpBuffer(comm, mode="ll", wait_stats=True, **config.kwargs())
    mine = ref.make_inputs(config, num_tokens, seed, 0.1)[ctx.rank]
    for _ in range(calls):
        _call(buf, config, ctx.world, ctx.rank, mine, seed)
    stats = buf.wait_stats()
    buf.reset_wait_stats()
    return {"stats": stats, "after_reset": buf.wait_stats()}


@pytest.mark.parametrize("world", [2, 4])
def test_wait_stats_count_one_wait_per_source_and_call(world):
    config = _config(world)
    calls = 3
    for rank, got in enumerate(run_ranks(_stats_body, world, config, [config.max_tokens_per_rank] * world, SEED, calls)):
        for leg in ("dispatch", "combine"):
            peers = got["stats"][leg]
            assert len(peers) == world
            assert [p["waits"] for p in peers] == [calls] * world, (rank, leg, peers)
            assert all(p["max_ns"] <= p["total_ns"] for p in peers)
            assert all(p == {"waits": 0, "total_ns": 0, "max_ns": 0} for p in got["after_reset"][leg])
