"""ferry.deep_ep's legacy Buffer in the places DeepEP's own tests (tests/legacy/test_intranode.py,
test_low_latency.py, test_internode.py) and training clients go past the routed calls of test_deep_ep_compat.py:

- dispatch by rank membership alone (is_token_in_rank, no topk_idx), its cached dispatch and its combine (an
  unweighted sum of a token's rows); the per-expert counts of such a dispatch;
- the handle's fields DeepEP's tests read: rank_prefix_matrix (handle[0]) and, across nodes, is_token_in_rank
  (handle[0]) and recv_gbl_rank_prefix_sum (handle[-4]); num_tokens_per_rdma_rank;
- a cached dispatch of x in another format than the handle's dispatch (bf16 through an fp8 layout and back);
- an EventOverlap without an event as previous_event (a layout computed with async_finish=False);
- combine with a bias (one tensor or two), added in fp32 before the one rounding;
- a capacity drop through num_worst_tokens: an error on every rank, never numbers (issue 58, item 2);
- low-latency handles checked: another Buffer's, one kept past destroy(), and a call after destroy() are InputError
  naming the problem (issue 58, item 4); the empty events of calls without async_finish are fresh per call;
- num_rdma_bytes pays for the low-latency pool's whole footprint, to the byte, and the size hint covers it.

The expectations are computed here from every rank's inputs (each rank draws all ranks' with the seed), in the order
Ferry delivers: (source rank, source token). cpu backend, torch CPU tensors, ranks as processes joined by a gloo
group. Each family was made to fail once on purpose: handle[0] without its prefix sum, and the synthesized routing
sent to the next rank (test_dispatch_by_rank_membership failed at worlds 2 and 4); the cached dispatch kept on the
handle's own EpBuffer whatever the format (both worlds failed: the binding refused the other format); the bias
added to the rounded combine (world 2 on the sums, world 1 on the bias shape no longer checked); EpBuffer's refusal
of a combine over a layout that dropped removed (DID NOT RAISE on rank 0); the low-latency handle's owner checks
removed (both worlds failed); one shared empty event returned by every call (a hook is already registered); the
layer's own low-latency byte formula in place of the footprint (the pool held other than the refusal named).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="ferry.deep_ep needs torch (scripts/python-tests.sh installs it)")

import ferry  # noqa: E402
from support import run_torch_ranks, torch_cuda_backend  # noqa: E402

# NOTE: the expectations are built from torch CPU tensors on the cpu backend; on a GPU machine (the cuda backend)
# DeepEP's own programs are the check (tools/dev/run-deepep-tests.sh, docs/deep_ep.md)
pytestmark = pytest.mark.skipif(
    torch_cuda_backend(), reason="cpu-backend checks; on GPUs tools/dev/run-deepep-tests.sh runs DeepEP's own tests")

SEED = int(os.environ.get("FERRY_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
print(f"deep_ep legacy tests: seed {SEED} (FERRY_TEST_SEED={SEED} replays it)")

HIDDEN = 256
TOKENS = 20
TOPK = 3


def _num_experts(world: int) -> int:
    return max(4, 2 * world)  # >= TOPK, a multiple of the world


def _group(ctx):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank, world_size=ctx.world)
    return dist.group.WORLD


def _inputs(world: int, rank: int, seed: int, num_experts: int):
    """One rank's tokens: x (rows of rank-constant values in the first half, random in the second), distinct expert
    ids with a few -1, weights."""
    gen = torch.Generator().manual_seed(seed * 7919 + rank)
    scores = torch.rand((TOKENS, num_experts), generator=gen) + 0.1
    idx = torch.topk(scores, TOPK, dim=-1).indices.to(torch.int64)
    idx[torch.rand((TOKENS, TOPK), generator=gen) < 0.15] = -1
    x = torch.randn((TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    x[:, : HIDDEN // 2] = float(rank)
    w = torch.rand((TOKENS, TOPK), generator=gen) + 0.1
    return x, idx, w


def _to_fp8(x):
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    return (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h), amax / 448.0


def _in_rank(idx, world: int, num_experts: int):
    per = num_experts // world
    hit = torch.zeros((idx.size(0), world), dtype=torch.bool)
    for r in range(world):
        hit[:, r] = ((idx >= 0) & (idx // per == r)).any(dim=1)
    return hit


def _expected(world: int, seed: int, num_experts: int, rank: int):
    """What rank receives (rows in (source, token) order), the count matrix [source, destination], and the global
    per-expert counts of this rank's experts."""
    rows, counts = [], torch.zeros((world, world), dtype=torch.int32)
    per_expert = torch.zeros(num_experts, dtype=torch.int64)
    for src in range(world):
        x, idx, _ = _inputs(world, src, seed, num_experts)
        hit = _in_rank(idx, world, num_experts)
        counts[src] = hit.sum(dim=0)
        rows.append(x[hit[:, rank]])
        for e in range(num_experts):
            per_expert[e] += int((idx == e).sum())
    per = num_experts // world
    return torch.cat(rows), counts, per_expert[rank * per:(rank + 1) * per].tolist()


