"""ferry.deep_ep.ElasticBuffer (DeepEP V2's expert-parallel surface) against expectations computed here from every
rank's inputs, through the calls DeepEP's tests/elastic/test_ep.py makes: construction from shapes, the domain sizes,
the SM and QP answers, dispatch (bf16, fp8 with float32 or packed UE8M0 scales; expert alignment; with and without a
host synchronisation; expanded; cached, expanded with new weights and zero padding; previous_event, async finish,
the cumulative expert counts, handle copies), the EPHandle's fields, combine (rank rows and the reduced combine of
expanded rows, with one or two biases, the top-k weights back bit for bit), barrier, destroy, and the refusals (what
Ferry does not do, and handles of another buffer or kept past destroy()).

Ferry's order is (source rank, source token), so unlike DeepEP's own test (which sorts by recv_src_metadata) rows are
compared in place. The combine's expectation is Ferry's arithmetic: a token's rows summed over the ranks ascending in
fp32 from the bias (b0 + b1) or +0.0, rounded once; a reduced combine first sums each received token's expanded rows
in top-k order in fp32 from +0.0 and rounds. cpu backend, torch CPU tensors, gloo groups; worlds 1, 2 and 4 (2 nodes
of 2, emulated: FERRY_TOPOLOGY). The expanded rows of a token's entries are +2^30, -2^30 and ordinary values, so that
a sum in another order than top-k's gives another result. Made to fail once on purpose, each: the expanded rows in
reverse order within an expert, the reduced combine's entries summed from the last one, the weights back without
the owner's mask (the 10 cases of test_dispatch_and_combine failed, each time); the per-source counts not folded
onto the scale-up index (test_two_nodes_of_two failed).
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
print(f"deep_ep elastic tests: seed {SEED} (FERRY_TEST_SEED={SEED} replays it)")

HIDDEN = 512  # four fp8 blocks: one packed UE8M0 int32 per token
TOPK = 3
MAX_TOKENS = 16


def _group(ctx):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank, world_size=ctx.world)
    return dist.group.WORLD


def _experts(world: int) -> int:
    return 4 * world


def _inputs(world: int, rank: int, seed: int):
    """A rank's tokens (fewer on higher ranks, as test_ep.py), distinct ids with a few -1 (weight 0 there)."""
    gen = torch.Generator().manual_seed(seed * 104729 + rank)
    tokens = MAX_TOKENS - rank
    scores = torch.rand((tokens, _experts(world)), generator=gen) + 0.1
    weights, idx = torch.topk(scores, TOPK, dim=-1, sorted=False)
    masked = torch.rand((tokens, TOPK), generator=gen) < 0.1
    idx = idx.masked_fill(masked, -1)
    weights = weights.masked_fill(masked, 0.0)
    x = torch.randn((tokens, HIDDEN), generator=gen).to(torch.bfloat16)
    return x, idx, weights


