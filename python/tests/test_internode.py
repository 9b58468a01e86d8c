"""Hierarchical normal mode across emulated nodes on the cpu backend (docs/internode.md): ferry.init(topology=),
every row of dispatch and both combines against the Python reference with the same topology, and the bytes by
link (EpBuffer.link_bytes) against the count from the routing."""

from __future__ import annotations

import numpy as np
import pytest

import ferry
import reference as ref
from support import run_ranks

SEED = 20261202
POISON = 0xFFFF


def _body(ctx, config: ref.Config, num_tokens, topology, layout):
    comm = ctx.init(topology=topology)
    nodes, local = comm.topology
    assert nodes * local == ctx.world and f"{nodes}x{local}" == topology
    assert [comm.load_store_reachable(p) for p in range(ctx.world)] == [p // local == ctx.rank // local
                                                                       for p in range(ctx.world)]
    buf = ferry.EpBuffer(comm, **config.kwargs())
    mine = ref.make_inputs(config, num_tokens, SEED, 0.1, np.int64)[ctx.rank]
    got = buf.dispatch(mine.x, mine.topk_idx, mine.topk_weights, expand=layout == "expert")
    out = {"recv_x": np.asarray(got.recv_x).copy(), "recv_src": np.asarray(got.recv_src).copy(),
           "num_recv": got.num_recv_host}
    if layout == "expert":
        combine_x = ref.expert_outputs(config, ctx.world, ctx.rank, SEED)
    else:
        combine_x = np.asarray(got.recv_x).copy()
    y = np.full((len(mine.x), config.hidden), POISON, np.uint16)
    buf.combine(combine_x, layout, out=y)
    out["y"] = y
    out["bytes"] = buf.link_bytes()
    out["explain"] = buf.explain()
    return out


@pytest.mark.parametrize("layout", ["expert", "rank"])
@pytest.mark.parametrize("topology", ["2x1", "2x2", "4x2"])
def test_hierarchical_matches_reference(topology, layout):
    nodes, local = (int(v) for v in topology.split("x"))
    world = nodes * local
    config = ref.Config(64, 4 * world, 3, 8, expert_capacity=8 * world)
    num_tokens = [(3 * r + 5) % 9 for r in range(world)]
    results = run_ranks(_body, world, config, num_tokens, topology, layout)
    inputs = ref.make_inputs(config, num_tokens, SEED, 0.1, np.int64)
    received = [ref.dispatch(config, world, d, inputs) for d in range(world)]
    if layout == "expert":
        rows = [ref.reduce_local_experts(config, received[d], ref.expert_outputs(config, world, d, SEED))
                for d in range(world)]
    else:
        rows = [received[d].recv_x for d in range(world)]
    for rank, got in enumerate(results):
        n = received[rank].num_recv
        assert got["num_recv"] == n
        np.testing.assert_array_equal(got["recv_x"][:n], received[rank].recv_x, err_msg=f"rank {rank} recv_x")
        np.testing.assert_array_equal(got["recv_src"][:n], received[rank].recv_src)
        want = ref.combine(config, world, rank, inputs, received, rows, local=local)
        np.testing.assert_array_equal(got["y"], want, err_msg=f"rank {rank} y")
        assert f"hierarchical {topology}" in got["explain"]
    # the network bytes of dispatch: one row (bf16 + 8 bytes a column + 8) per (token, other node it reaches)
    per_row = config.hidden * 2 + 8 * config.topk + 8
    experts_per_rank = config.num_experts // world
    for rank, got in enumerate(results):
        idx = inputs[rank].topk_idx
        nodes_hit = [{int(e) // experts_per_rank // local for e in row if e >= 0} - {rank // local} for row in idx]
        assert got["bytes"]["dispatch"]["network_bytes"] == per_row * sum(len(h) for h in nodes_hit)
        assert got["bytes"]["dispatch"]["network_messages"] == sum(len(h) for h in nodes_hit)


def test_one_node_differs_from_hierarchical_reference():
    """The check above can fail: the reference of 2 nodes differs from one node's on these inputs."""
    config = ref.Config(64, 16, 3, 8, expert_capacity=32)
    num_tokens = [8, 8, 8, 8]
    inputs = ref.make_inputs(config, num_tokens, SEED, 0.0, np.int64)
    received = [ref.dispatch(config, 4, d, inputs) for d in range(4)]
    rows = [ref.reduce_local_experts(config, received[d], ref.expert_outputs(config, 4, d, SEED)) for d in range(4)]
    assert any(not np.array_equal(ref.combine(config, 4, r, inputs, received, rows, local=2),
                                  ref.combine(config, 4, r, inputs, received, rows)) for r in range(4))


def _ll_body(ctx, config: ref.Config, num_tokens, topology, route):
    comm = ctx.init(topology=topology)
    buf = ferry.EpBuffer(comm, **config.kwargs(), mode="ll", internode_route=route)
    assert buf.config.internode_route == route
    mine = ref.make_inputs(config, num_tokens, SEED, 0.1, np.int64)[ctx.rank]
    got = buf.dispatch(mine.x, mine.topk_idx, mine.topk_weights, return_recv_hook=True)
    got = buf.complete_dispatch()
    out = {"expert_x": np.asarray(got.expert_x).copy(), "expert_counts": np.asarray(got.expert_counts).copy()}
    y = np.full((len(mine.x), config.hidden), POISON, np.uint16)
    buf.combine(ref.expert_outputs(config, ctx.world, ctx.rank, SEED), "expert", out=y)
    out["y"] = y
    out["bytes"] = buf.link_bytes()
    return out


@pytest.mark.parametrize("route", ["forward", "direct"])
def test_low_latency_across_nodes(route):
    topology, local, world = "2x2", 2, 4
    config = ref.Config(64, 16, 3, 6, expert_capacity=24)
    num_tokens = [6, 0, 4, 5]
    results = run_ranks(_ll_body, world, config, num_tokens, topology, route)
    inputs = ref.make_inputs(config, num_tokens, SEED, 0.1, np.int64)
    received = [ref.dispatch(config, world, d, inputs) for d in range(world)]
    rows = [ref.reduce_local_experts(config, received[d], ref.expert_outputs(config, world, d, SEED))
            for d in range(world)]
    for rank, got in enumerate(results):
        np.testing.assert_array_equal(got["expert_counts"], received[rank].expert_counts)
        expanded = ref.expand(config, world, received[rank])
        for e, count in enumerate(np.minimum(received[rank].expert_counts, config.slots())):
            np.testing.assert_array_equal(got["expert_x"][e, :count], expanded[e, :count])
        want = ref.combine(config, world, rank, inputs, received, rows, local=local if route == "forward" else None)
        np.testing.assert_array_equal(got["y"], want, err_msg=f"rank {rank} y ({route})")