# ---- dispatch by rank membership alone, handle[0], cached dispatch, EventOverlap(None) --------------------------


def _rank_only_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    num_experts = _num_experts(world)
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world),
                            explicitly_destroy=True)
    x, idx, _ = _inputs(world, rank, seed, num_experts)
    want_rows, want_counts, want_experts = _expected(world, seed, num_experts, rank)
    # a layout computed without async_finish: its EventOverlap holds no event, and clients pass it on as is
    per_rank, rdma, per_expert, in_rank, layout_event = buffer.get_dispatch_layout(idx, num_experts)
    assert layout_event.event is None and rdma is None
    recv_x, recv_idx, recv_w, counts, handle, event = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
        previous_event=layout_event, expert_alignment=1)
    assert recv_idx is None and recv_w is None and event.event is None
    assert torch.equal(recv_x, want_rows), "rows in (source rank, source token) order"
    assert counts == want_experts, (counts, want_experts)
    prefix = handle[0]
    assert prefix.dtype == torch.int32 and torch.equal(prefix, want_counts.cumsum(0).to(torch.int32)), prefix
    # DeepEP's check_data: rank i's rows are [prefix[i - 1][rank], prefix[i][rank])
    start = 0
    for i in range(world):
        end = int(prefix[i][rank])
        assert bool((recv_x[start:end, : HIDDEN // 2].float() == i).all()), f"rows of rank {i}"
        start = end
    assert torch.equal(handle[4], in_rank) and len(handle) == 6
    with pytest.raises(ferry.InputError, match="channel_prefix_matrix"):
        handle[1]
    # cached dispatch of the same layout, then the combine: an unweighted sum over the ranks the token went to
    cached, *rest = buffer.dispatch(x, handle=handle)
    assert torch.equal(cached, want_rows) and rest[:4] == [None, None, None, None]
    y, combined_w, _ = buffer.combine(cached, handle)
    assert combined_w is None
    hits = in_rank.sum(dim=1, keepdim=True).float()
    assert torch.equal(y, (x.float() * hits).to(torch.bfloat16)), "sum of a token's copies"
    # alignment: the list rounded up as DeepEP's
    _, _, _, aligned, _, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                             num_tokens_per_expert=per_expert, expert_alignment=4)
    assert aligned == [-(-c // 4) * 4 for c in want_experts]
    buffer.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2, 4])
def test_dispatch_by_rank_membership(world):
    assert run_torch_ranks(_rank_only_body, world, SEED) == [True] * world


# ---- a cached dispatch in another format than the handle's -------------------------------------------------------


def _format_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    num_experts = _num_experts(world)
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world))
    x, idx, w = _inputs(world, rank, seed, num_experts)
    x8 = _to_fp8(x)
    want_rows, _, _ = _expected(world, seed, num_experts, rank)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)
    # the fp8 rows every rank would receive: the same selection of each source's quantized rows
    src_fp8 = [_to_fp8(_inputs(world, s, seed, num_experts)[0]) for s in range(world)]
    hits = [_in_rank(_inputs(world, s, seed, num_experts)[1], world, num_experts)[:, rank] for s in range(world)]
    want_payload = torch.cat([p[h].view(torch.uint8) for (p, _), h in zip(src_fp8, hits)])
    want_scales = torch.cat([sc[h] for (_, sc), h in zip(src_fp8, hits)])
    for first, then in (("bf16", "fp8"), ("fp8", "bf16")):
        for routed in (True, False):
            args = dict(kw, topk_idx=idx, topk_weights=w) if routed else kw
            _, _, _, _, handle, _ = buffer.dispatch(x if first == "bf16" else x8, **args)
            got = buffer.dispatch(x8 if then == "fp8" else x, handle=handle)[0]
            if then == "fp8":
                assert torch.equal(got[0].view(torch.uint8), want_payload) and torch.equal(got[1], want_scales)
            else:
                assert torch.equal(got, want_rows)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_cached_dispatch_in_another_format(world):
    assert run_torch_ranks(_format_body, world, SEED) == [True] * world


