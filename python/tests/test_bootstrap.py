"""Bootstraps from Python (the path ferry.init(group=...) takes, here with a bootstrap over pipes instead of
torch.distributed), their failures as BootstrapError, and a rank that never arrives as TimeoutError."""

from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest

import ferry
import reference as ref
from support import run_ranks


class PipeBootstrap:
    """The bootstrap protocol over pipes to rank 0 (a star): rank 0 gathers and answers every collective."""

    def __init__(self, rank, world, links, fail_on=None, timeout=20.0):
        self.rank, self.world = rank, world
        self.local_rank, self.local_world = rank, world
        self._links = links  # links[r] = (rank 0's end, rank r's end) for r >= 1
        self._fail_on = fail_on
        self._timeout = timeout
        self.calls = []

    def _recv(self, conn):
        if not conn.poll(self._timeout):
            raise TimeoutError(f"rank {self.rank}: no message within {self._timeout} s")
        return conn.recv()

    def allgather(self, data):
        self.calls.append("allgather")
        if self._fail_on == "allgather":
            raise RuntimeError("boom: the test's bootstrap failed")
        if self.rank == 0:
            blocks = [data] + [self._recv(self._links[r][0]) for r in range(1, self.world)]
            for r in range(1, self.world):
                self._links[r][0].send(blocks)
            return blocks
        self._links[self.rank][1].send(data)
        return self._recv(self._links[self.rank][1])

    def broadcast(self, data, root):
        self.calls.append("broadcast")
        return self.allgather(data)[root]

    def barrier(self):
        self.calls.append("barrier")
        self.allgather(b"")


def _links(world):
    return [None] + [mp.get_context("fork").Pipe() for _ in range(1, world)]


def _python_bootstrap_body(ctx, links, config, num_tokens, seed):
    boot = PipeBootstrap(ctx.rank, ctx.world, links)
    comm = ferry.init(backend="cpu", bootstrap=boot)
    assert (comm.rank, comm.world, comm.local_rank, comm.local_world) == (ctx.rank, ctx.world, ctx.rank, ctx.world)
    buf = ferry.EpBuffer(comm, **config.kwargs())
    mine = ref.make_inputs(config, num_tokens, seed)[ctx.rank]
    got = buf.dispatch(mine.x, mine.topk_idx, mine.topk_weights)
    comm.barrier()
    return {"recv_x": np.array(got.recv_x), "calls": sorted(set(boot.calls))}


def test_python_bootstrap_sets_up_a_working_communicator():
    config = ref.Config(64, 4, 2, 6)
    num_tokens = [6, 4]
    results = run_ranks(_python_bootstrap_body, 2, _links(2), config, num_tokens, 11)
    inputs = ref.make_inputs(config, num_tokens, 11)
    for rank in range(2):
        np.testing.assert_array_equal(results[rank]["recv_x"], ref.dispatch(config, 2, rank, inputs).recv_x)
        assert "allgather" in results[rank]["calls"] or "broadcast" in results[rank]["calls"]


def _failing_bootstrap_body(ctx, links):
    boot = PipeBootstrap(ctx.rank, ctx.world, links, fail_on="allgather", timeout=5.0)
    try:
        ferry.init(backend="cpu", bootstrap=boot)
    except ferry.BootstrapError as error:
        return str(error)
    return "no error"


def test_python_exception_in_the_bootstrap_is_a_bootstrap_error():
    messages = run_ranks(_failing_bootstrap_body, 2, _links(2))
    for message in messages:
        assert message.startswith("bootstrap error ("), message
        assert "boom: the test's bootstrap failed" in message


def test_bad_bootstrap_object():
    class Missing:
        rank, world = 0, 1

    with pytest.raises(AttributeError):
        ferry.init(backend="cpu", bootstrap=Missing())

    class OutOfRange:
        rank, world, local_rank, local_world = 3, 2, 0, 1

    with pytest.raises(ferry.BootstrapError, match="rank=3 world=2"):
        ferry.init(backend="cpu", bootstrap=OutOfRange())


def _absent_rank_body(ctx):
    comm = ctx.init()
    buf = ferry.EpBuffer(comm, hidden=64, num_experts=2, topk=1, max_tokens_per_rank=4)
    if ctx.rank == 1:
        time.sleep(4.0)  # never calls dispatch; stays alive past rank 0's timeout
        return None
    x = np.zeros((2, 64), np.uint16)
    idx = np.array([[0], [1]], np.int64)
    w = np.ones((2, 1), np.float32)
    start = time.monotonic()
    try:
        buf.dispatch(x, idx, w)
    except ferry.TimeoutError as error:
        first = str(error)
    else:
        return "no timeout"
    elapsed = time.monotonic() - start
    try:
        buf.dispatch(x, idx, w)
    except ferry.Error as error:
        later = (type(error).__name__, str(error))
    return first, elapsed, comm.failed, later


def test_a_rank_that_never_arrives_is_a_timeout_naming_it():
    results = run_ranks(_absent_rank_body, 2, env={"FERRY_TIMEOUT_S": "1"}, timeout=30.0)
    first, elapsed, failed, later = results[0]
    assert first.startswith("timeout error ("), first
    assert "waiting for rank(s) 1" in first
    assert elapsed < 10.0
    assert failed
    assert "waiting for rank(s) 1" in later[1]