def _to_fp8(x, packed: bool):
    """Per-token e4m3 with one scale per 128: float32 amax / 448, or (packed) powers of two, four UE8M0 exponent
    bytes per int32."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    scale = blocks.abs().amax(dim=2).clamp(min=1e-4) / 448.0
    if packed:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    payload = (blocks / scale.unsqueeze(2)).to(torch.float8_e4m3fn).view(t, h)
    if not packed:
        return payload, scale
    exponents = ((scale.view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return payload, exponents.contiguous().view(torch.int32)


def _received(world: int, rank: int, seed: int, kind: str):
    """What rank receives, in (source rank, source token) order: rows (x, or fp8 payload and scales), local ids,
    weights masked to the local entries, global source indices; and the rows per source rank."""
    per = _experts(world) // world
    out = dict(x=[], sf=[], idx=[], w=[], src=[], per_source=[])
    for s in range(world):
        x, idx, w = _inputs(world, s, seed)
        hit = ((idx >= 0) & (idx // per == rank)).any(dim=1)
        local = (idx >= 0) & (idx // per == rank)
        if kind == "bf16":
            out["x"].append(x[hit])
        else:
            payload, sf = _to_fp8(x, kind == "ue8m0")
            out["x"].append(payload[hit].view(torch.uint8))
            out["sf"].append(sf[hit])
        out["idx"].append(torch.where(local, idx - rank * per, -1)[hit])
        out["w"].append(torch.where(local, w, 0.0)[hit])
        out["src"].append(torch.nonzero(hit).view(-1).to(torch.int32) + s * MAX_TOKENS)
        out["per_source"].append(int(hit.sum()))
    return {k: (torch.cat(v) if k != "per_source" and v else v) for k, v in out.items()}


def _rows_for_combine(src_global: torch.Tensor) -> torch.Tensor:
    """A received row's value as a function of its source's global token index (any rank can compute any rank's)."""
    cols = torch.arange(HIDDEN, dtype=torch.float32)
    return torch.sin(src_global.float().unsqueeze(1) * 0.37 + cols * 0.013).to(torch.bfloat16)


def _entry_rows(src_global: torch.Tensor, k: int) -> torch.Tensor:
    """The expanded row of entry k of a token: +2^30, -2^30, then ordinary values, so that a sum of a token's entries
    in another order than top-k's gives another result (2^30 - 2^30 + v = v, while v - 2^30 + 2^30 = 0 in fp32)."""
    if k % 3 == 2:
        return _rows_for_combine(src_global * TOPK + k)
    return torch.full((src_global.numel(), HIDDEN), 2.0**30 if k % 3 == 0 else -2.0**30, dtype=torch.bfloat16)


def _expected_combine(world: int, rank: int, seed: int, bias_init, expanded: bool, nodes: int = 1):
    """combined_x of rank's tokens (Ferry's order, src/ep/reference.hpp): from +0.0, over the nodes ascending: the
    own node adds each rank's row of t (ranks ascending), another node one row, its ranks' rows summed in fp32 from
    +0.0 and rounded; then the bias (b0 + b1, fp32) plus that sum, rounded once. A rank's row of t is its rank row,
    or (expanded) its entries of t summed in top-k order in fp32 from +0.0, rounded."""
    x, idx, _ = _inputs(world, rank, seed)
    per = _experts(world) // world
    local_ranks = world // nodes
    tokens = x.size(0)
    acc = torch.zeros((tokens, HIDDEN))
    glob = torch.arange(tokens, dtype=torch.int32) + rank * MAX_TOKENS

    def row_of(d):
        local = (idx >= 0) & (idx // per == d)
        if not expanded:
            return local.any(dim=1), _rows_for_combine(glob).float()
        row = torch.zeros((tokens, HIDDEN))
        for k in range(TOPK):
            row = row + torch.where(local[:, k:k + 1], _entry_rows(glob, k).float(), 0.0)
        return local.any(dim=1), row.to(torch.bfloat16).float()

    for node in range(nodes):
        ranks = range(node * local_ranks, (node + 1) * local_ranks)
        if node == rank // local_ranks:
            for d in ranks:
                hit, row = row_of(d)
                acc = acc + torch.where(hit.unsqueeze(1), row, 0.0)
            continue
        partial, any_hit = torch.zeros((tokens, HIDDEN)), torch.zeros(tokens, dtype=torch.bool)
        for d in ranks:
            hit, row = row_of(d)
            partial = partial + torch.where(hit.unsqueeze(1), row, 0.0)
            any_hit |= hit
        acc = acc + torch.where(any_hit.unsqueeze(1), partial.to(torch.bfloat16).float(), 0.0)
    return (acc if bias_init is None else bias_init + acc).to(torch.bfloat16)


def _body(ctx, seed, kind, alignment, sync):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    experts = _experts(world)
    local_experts = experts // world
    buffer = deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                   use_fp8_dispatch=kind != "bf16", deterministic=True, explicitly_destroy=True)
    scaleout, scaleup = buffer.get_logical_domain_size()
    assert scaleout * scaleup == world and buffer.scaleup_rank_idx == rank % scaleup
    assert buffer.get_theoretical_num_sms(experts, TOPK) == 1 and buffer.get_theoretical_num_qps(1) == 0
    x, idx, w = _inputs(world, rank, seed)
    xin = x if kind == "bf16" else _to_fp8(x, kind == "ue8m0")
    want = _received(world, rank, seed, kind)
    n = sum(want["per_source"])
    stats = torch.zeros(local_experts, dtype=torch.int32)
    args = dict(x=xin, topk_idx=idx, topk_weights=w, num_experts=experts, num_max_tokens_per_rank=MAX_TOKENS,
                expert_alignment=alignment, do_cpu_sync=sync, do_handle_copy=True,
                cumulative_local_expert_recv_stats=stats, previous_event=buffer.capture(),
                allocate_on_comm_stream=True, async_with_compute_stream=True)
    recv_x, recv_idx, recv_w, handle, event = buffer.dispatch(**args)
    event.current_stream_wait()
    rows = n if sync else world * MAX_TOKENS
    payload = recv_x if kind == "bf16" else recv_x[0].view(torch.uint8)
    assert payload.size(0) == rows and handle.num_recv_tokens == rows
    assert torch.equal(payload[:n], want["x"]) and torch.equal(recv_idx[:n], want["idx"])
    assert bool((recv_idx[n:] == -1).all()) and torch.equal(recv_w[:n], want["w"])
    if kind != "bf16":
        assert torch.equal(recv_x[1][:n], want["sf"])
    counts = torch.stack([(want["idx"] == e).sum() for e in range(local_experts)]).to(torch.int32)
    aligned = (counts + alignment - 1) // alignment * alignment
    assert torch.equal(stats, counts) and torch.equal(handle.num_unaligned_recv_tokens_per_expert, counts)
    assert handle.num_recv_tokens_per_expert_list == (aligned.tolist() if sync else [])
    assert torch.equal(handle.psum_num_recv_tokens_per_expert, aligned.cumsum(0).to(torch.int32))
    per_source = torch.tensor(want["per_source"])
    assert torch.equal(handle.psum_num_recv_tokens_per_scaleup_rank,
                       per_source.view(scaleout, scaleup).sum(0).cumsum(0).to(torch.int32))
    assert torch.equal(handle.recv_src_metadata[:n, 0], want["src"])
    assert handle.topk_idx.data_ptr() != idx.data_ptr() and torch.equal(handle.topk_idx, idx)

    # expanded: one row per (token, local expert) entry, experts contiguous from aligned starts
    e_x, e_idx, e_w, e_handle, _ = buffer.dispatch(**dict(args, do_expand=True, use_tma_aligned_col_major_sf=True,
                                                          cumulative_local_expert_recv_stats=None))
    e_payload = e_x if kind == "bf16" else e_x[0].view(torch.uint8)
    assert e_idx is None and e_handle.num_expanded_tokens == (int(aligned.sum()) if sync else e_payload.size(0))
    starts = aligned.cumsum(0) - aligned
    assert torch.equal(e_handle.psum_num_recv_tokens_per_expert, (starts + counts).to(torch.int32))
    slots = e_handle.recv_src_metadata[:n, 2:]
    for e in range(local_experts):
        mine = slots[want["idx"] == e]  # this expert's entries, in (row, k) order
        assert torch.equal(mine, starts[e] + torch.arange(int(counts[e]), dtype=torch.int32)), f"expert {e}"
    for r in range(n):
        for k in range(TOPK):
            s = int(slots[r, k])
            assert (s >= 0) == bool(want["idx"][r, k] >= 0)
            if s >= 0:
                assert torch.equal(e_payload[s], want["x"][r]) and float(e_w[s]) == float(want["w"][r, k])
                if kind != "bf16":
                    assert torch.equal(e_x[1][s], want["sf"][r]) and e_x[1].stride(0) == 1

    # cached: the same rows; expanded with new weights and zero padding
    c_x, c_idx, c_w, c_handle, _ = buffer.dispatch(x=xin, handle=handle)
    assert c_handle is handle and c_w is None and torch.equal(c_idx, recv_idx)
    assert torch.equal((c_x if kind == "bf16" else c_x[0].view(torch.uint8))[:n], want["x"])
    w2 = (w * 2.0).contiguous()
    ce_x, _, ce_w, _, _ = buffer.dispatch(x=xin, handle=e_handle, topk_weights=w2, do_expand=True,
                                          do_zero_padding=True)
    ce_payload = ce_x if kind == "bf16" else ce_x[0].view(torch.uint8)
    filled = torch.zeros(ce_payload.size(0), dtype=torch.bool)
    filled[slots[slots >= 0].long()] = True
    assert torch.equal(ce_payload[filled], e_payload[filled]) and torch.equal(ce_w[filled], e_w[filled] * 2.0)
    assert bool((ce_payload[~filled] == 0).all()) and bool((ce_w[~filled] == 0).all())

    # combine: rank rows (and the weights back); then the reduced combine of expanded rows, with biases
    src = handle.recv_src_metadata[:, 0]
    rows_in = _rows_for_combine(src)
    gen = torch.Generator().manual_seed(seed + 17 * rank)
    b0 = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    b1 = torch.randn(x.shape, generator=gen).to(torch.bfloat16)
    # DeepEP's recv_topk_weights hold the token's whole row (Ferry's: 0 at entries of other ranks' experts); either
    # way each weight comes back from the rank of its expert alone
    unmasked = torch.where(recv_idx >= 0, recv_w, 7.0)
    y, y_w, _ = buffer.combine(rows_in, handle, topk_weights=unmasked)
    assert torch.equal(y, _expected_combine(world, rank, seed, None, False, scaleout))
    assert torch.equal(y_w, w), "each weight back from the rank of its expert, bit for bit"
    y, _, _ = buffer.combine(rows_in, handle, bias=(b0, b1))
    assert torch.equal(y, _expected_combine(world, rank, seed, b0.float() + b1.float(), False, scaleout))
    expanded_in = torch.zeros((e_payload.size(0), HIDDEN), dtype=torch.bfloat16)
    for r in range(n):
        for k in range(TOPK):
            if int(slots[r, k]) >= 0:
                expanded_in[int(slots[r, k])] = _entry_rows(src[r:r + 1], k)[0]
    y, y_w, _ = buffer.combine(expanded_in, e_handle, topk_weights=e_w, bias=b0)
    assert torch.equal(y, _expected_combine(world, rank, seed, b0.float(), True, scaleout))
    assert torch.equal(y_w, w)
    buffer.barrier(with_cpu_sync=True)
    buffer.destroy()
    return True


CASES = [("bf16", 1, True), ("bf16", 4, False), ("fp8", 1, True), ("ue8m0", 4, True), ("fp8", 4, False)]


@pytest.mark.parametrize("kind, alignment, sync", CASES, ids=[f"{k}-align{a}-{'sync' if s else 'nosync'}"
                                                               for k, a, s in CASES])
@pytest.mark.parametrize("world", [1, 2])
def test_dispatch_and_combine(world, kind, alignment, sync):
    assert run_torch_ranks(_body, world, SEED, kind, alignment, sync) == [True] * world


def test_two_nodes_of_two():
    os.environ["FERRY_TOPOLOGY"] = "2x2"
    try:
        assert run_torch_ranks(_body, 4, SEED, "bf16", 4, True) == [True] * 4
    finally:
        del os.environ["FERRY_TOPOLOGY"]


def _refusals_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    with pytest.raises(ferry.ConfigError, match="Engram"):
        deep_ep.ElasticBuffer(group, num_bytes=1 << 22, num_cpu_bytes=1 << 21)
    with pytest.raises(ferry.ConfigError, match="allow_multiple_reduction"):
        deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=4, hidden=HIDDEN, allow_multiple_reduction=False)
    small = deep_ep.ElasticBuffer(group, num_bytes=1024, explicitly_destroy=True)
    x, idx, w = _inputs(world, rank, seed)
    with pytest.raises(ferry.ConfigError, match="num_bytes >= "):
        small.dispatch(x, idx, w, num_experts=_experts(world), num_max_tokens_per_rank=MAX_TOKENS)
    for call in (lambda: small.engram_write(None), lambda: small.pp_send(None, 0),
                 lambda: small.all_gather(None), lambda: deep_ep.ElasticBuffer.get_pp_buffer_size_hint(1, 1),
                 lambda: small.get_comm_stream()):
        with pytest.raises(ferry.InputError, match="not supported"):
            call()
    buffers = [deep_ep.ElasticBuffer(group, num_max_tokens_per_rank=MAX_TOKENS, hidden=HIDDEN, num_topk=TOPK,
                                     explicitly_destroy=True) for _ in range(2)]
    recv_x, _, recv_w, handle, _ = buffers[0].dispatch(x, idx, w, num_experts=_experts(world))
    with pytest.raises(ferry.InputError, match="another ElasticBuffer"):
        buffers[1].combine(recv_x, handle)
    buffers[0].combine(recv_x, handle)
    buffers[0].destroy()
    with pytest.raises(ferry.InputError, match="destroy"):
        buffers[1].combine(recv_x, handle)
    with pytest.raises(ferry.InputError, match="destroy"):
        buffers[0].dispatch(x, idx, w, num_experts=_experts(world))
    recv_x, _, _, handle, _ = buffers[1].dispatch(x, idx, None, num_experts=_experts(world))
    y, y_w, _ = buffers[1].combine(recv_x, handle)
    assert y_w is None and y.shape == x.shape
    small.destroy()
    buffers[1].destroy()
    return True


@pytest.mark.parametrize("world", [1, 2])
def test_refusals_and_handles(world):
    assert run_torch_ranks(_refusals_body, world, SEED) == [True] * world