# ---- combine with a bias -----------------------------------------------------------------------------------------


def _bias_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    num_experts = _num_experts(world)
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world))
    x, idx, w = _inputs(world, rank, seed, num_experts)
    gen = torch.Generator().manual_seed(seed + 31 * rank)
    b0 = torch.randn((TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    b1 = torch.randn((TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_tokens_per_rank=per_rank, is_token_in_rank=in_rank,
                                                 num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    rows = (recv_x.float() * 0.5 + 0.25).to(torch.bfloat16)  # every copy of token t on rank d: its own row
    # the expected sum: each token's rows over the ranks it went to, ascending, in fp32, then the bias, rounded once
    acc = torch.zeros((TOKENS, HIDDEN), dtype=torch.float32)
    for d in range(world):
        if bool(in_rank[:, d].any()):
            acc = acc + torch.where(in_rank[:, d:d + 1], (x.float() * 0.5 + 0.25).to(torch.bfloat16).float(), 0.0)
    for bias, init in ((b0, b0.float()), ((b0, b1), b0.float() + b1.float())):
        y, _, _ = buffer.combine(rows, handle, bias=bias)
        assert torch.equal(y, (init + acc).to(torch.bfloat16))
    with pytest.raises(ferry.InputError, match="bias"):
        buffer.combine(rows, handle, bias=(b0, b1[:1]))
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_combine_with_bias(world):
    assert run_torch_ranks(_bias_body, world, SEED) == [True] * world


# ---- across nodes (emulated): num_tokens_per_rdma_rank and the internode handle ----------------------------------


def _internode_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    num_experts = _num_experts(world)
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world))
    assert deep_ep.get_physical_domain_size(group) == (2, world // 2)
    x, idx, w = _inputs(world, rank, seed, num_experts)
    want_rows, want_counts, want_experts = _expected(world, seed, num_experts, rank)
    per_rank, rdma, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, num_experts)
    local = world // 2
    assert torch.equal(rdma, in_rank.view(TOKENS, 2, local).any(dim=2).sum(dim=0).to(torch.int32))
    recv_x, _, _, counts, handle, _ = buffer.dispatch(
        x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma, is_token_in_rank=in_rank,
        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    assert torch.equal(recv_x, want_rows) and counts == want_experts
    assert len(handle) == 10 and torch.equal(handle[0], in_rank)
    assert torch.equal(handle[-4], want_counts[:, rank].cumsum(0).to(torch.int32))
    y, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(y, (x.float() * in_rank.sum(dim=1, keepdim=True).float()).to(torch.bfloat16))
    with pytest.raises(ferry.InputError, match="num_tokens_per_rdma_rank"):
        buffer.dispatch(x, num_tokens_per_rank=per_rank, num_tokens_per_rdma_rank=rdma[:1], is_token_in_rank=in_rank,
                        num_tokens_per_expert=per_expert, topk_idx=idx, topk_weights=w)
    return True


@pytest.mark.parametrize("topology", ["2x1", "2x2"])
def test_internode_handle(topology):
    world = 2 if topology == "2x1" else 4
    os.environ["FERRY_TOPOLOGY"] = topology
    try:
        assert run_torch_ranks(_internode_body, world, SEED) == [True] * world
    finally:
        del os.environ["FERRY_TOPOLOGY"]


# ---- issue 58, item 2: a capacity drop through num_worst_tokens ----------------------------------------------------


def _worst_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    rank = ctx.rank
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, 2))
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn((6, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.full((6, 1), 3, dtype=torch.int64)  # every token of both ranks to expert 3, on rank 1: 12 rows there
    w = torch.ones((6, 1))
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(idx, 4)
    kw = dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert, topk_idx=idx,
              topk_weights=w)
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_worst_tokens=8, **kw)  # rank 1 receives 12 rows
    with pytest.raises(ferry.InputError) as caught:
        buffer.combine(recv_x, handle)
    assert "did not deliver 4 row(s)" in str(caught.value) and "rank 1's capacity" in str(caught.value), caught.value
    # nothing is left pending: a dispatch that fits, then its combine, is right on every rank
    recv_x, _, _, _, handle, _ = buffer.dispatch(x, num_worst_tokens=12, **kw)
    y, _, _ = buffer.combine(recv_x, handle)
    assert torch.equal(y, x)
    return True


def test_num_worst_tokens_drop_is_an_error_on_every_rank():
    assert run_torch_ranks(_worst_body, 2, SEED) == [True, True]


# ---- issue 58, item 4: low-latency handles are checked -----------------------------------------------------------


def _ll_handles_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    experts = 2 * world
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, HIDDEN, world, experts)
    first = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=2, explicitly_destroy=True)
    second = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=2, explicitly_destroy=True)
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn((3, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:2] for _ in range(3)])
    w = torch.rand((3, 2), generator=gen)
    want = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)

    def pair(buf):
        recv_x, _, handle, _, _ = buf.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)
        return recv_x, handle

    recv_x, handle = pair(first)
    with pytest.raises(ferry.InputError, match="another Buffer"):
        second.low_latency_combine(recv_x, idx, w, handle)
    with pytest.raises(ferry.InputError, match="another Buffer"):
        second.get_next_low_latency_combine_buffer(handle)
    y, _, _ = first.low_latency_combine(recv_x, idx, w, handle)  # the refusals left both buffers usable
    assert (y.float() - want.float()).abs().max() < 0.05
    recv_x, kept = pair(first)
    first.destroy()
    with pytest.raises(ferry.InputError, match="destroy"):
        first.low_latency_combine(recv_x, idx, w, kept)
    with pytest.raises(ferry.InputError, match="destroy"):
        first.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)
    with pytest.raises(ferry.InputError, match="destroy"):
        second.low_latency_combine(recv_x, idx, w, kept)
    recv_x, handle = pair(second)
    y, _, _ = second.low_latency_combine(recv_x, idx, w, handle)
    assert (y.float() - want.float()).abs().max() < 0.05
    # calls without async_finish return fresh empty events, as DeepEP's: a hook registered on one stays with it (a
    # shared one refuses the second hook)
    events = [second.low_latency_dispatch(x, idx, 4, experts, use_fp8=False)[3] for _ in range(2)]
    for event in events:
        assert isinstance(event, deep_ep.EventOverlap) and event.event is None and event.extra_tensors is None
        event.register_hook_after_wait(lambda: None)
        with event:  # nothing to wait for
            pass
    second.destroy()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_low_latency_handles_are_checked(world):
    assert run_torch_ranks(_ll_handles_body, world, SEED) == [True] * world


# ---- num_rdma_bytes pays for the low-latency pool's whole footprint -------------------------------------------------


def _ll_budget_body(ctx, seed):
    import re

    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    experts, tokens = 2 * world, 4
    topk = min(experts, 16)  # the largest a call of these shapes can use
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(tokens, HIDDEN, world, experts)
    gen = torch.Generator().manual_seed(seed + rank)
    x = torch.randn((tokens, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:topk] for _ in range(tokens)])

    def dispatch(num_rdma_bytes):
        """The call on a fresh Buffer; the whole footprint of the EpBuffers its low-latency pool made (from their
        own configs)."""
        buffer = deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=2,
                                explicitly_destroy=True)
        try:
            buffer.low_latency_dispatch(x, idx, tokens, experts, use_fp8=False)
            made = [b.config for pool in buffer._pools.values() if pool.key[0] == "ll" for b in pool.buffers]
            return sum(ferry.EpBuffer.footprint(
                world, backend="cpu", hidden=c.hidden, num_experts=c.num_experts, topk=c.topk,
                max_tokens_per_rank=c.max_tokens_per_rank, expert_capacity=c.expert_capacity,
                dispatch_format=c.dispatch_format, recv_scale_layout=c.recv_scale_layout, mode=c.mode)["total"]
                for c in made)
        finally:
            buffer.destroy()

    with pytest.raises(ferry.ConfigError, match="get_low_latency_rdma_size_hint") as refused:
        dispatch(1024)
    need = int(re.search(r"they need (\d+) bytes", str(refused.value)).group(1))
    assert 1024 < need <= hint, (need, hint)
    with pytest.raises(ferry.ConfigError, match=f"they need {need} bytes"):
        dispatch(need - 1)  # the budget is the footprint, to the byte
    assert dispatch(need) == need  # what the refusal named is what the pool holds
    dispatch(hint)
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_low_latency_budget_is_the_pools_footprint(world):
    assert run_torch_ranks(_ll_budget_body, world, SEED) == [True] * world
