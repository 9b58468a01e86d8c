"""ferry.deep_ep against the checks of DeepEP's own tests, as a behavioural spec of its API (ported, not copied).

The checks come from DeepEP's tests/test_intranode.py (test_main: layout, dispatch counts and rows, num_worst_tokens,
cached dispatch, combine tolerance) and tests/test_low_latency.py (test_main: per-expert counts, src_info and
layout_range, rows per source, combine tolerance, zero copy, hook and async modes), at the commit before DeepEP's
tests moved to tests/legacy/ (567632d); each test names the function its checks come from. On top of DeepEP's checks,
every received row is compared, order-independently, with the rows the reference routing sends (DeepEP's
check_data only sees rank-constant rows).

Ranks are processes (support.run_ranks) joined by a gloo torch.distributed group; cpu backend, torch CPU tensors.
Worlds 1, 2 and 4; on a machine with the cuda backend, world 1 on one GPU with CUDA tensors. Skips without torch.
The backward pass as engines run it (Megatron-LM's fused_a2a shape): combine(topk_weights=...) bit for bit against
an independent numpy reduction, and three layers forward and backward through torch.autograd Functions against a
dense reference, exact (torch.equal; each test also shows a perturbed reference is detected).
Each family was made to fail once on purpose (layout_range without the rank rotation of Ferry's expert-major order:
2 failed; combine without the weighted sum: 3 failed; the weight sums in descending rank order: world 4 of the numpy
reduction failed; every rank's weights in the same columns: worlds 2 and 4 of it and of the intranode port failed;
combine by the buffer's last layout instead of the handle's: the round trip failed at worlds 2 and 4; at world 1
the two layers' layouts coincide, one row per token in token order). Fresh data every
run, the seed printed (FERRY_TEST_SEED replays it).
"""

from __future__ import annotations

import os

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="ferry.deep_ep needs torch (scripts/python-tests.sh installs it)")

import ferry  # noqa: E402
from support import run_ranks, torch_cuda_backend  # noqa: E402
from support import run_torch_ranks as _run  # noqa: E402

# NOTE: with the cuda backend (a GPU machine) the layer takes CUDA tensors and each rank needs a GPU: world 1 runs in
# one forked rank, larger worlds skip. Without it: cpu backend, forked ranks.
CUDA = torch_cuda_backend()  # every body runs in forked ranks (_run), the GPU ones included
DEVICE = "cuda" if CUDA else "cpu"

SEED = int(os.environ.get("FERRY_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
print(f"deep_ep compat tests: seed {SEED} (FERRY_TEST_SEED={SEED} replays it)")

WORLDS = [1, 2, 4]
HIDDEN = 256  # two fp8 scale blocks; DeepEP's low-latency check uses the last 128 columns
TOPK = 4


def _num_experts(world: int) -> int:
    return max(8, 3 * world)  # >= TOPK, a multiple of world for 1, 2 and 4


TOKENS = 24


def calc_diff(x, y) -> float:
    """DeepEP's similarity measure (tests/utils.py calc_diff): 1 - 2<x+1, y+1> / (|x+1|^2 + |y+1|^2), in float64."""
    x, y = x.double() + 1, y.double() + 1
    return float(1 - 2 * (x * y).sum() / (x * x + y * y).sum())


def to_fp8(x):
    """Per-token, per-128 block e4m3 with float32 scale amax / 448 (DeepEP tests/utils.py per_token_cast_to_fp8)."""
    t, h = x.shape
    blocks = x.float().view(t, h // 128, 128)
    amax = blocks.abs().amax(dim=2).clamp(min=1e-4)
    payload = (blocks * (448.0 / amax.unsqueeze(2))).to(torch.float8_e4m3fn).view(t, h)
    return payload, amax / 448.0


def from_fp8(payload, scales):
    """Inverse of to_fp8; int32 scales are packed UE8M0 exponents (tests/utils.py per_token_cast_back)."""
    t, h = payload.shape
    if scales.dtype == torch.int32:
        exponents = torch.stack([(scales >> (8 * b)) & 0xFF for b in range(4)], dim=-1).reshape(t, -1)
        scales = (exponents[:, : h // 128].to(torch.int32) << 23).view(torch.float32)
    scales = scales.reshape(t, h // 128, 1)
    return (payload.float().view(t, h // 128, 128) * scales).view(t, h).to(torch.bfloat16)


def _routing(world: int, seed: int, rank: int, num_tokens: int = TOKENS, masks: int = 3):
    """One rank's top-k (distinct experts, a few -1), DeepEP's scores.abs() + 1 then topk."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    num_experts = _num_experts(world)
    scores = torch.randn((num_tokens, num_experts), generator=gen).abs() + 1
    idx = torch.topk(scores, TOPK, dim=-1, sorted=False).indices.to(torch.int64)
    for _ in range(masks):
        t = int(torch.randint(0, num_tokens, (1,), generator=gen))
        k = int(torch.randint(0, TOPK, (1,), generator=gen))
        idx[t, k] = -1
    weights = torch.rand((num_tokens, TOPK), generator=gen) + 0.1
    rand_x = torch.randn((num_tokens, HIDDEN), generator=gen).to(torch.bfloat16)
    return idx, weights, rand_x


def _group(ctx):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{ctx.port}", rank=ctx.rank, world_size=ctx.world)
    return dist.group.WORLD


def _dev(t):
    return t.to(DEVICE)


def _host(t):
    return t if t is None else t.cpu()


def _moved(value, to):
    if isinstance(value, torch.Tensor):
        return to(value)
    if isinstance(value, (tuple, list)):
        return type(value)(_moved(v, to) for v in value)
    return value


def _call(fn, *args, **kwargs):
    """fn with its tensor arguments on DEVICE and its tensor results back on the host (the checks run there)."""
    got = fn(*_moved(args, _dev), **{k: _moved(v, _dev) for k, v in kwargs.items()})
    return _moved(got, _host)


def _expected_rows(world: int, seed: int, dst: int, num_experts: int, which: str):
    """The rows rank dst receives under the reference routing, in (source rank, source token) order."""
    per_rank = num_experts // world
    rows = []
    for src in range(world):
        idx, _, rand_x = _routing(world, seed, src)
        x = rand_x if which == "rand" else torch.full((TOKENS, HIDDEN), float(src), dtype=torch.bfloat16)
        hit = ((idx >= 0) & (idx // per_rank == dst)).any(dim=1)
        rows.append(x[hit])
    return torch.cat(rows)


def _sorted_rows(rows):
    """Rows sorted lexicographically: an order-independent comparison of two row sets."""
    keys = rows.float().numpy()
    return keys[np.lexsort(keys.T[::-1])]


# ---- tests/test_intranode.py, test_main --------------------------------------------------------------------------


def _intranode_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    rank, world = ctx.rank, ctx.world
    num_experts = _num_experts(world)
    buffer = deep_ep.Buffer(group, int(4e6), 0, explicitly_destroy=True)
    topk_idx, topk_weights_rand, x_rand = _routing(world, seed, rank)
    x_rank = torch.full((TOKENS, HIDDEN), float(rank), dtype=torch.bfloat16)
    topk_weights_rank = torch.full((TOKENS, TOPK), float(rank))
    x_fp8 = to_fp8(x_rank)
    x_fp8 = (x_fp8[0], x_fp8[1].T.contiguous().T)  # column-major scales, as DeepEP's test passes them

    # layout: get_dispatch_layout against the counts computed here (test_main, "Expert meta" / "Rank layout meta")
    per_rank = num_experts // world
    rank_idx = torch.where(topk_idx >= 0, topk_idx // per_rank, -1)
    want_in_rank = torch.stack([(rank_idx == r).any(dim=1) for r in range(world)], dim=1)
    want_per_rank = want_in_rank.sum(dim=0).to(torch.int32)
    want_per_expert = torch.stack([(topk_idx == e).sum() for e in range(num_experts)]).to(torch.int32)
    per_rank_t, per_rdma, per_expert, in_rank, _ = _call(buffer.get_dispatch_layout, topk_idx, num_experts)
    assert per_rdma is None
    assert torch.equal(per_rank_t, want_per_rank) and torch.equal(per_expert, want_per_expert)
    assert torch.equal(in_rank, want_in_rank)
    gbl_per_rank = [torch.zeros_like(per_rank_t) for _ in range(world)]
    gbl_per_expert = [torch.zeros_like(per_expert) for _ in range(world)]
    import torch.distributed as dist

    dist.all_gather(gbl_per_rank, per_rank_t)
    dist.all_gather(gbl_per_expert, per_expert)
    gbl_per_rank = torch.stack(gbl_per_rank)  # [src, dst]
    gbl_per_expert = torch.stack(gbl_per_expert).sum(dim=0)
    config = deep_ep.Config(Buffer_num_sms := 24, 8, 256)  # noqa: F841  (accepted, carried)

    def check_data(check_x):  # test_main check_data: source-rank blocks of rank-constant rows
        assert torch.equal(check_x.amin(dim=1), check_x.amax(dim=1))
        start = 0
        for src in range(world):
            end = start + int(gbl_per_rank[src, rank])
            assert int((check_x[start:end].int() - src).abs().sum()) == 0, f"rows from rank {src}"
            start = end

    checked = 0
    for previous_mode in (False, True):
        for async_mode in (False, True):

            def mode_call(fn, args, **extra):
                """fn(**args, **extra) as test_main calls it in this mode: with previous_event=buffer.capture()
                (previous_mode), and the returned event, the last result, waited on (async_mode)."""
                if previous_mode:
                    extra["previous_event"] = buffer.capture()
                got = _call(fn, **args, **extra)
                if async_mode:
                    got[-1].current_stream_wait()
                return got

            for name, current_x in (("rand", x_rand), ("rank", x_rank), ("fp8", x_fp8)):
                weights = topk_weights_rand if name == "rand" else topk_weights_rank
                args = dict(x=current_x, num_tokens_per_rank=per_rank_t, is_token_in_rank=in_rank,
                            num_tokens_per_expert=per_expert, topk_idx=topk_idx, topk_weights=weights, config=config,
                            async_finish=async_mode)
                recv_x, recv_idx, recv_w, counts, handle, _ = mode_call(buffer.dispatch, args)
                recv_x = from_fp8(*recv_x) if isinstance(recv_x, tuple) else recv_x
                # counts (test_main "Checks")
                assert recv_x.size(0) == int(gbl_per_rank[:, rank].sum())
                assert counts == gbl_per_expert.view(world, -1)[rank].tolist()
                assert recv_idx.dtype == torch.int64 and recv_w.dtype == torch.float32
                if name != "rand":
                    check_data(recv_x)
                # rows, order-independent (beyond DeepEP: every row, also the random ones)
                want = _expected_rows(world, seed, rank, num_experts, "rand" if name == "rand" else "rank")
                np.testing.assert_array_equal(_sorted_rows(recv_x), _sorted_rows(want))
                # topk_idx: local ids or -1, per-expert counts as the list (test_main "Check `topk_idx`")
                assert bool(((recv_idx == -1) | ((recv_idx >= 0) & (recv_idx < per_rank))).all())
                for e, count in enumerate(counts):
                    assert int((recv_idx == e).sum()) == count
                # topk_weights (test_main "Check `topk_weights`"): 0 where -1, else the sender's
                assert bool((recv_w[recv_idx == -1] == 0).all())
                if name != "rand":
                    filled = recv_w.clone()
                    filled[recv_idx == -1] = filled.amax(dim=1, keepdim=True).expand_as(filled)[recv_idx == -1]
                    check_data(filled)

                # num_worst_tokens (test_main "Test `num_worst_tokens != 0`")
                worst = TOKENS * world
                worst_x, worst_idx, worst_w, empty, _, _ = mode_call(buffer.dispatch, args, num_worst_tokens=worst)
                worst_x = from_fp8(*worst_x) if isinstance(worst_x, tuple) else worst_x
                n = recv_x.size(0)
                assert empty == [] and worst_x.size(0) == worst == worst_idx.size(0) == worst_w.size(0)
                assert torch.equal(recv_x, worst_x[:n]) and torch.equal(recv_idx, worst_idx[:n])
                assert torch.equal(recv_w, worst_w[:n]) and bool((worst_idx[n:] == -1).all())

                # cached dispatch (test_main "Test cached dispatch"): the same rows from the handle's routing
                cached_args = dict(x=current_x, handle=handle, config=config, async_finish=async_mode)
                cached_x, none_idx, none_w, none_counts, none_handle, _ = mode_call(buffer.dispatch, cached_args)
                cached_x = from_fp8(*cached_x) if isinstance(cached_x, tuple) else cached_x
                assert none_idx is None and none_w is None and none_counts is None and none_handle is None
                assert torch.equal(cached_x, recv_x)

                # combine (test_main "Test combine"): sum over the ranks a token went to, / their number == x
                combine_args = dict(x=recv_x, handle=handle, config=config, async_finish=async_mode)
                combined_x, combined_w, _ = mode_call(buffer.combine, combine_args)
                assert combined_w is None
                ranks_of_token = in_rank.sum(dim=1, keepdim=True).clamp(min=1)
                ref_x = x_rand if name == "rand" else x_rank
                sent = in_rank.any(dim=1)
                check_x = combined_x.float() / ranks_of_token
                assert calc_diff(check_x[sent], ref_x[sent]) < 5e-6
                assert bool((combined_x[~sent] == 0).all())  # a token with no expert combines to 0

                # combine with topk_weights (test_main "Test combine", with_topk): the weights summed over the ranks
                # a token went to; DeepEP's test fills the -1 entries of the rank-constant rows (so each of the
                # token's ranks sends its source's rank there), the random ones keep their 0s
                topk_w = recv_w if name == "rand" else filled
                _, combined_w, _ = mode_call(buffer.combine, combine_args, topk_weights=topk_w)
                assert combined_w.dtype == torch.float32 and combined_w.shape == (TOKENS, TOPK)
                if name == "rand":  # one rank holds each (t, k): its weight exactly, 0 for an id of -1
                    want_w = torch.where(topk_idx >= 0, topk_weights_rand, 0)
                else:  # rank r's rows hold r: r times the number of ranks the token went to (exact: small integers)
                    want_w = (topk_weights_rank * in_rank.sum(dim=1, keepdim=True)).float()
                assert calc_diff(combined_w, want_w) < 1e-9 and torch.equal(combined_w, want_w)
                checked += 1
    buffer.destroy()
    return checked


@pytest.mark.parametrize("world", WORLDS)
def test_intranode(world):
    """tests/test_intranode.py test_main: layout, dispatch (bf16, fp8, with top-k; sync / async / previous event),
    num_worst_tokens, cached dispatch, combine (with topk_weights too)."""
    assert _run(_intranode_body, world, SEED) == [12] * world


# ---- the backward pass as engines run it: combine(topk_weights=...) and the cached dispatch -----------------------


def _layout_args(buffer, topk_idx, num_experts):
    per_rank, _, per_expert, in_rank, _ = buffer.get_dispatch_layout(topk_idx, num_experts)
    return dict(num_tokens_per_rank=per_rank, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert)


def _wide_weights(gen, rows: int):
    """fp32 of wide exponents (a sum of three of them rounds, so the order of the ranks shows), with -0.0 and
    subnormals among them (what a byte-exact transport must keep)."""
    exponents = torch.randint(-30, 30, (rows, TOPK), generator=gen).float()
    w = torch.randn((rows, TOPK), generator=gen) * torch.exp2(exponents)
    flat = w.view(-1)
    if flat.numel() >= 4:
        flat[0], flat[1], flat[-1] = -0.0, 1e-40, -3e-42
    return w


def _combine_weights_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    rank, world = ctx.rank, ctx.world
    num_experts = _num_experts(world)
    buffer = deep_ep.Buffer(group, int(4e6), 0)
    topk_idx, topk_weights, x = _routing(world, seed, rank)
    recv_x, _, _, _, handle, _ = buffer.dispatch(_dev(x), topk_idx=_dev(topk_idx), topk_weights=_dev(topk_weights),
                                                 **_layout_args(buffer, _dev(topk_idx), num_experts))
    # DeepEP sums whatever each rank passes, the entries of experts elsewhere included (its test fills them)
    sent = _wide_weights(torch.Generator().manual_seed(seed * 13 + rank), recv_x.size(0))
    _, combined_w, _ = buffer.combine(recv_x, handle, topk_weights=_dev(sent))
    return sent.numpy(), _host(combined_w).numpy()  # numpy: torch tensors pickle through shared memory


def _deep_ep_weight_sums(world: int, seed: int, sent: list) -> list:
    """numpy, independent of the layer: for each source rank s, token t, entry k, the fp32 sum over r = 0, 1, ...
    (the ranks t went to) of rank r's value for its row of (s, t), one np.float32 add at a time from 0."""
    num_experts = _num_experts(world)
    per_rank = num_experts // world
    routing = [_routing(world, seed, s)[0].numpy() for s in range(world)]
    goes = [[((routing[s] >= 0) & (routing[s] // per_rank == r)).any(axis=1) for r in range(world)]
            for s in range(world)]
    # rank r's rows: (source rank, source token) order over the tokens that go to r
    row_of = [{} for _ in range(world)]
    for r in range(world):
        for s in range(world):
            for t in np.nonzero(goes[s][r])[0]:
                row_of[r][(s, int(t))] = len(row_of[r])
    out = []
    for s in range(world):
        want = np.zeros((TOKENS, TOPK), dtype=np.float32)
        for t in range(TOKENS):
            for k in range(TOPK):
                acc = np.float32(0.0)
                for r in range(world):
                    if goes[s][r][t]:
                        acc = np.float32(acc + np.float32(sent[r][row_of[r][(s, t)], k]))
                want[t, k] = acc
        out.append(want)
    return out


@pytest.mark.parametrize("world", WORLDS)
def test_combine_topk_weights_exact(world):
    """combine(topk_weights=...) against an independent numpy reduction, bit for bit: DeepEP's intranode combine sums
    each token's rows over its ranks in ascending order in fp32; wide-exponent values (-0.0 and subnormals among
    them) so that order and transport both show. A reference one ulp off in one entry is detected."""
    got = _run(_combine_weights_body, world, SEED)
    want = _deep_ep_weight_sums(world, SEED, [sent for sent, _ in got])
    for rank, ((_, combined), ref) in enumerate(zip(got, want)):
        assert combined.dtype == np.float32
        np.testing.assert_array_equal(combined.view(np.int32), ref.view(np.int32), err_msg=f"rank {rank}")
        perturbed = ref.copy()
        perturbed[0, 0] = np.nextafter(perturbed[0, 0], np.float32(np.inf))
        assert not np.array_equal(combined.view(np.int32), perturbed.view(np.int32)), "a check that can fail"


def _autograd_functions(deep_ep_buffer, num_experts):
    """The two torch.autograd Functions an engine wraps DeepEP's normal mode in (Megatron-LM's fused_a2a shape): the
    backward of dispatch is combine(grad_recv_x, handle, topk_weights=grad_recv_topk_weights), the backward of
    combine a cached dispatch(grad_y, handle=handle)."""

    class Dispatch(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x, topk_weights, topk_idx):
            recv_x, recv_idx, recv_w, counts, handle, _ = deep_ep_buffer.dispatch(
                x, topk_idx=topk_idx, topk_weights=topk_weights, **_layout_args(deep_ep_buffer, topk_idx, num_experts))
            ctx.handle = handle
            ctx.mark_non_differentiable(recv_idx)
            return recv_x, recv_idx, recv_w, handle

        @staticmethod
        def backward(ctx, grad_recv_x, _grad_idx, grad_recv_w, _grad_handle):
            grad_x, grad_w, _ = deep_ep_buffer.combine(grad_recv_x.contiguous(), ctx.handle,
                                                       topk_weights=grad_recv_w.float().contiguous())
            return grad_x, grad_w, None

    class Combine(torch.autograd.Function):
        @staticmethod
        def forward(ctx, rows, handle):
            y, _, _ = deep_ep_buffer.combine(rows, handle)
            ctx.handle = handle
            return y

        @staticmethod
        def backward(ctx, grad_y):
            grad_rows, *_ = deep_ep_buffer.dispatch(grad_y.contiguous(), handle=ctx.handle)
            return grad_rows, None

    return Dispatch, Combine


def _round_trip_inputs(world: int, seed: int, rank: int, layer: int):
    """Exact inputs: x and grad_y integers in [-3, 3], weights 2^-1 .. 2^-4, expert scales 1 or 2. Every sum the
    forward and backward make then has at most 8 significant bits (bf16-exact) and the weight gradients (dot products
    of 256 small integers) are exact in fp32, so the comparisons with the dense reference are torch.equal."""
    gen = torch.Generator().manual_seed(seed * 31 + rank * 7 + layer)
    idx, _, _ = _routing(world, seed + layer, rank)
    x = torch.randint(-3, 4, (TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    w = torch.exp2(-torch.randint(1, 5, (TOKENS, TOPK), generator=gen).float())
    grad_y = torch.randint(-3, 4, (TOKENS, HIDDEN), generator=gen).to(torch.bfloat16)
    return x, idx, w, grad_y


def _expert_scale(num_experts: int) -> torch.Tensor:
    return 1.0 + (torch.arange(num_experts) % 2).float()  # expert e: out = (1 + e % 2) * row


def _dense_reference(x, idx, w, grad_y, scale):
    """One rank's tokens through every expert, in float64: y = sum_k w_k s_k x, grad_x = sum_k w_k s_k grad_y,
    grad_w[k] = <grad_y, s_k x> (0 for an id of -1)."""
    valid = idx >= 0
    s = torch.where(valid, scale[idx.clamp(min=0)], 0).double()
    c = (w.double() * s).sum(dim=1, keepdim=True)
    y = x.double() * c
    grad_x = grad_y.double() * c
    grad_w = torch.where(valid, s * (grad_y.double() * x.double()).sum(dim=1, keepdim=True), 0)
    return y.to(torch.bfloat16), grad_x.to(torch.bfloat16), grad_w.float()


def _round_trip_body(ctx, seed):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    rank, world = ctx.rank, ctx.world
    num_experts = _num_experts(world)
    num_local = num_experts // world
    buffer = deep_ep.Buffer(group, int(4e6), 0)
    Dispatch, Combine = _autograd_functions(buffer, num_experts)
    scale = _expert_scale(num_experts)
    layers = 3  # one shape: one pool of two EpBuffers, so layer 0's handle outlives its EpBuffer's reuse by layer 2
    inputs = [_round_trip_inputs(world, seed, rank, layer) for layer in range(layers)]
    leaves, outputs = [], []
    for x, idx, w, _ in inputs:
        xg = _dev(x).requires_grad_()
        wg = _dev(w).requires_grad_()
        recv_x, recv_idx, recv_w, handle = Dispatch.apply(xg, wg, _dev(idx))
        out = torch.zeros(recv_x.shape, dtype=torch.float32, device=recv_x.device)
        for e in range(num_local):  # the experts: out(row) += w * s_e * row, per local entry of the row
            n, k = torch.nonzero(recv_idx == e, as_tuple=True)
            s_e = float(scale[rank * num_local + e])
            out = out.index_add(0, n, recv_w[n, k].unsqueeze(1) * (s_e * recv_x[n].float()))
        outputs.append(Combine.apply(out.to(torch.bfloat16), handle))
        leaves.append((xg, wg, out.detach().to(torch.bfloat16), handle))
    failed = []
    # layer 0's handle after layer 2's dispatch reused its EpBuffer: still combines layer 0's rows (DeepEP's handles
    # never go stale; a combine of the buffer's last layout instead gives layer 2's tokens)
    again, _, _ = buffer.combine(leaves[0][2], leaves[0][3])
    if not torch.equal(again, outputs[0].detach()):
        failed.append("layer 0: combine by its handle after two more dispatches")
    loss = sum((y.float() * _dev(g).float()).sum() for y, (_, _, _, g) in zip(outputs, inputs))
    loss.backward()  # the layers' backward passes run last layer first, as a training step's
    for layer, ((x, idx, w, g), y, (xg, wg, _, _)) in enumerate(zip(inputs, outputs, leaves)):
        want_y, want_gx, want_gw = _dense_reference(x, idx, w, g, scale)
        checks = (("y", y, want_y), ("grad x", xg.grad, want_gx), ("grad topk_weights", wg.grad, want_gw))
        for what, got, want in checks:
            if not torch.equal(_host(got), want):
                failed.append(f"layer {layer}: {what}")
    # a check that can fail: the reference of one weight gradient off by one
    x, idx, w, g = inputs[0]
    _, _, want_gw = _dense_reference(x, idx, w, g, scale)
    t, k = [int(v) for v in torch.nonzero(idx >= 0)[0]]
    want_gw[t, k] += 1.0
    detected = not torch.equal(_host(leaves[0][1].grad), want_gw)
    return failed, detected


@pytest.mark.parametrize("world", WORLDS)
def test_forward_backward_round_trip(world):
    """Three MoE layers of one shape, forward then backward as torch.autograd runs them through an engine's Functions
    (dispatch's backward: combine with topk_weights; combine's backward: the cached dispatch), against a dense
    float64 reference of the same layers on every rank's tokens: y, grad x and grad topk_weights, torch.equal."""
    got = _run(_round_trip_body, world, SEED)
    for rank, (failed, detected) in enumerate(got):
        assert failed == [], f"rank {rank}: {failed}"
        assert detected, f"rank {rank}: a perturbed reference went unnoticed"


# ---- tests/test_low_latency.py, test_main ------------------------------------------------------------------------


def _low_latency_body(ctx, seed):
    import torch.distributed as dist

    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    rank, world = ctx.rank, ctx.world
    num_experts = _num_experts(world)
    num_local = num_experts // world
    num_tokens = TOKENS
    rank_offset = 128  # rows hold rank - 128 (test_main: exact in bf16 below 256 ranks)
    num_rdma_bytes = deep_ep.Buffer.get_low_latency_rdma_size_hint(num_tokens, HIDDEN, world, num_experts)
    buffer = deep_ep.Buffer(group, 0, num_rdma_bytes, low_latency_mode=True, num_qps_per_rank=num_local)
    buffer.clean_low_latency_buffer(num_tokens, HIDDEN, num_experts)
    topk_idx, topk_weights, _ = _routing(world, seed, rank, masks=10)
    x = torch.full((num_tokens, HIDDEN), float(rank - rank_offset), dtype=torch.bfloat16)
    x[:, -128:] = torch.arange(num_tokens).to(torch.bfloat16).view(-1, 1)
    gen = torch.Generator().manual_seed(seed * 7 + rank)
    x_list = [x, (torch.randn((num_tokens, HIDDEN), generator=gen) * 0.1).to(torch.bfloat16)]
    all_topk_idx = [torch.zeros_like(topk_idx) for _ in range(world)]
    dist.all_gather(all_topk_idx, topk_idx)
    all_topk_idx = torch.stack(all_topk_idx)

    checked = 0
    for current_x in x_list:
        for return_recv_hook in (False, True):
            for use_fp8 in (False, True):
                for round_scale in (False, True) if use_fp8 else (False,):
                    for use_ue8m0 in (False, True) if round_scale else (False,):
                        stats = torch.zeros((num_local,), dtype=torch.int32, device=DEVICE)
                        for _ in range(checked % 2 + 1):  # back to back calls need no cleaning
                            stats.zero_()
                            recv_x, recv_count, handle, event, hook = buffer.low_latency_dispatch(
                                _dev(current_x), _dev(topk_idx), num_tokens, num_experts, use_fp8=use_fp8,
                                round_scale=round_scale, use_ue8m0=use_ue8m0,
                                cumulative_local_expert_recv_stats=stats, async_finish=not return_recv_hook,
                                return_recv_hook=return_recv_hook)
                            hook() if return_recv_hook else event.current_stream_wait()
                        recv_x, recv_count, stats = _moved((recv_x, recv_count, stats), _host)
                        rows = world * num_tokens
                        if use_fp8:
                            assert recv_x[0].shape == (num_local, rows, HIDDEN)
                            assert recv_x[0].dtype == torch.float8_e4m3fn
                            want_cols, want_dtype = (HIDDEN // 512 or 1, torch.int32) if use_ue8m0 else (
                                HIDDEN // 128, torch.float32)
                            assert recv_x[1].shape == (num_local, rows, want_cols) and recv_x[1].dtype == want_dtype
                            assert recv_x[1].stride(1) == 1  # column-major scales (TMA)
                            if round_scale and not use_ue8m0:  # powers of two
                                s = recv_x[1][recv_x[1] > 0]
                                assert torch.equal(torch.exp2(torch.log2(s).round()), s)
                            simulated = torch.stack([from_fp8(recv_x[0][e], recv_x[1][e]) for e in range(num_local)])
                        else:
                            assert recv_x.shape == (num_local, rows, HIDDEN) and recv_x.dtype == torch.bfloat16
                            simulated = recv_x.clone()
                        src_info, layout_range = _host(handle[0]), _host(handle[1])
                        assert tuple(handle)[2:] == (num_tokens, HIDDEN, num_experts)
                        for i in range(num_local):
                            expert_id = rank * num_local + i
                            n = int(recv_count[i])
                            # counts (test_main "Check expert indices")
                            assert int(stats[i]) == n
                            assert n == int((layout_range[i] & 0xFFFFFFFF).sum())
                            assert n == int((all_topk_idx == expert_id).sum())
                            if current_x is not x or n == 0:
                                continue
                            got = simulated[i, :n]
                            info = src_info[i, :n]
                            body = got[:, :-128]
                            assert torch.equal(body.amin(dim=-1), body.amax(dim=-1))
                            if round_scale:
                                assert calc_diff(got[:, -1], info.view(-1)) < 0.007
                            else:
                                assert int((got[:, -128:].float() - info.view(-1, 1).float()).abs().sum()) == 0
                            for j in range(world):
                                begin, count = int(layout_range[i, j] >> 32), int(layout_range[i, j] & 0xFFFFFFFF)
                                assert count == int((all_topk_idx[j] == expert_id).sum())
                                if not round_scale:
                                    assert int((body.amin(dim=-1) == j - rank_offset).sum()) == count
                                    block = got[begin:begin + count, :-128].float()
                                    assert int((block - (j - rank_offset)).abs().sum()) == 0
                        # combine (test_main "Check combine correctness"), zero copy too
                        for zero_copy in (False, True):
                            if zero_copy:
                                buffer.get_next_low_latency_combine_buffer(handle)[:, :, :] = simulated
                            out = torch.empty((num_tokens, HIDDEN), dtype=torch.bfloat16, device=DEVICE)
                            combined, event, hook = buffer.low_latency_combine(
                                _dev(simulated), _dev(topk_idx), _dev(topk_weights), handle, async_finish=not return_recv_hook,
                                zero_copy=zero_copy, return_recv_hook=return_recv_hook, out=out)
                            hook() if return_recv_hook else event.current_stream_wait()
                            assert combined is out
                            combined = _host(combined)
                            assert not bool(torch.isnan(combined).any())
                            ref = current_x.float() * topk_weights.masked_fill(topk_idx == -1, 0).sum(dim=1).view(-1, 1)
                            if not round_scale:
                                diff = calc_diff(ref, combined)
                                assert diff < (9e-4 if use_fp8 else 1e-5), (diff, use_fp8, zero_copy)
                        checked += 1
    return checked


@pytest.mark.parametrize("world", WORLDS)
def test_low_latency(world):
    """tests/test_low_latency.py test_main: dispatch (bf16, fp8, round_scale, ue8m0; hook and async), per-expert
    counts, src_info / layout_range, rows per source, combine (zero copy too)."""
    assert _run(_low_latency_body, world, SEED) == [16] * world


# ---- the binding takes torch CPU tensors through DLPack (what the layer relies on) --------------------------------


def _dlpack_body(ctx):
    import ferry

    comm = ctx.init()
    buf = ferry.EpBuffer(comm, hidden=HIDDEN, num_experts=8, topk=2, max_tokens_per_rank=8)
    x = torch.randn((8, HIDDEN)).to(torch.bfloat16)
    idx = torch.tensor([[0, 5], [1, -1], [7, 2], [3, 4], [6, 0], [-1, -1], [2, 3], [5, 1]], dtype=torch.int64)
    w = torch.rand((8, 2))
    first = buf.dispatch(x, idx, w)
    assert isinstance(first.recv_x, torch.Tensor) and first.recv_x.dtype == torch.bfloat16
    assert torch.equal(first.recv_x, x[(idx >= 0).any(dim=1)])  # world 1: every token with an expert, in order
    second = buf.dispatch(x, idx, w)
    assert second.recv_x.data_ptr() == first.recv_x.data_ptr()  # a view of the EpBuffer's memory, not a copy
    y = buf.combine(second.recv_x.clone(), "rank")
    assert isinstance(y, torch.Tensor) and torch.equal(y[(idx >= 0).any(dim=1)], second.recv_x)
    return True


def test_binding_takes_torch_cpu_tensors():
    assert run_ranks(_dlpack_body, 1) == [True]


def _owned_body(ctx):
    """Normal-mode outputs are the caller's (fresh tensors, as DeepEP's): later dispatches of the same shape, which
    reuse the pool's EpBuffers, leave them as they were; int32 ids come back as an int32 copy."""
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, 1))
    calls = []
    for seed, dtype in ((1, torch.int64), (2, torch.int32), (3, torch.int64), (4, torch.int64)):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((6, HIDDEN), generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(8, generator=gen)[:2] for _ in range(6)]).to(dtype)
        w = torch.rand((6, 2), generator=gen)
        layout = buffer.get_dispatch_layout(_dev(idx), 8)
        got = buffer.dispatch(_dev(x), num_tokens_per_rank=layout[0], is_token_in_rank=layout[3],
                              num_tokens_per_expert=layout[2], topk_idx=_dev(idx), topk_weights=_dev(w))
        recv_x, recv_idx, recv_w = got[0], got[1], got[2]
        assert recv_idx.dtype == dtype and recv_w.dtype == torch.float32 and recv_x.dtype == torch.bfloat16
        calls.append((got, (recv_x.clone(), recv_idx.clone(), recv_w.clone()), x, idx, w))
    pointers = set()
    for got, copies, x, idx, w in calls:  # world 1: every token once, in order, ids as given
        for tensor, copy in zip(got[:3], copies):
            assert torch.equal(tensor, copy)  # unchanged by the later dispatches
            pointers.add(tensor.data_ptr())
        assert torch.equal(_host(got[0]), x) and torch.equal(_host(got[1]), idx) and torch.equal(_host(got[2]), w)
    assert len(pointers) == 3 * len(calls)  # no two outputs share memory
    return True


def test_normal_outputs_are_owned():
    assert _run(_owned_body, 1) == [True]


def _ll_token_counts_body(ctx):
    """Low-latency calls of one shape with changing token counts (the layer stages the (token, k) rows per count):
    every combine matches its own tokens. (Fails when the staging is not keyed by the count.)"""
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, HIDDEN, 1, 8)
    buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=8)
    worst = 0.0
    for seed, tokens in enumerate((3, 1, 4, 3, 1)):
        gen = torch.Generator().manual_seed(seed)
        x = torch.randn((tokens, HIDDEN), generator=gen).to(torch.bfloat16)
        idx = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(tokens)])
        w = torch.rand((tokens, 3), generator=gen)
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(_dev(x), _dev(idx), 4, 8, use_fp8=False)
        y, _, _ = buffer.low_latency_combine(recv_x, _dev(idx), _dev(w), handle)
        assert tuple(y.shape) == (tokens, HIDDEN)
        worst = max(worst, calc_diff(_host(y).float(), x.float() * w.sum(dim=1, keepdim=True)))
    return worst


def test_low_latency_token_counts_change():
    assert _run(_ll_token_counts_body, 1)[0] < 1e-5


# ---- examples/deep_ep_moe.py: the engine-shaped layer against its dense reference --------------------------------


@pytest.mark.parametrize("world", [1, 2])
def test_engine_example(world):
    import subprocess
    import sys
    from pathlib import Path

    if CUDA and world > 1:
        pytest.skip("cuda backend: the multi-GPU run of the example is torchrun's (docs/deep_ep.md)")
    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ)
    package_root = str(Path(ferry.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join([package_root] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    done = subprocess.run([sys.executable, "-m", "ferry.launch", "--nproc", str(world),
                           str(repo / "examples" / "deep_ep_moe.py")], capture_output=True, text=True, timeout=240,
                          env=env, cwd=repo)
    assert done.returncode == 0, done.stdout + done.stderr
    lines = [line for line in done.stdout.splitlines() if line.startswith("rank ")]
    assert len(lines) == world and all(line.endswith("(ok)") for line in lines), done.stdout


def _one_token_body(ctx):
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, HIDDEN, 1, 8)
    buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=8)
    x = torch.randn((1, HIDDEN)).to(torch.bfloat16)
    idx, w = torch.tensor([[5, 2, -1, 0]]), torch.tensor([[0.5, 0.25, 9.0, 0.125]])
    recv_x, count, handle, _, _ = buffer.low_latency_dispatch(_dev(x), _dev(idx), 4, 8, use_fp8=False)
    assert _host(count).tolist() == [1, 0, 1, 0, 0, 1, 0, 0]
    y, _, _ = buffer.low_latency_combine(recv_x, _dev(idx), _dev(w), handle)
    return calc_diff(_host(y).float(), x.float() * 0.875)


def test_low_latency_one_token():
    """A one-token batch (its (token, k) rows once came out non-contiguous: found by bench_deep_ep_overhead.py)."""
    assert _run(_one_token_body, 1)[0] < 1e-5


def _refused(call, pieces, good_pair) -> int:
    """call raises InputError whose message holds every piece; then good_pair() (a right pair) runs. Returns 1."""
    with pytest.raises(ferry.InputError) as caught:
        call()
    for piece in pieces:
        assert piece in str(caught.value), (piece, str(caught.value))
    good_pair()
    return 1


def _ll_refusals_body(ctx):
    """Misuse of the low-latency calls raises InputError naming the argument, on every rank (the same bad call on
    each: the layer's own checks are local, the binding's join the call's exchange), and the next pair of calls is
    right. Returns the count of refusals seen."""
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    experts = 4 * world
    hint = deep_ep.Buffer.get_low_latency_rdma_size_hint(4, HIDDEN, world, experts)
    buffer = deep_ep.Buffer(group, 0, hint, low_latency_mode=True, num_qps_per_rank=4)
    gen = torch.Generator().manual_seed(SEED + rank)
    x = torch.randn((3, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:3] for _ in range(3)])
    w = torch.rand((3, 3), generator=gen)
    want = (x.float() * w.sum(dim=1, keepdim=True)).to(torch.bfloat16)  # one expert output per entry: x itself

    def good_pair():
        recv_x, _, handle, _, _ = buffer.low_latency_dispatch(_dev(x), _dev(idx), 4, experts, use_fp8=False)
        y, _, _ = buffer.low_latency_combine(recv_x, _dev(idx), _dev(w), handle)
        assert calc_diff(_host(y).float(), want.float()) < 1e-5
        return recv_x, handle

    refused = lambda call, *pieces: _refused(call, pieces, good_pair)  # noqa: E731

    dispatch = lambda xx, ii: buffer.low_latency_dispatch(_dev(xx), _dev(ii), 4, experts, use_fp8=False)  # noqa
    seen = 0
    seen += refused(lambda: dispatch(x.unsqueeze(0), idx), "x must be [num_tokens, hidden]", "(1, 3, 256)")
    seen += refused(lambda: dispatch(x, idx[:2]), "topk_idx [num_tokens, num_topk]", "(2, 3)")
    seen += refused(lambda: dispatch(x.float(), idx), "x has dtype float32")
    seen += refused(lambda: dispatch(x, idx.t().contiguous().t()), "topk_idx of shape", "not contiguous")
    seen += refused(lambda: dispatch(x[:1].expand(5, HIDDEN), idx[:1].expand(5, 3)), "5 tokens exceed")
    recv_x, handle = good_pair()
    seen += refused(lambda: buffer.low_latency_combine(recv_x, _dev(idx), _dev(w[:, :2]), handle), "topk_weights",
                    "must be [3, 3]")
    recv_x, handle = good_pair()
    seen += refused(lambda: buffer.low_latency_combine(recv_x, _dev(idx), _dev(w), handle,
                                                       out=torch.empty((2, HIDDEN), dtype=torch.bfloat16,
                                                                       device=DEVICE)), "out has shape")
    recv_x, handle = good_pair()
    good_pair()
    good_pair()  # both EpBuffers of the pool were used again: handle's layout is gone
    seen += refused(lambda: buffer.low_latency_combine(recv_x, _dev(idx), _dev(w), handle), "overwritten")
    return seen


def _normal_refusals_body(ctx):
    """Misuse of the normal-mode calls raises InputError naming the argument on every rank (the same bad call on
    each), and the next pair is right. Returns the count of refusals seen."""
    import ferry.deep_ep as deep_ep

    group = _group(ctx)
    world, rank = ctx.world, ctx.rank
    experts = 4 * world
    buffer = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world))
    other = deep_ep.Buffer(group, deep_ep.Config().get_nvl_buffer_size_hint(HIDDEN * 2, world))
    gen = torch.Generator().manual_seed(SEED + rank)
    x = torch.randn((5, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:3] for _ in range(5)])
    w = torch.rand((5, 3), generator=gen)
    ranks_hit = torch.stack([torch.unique(row // 4).numel() * torch.ones(()) for row in idx]).unsqueeze(1)
    want = (x.float() * ranks_hit).to(torch.bfloat16)  # combine sums a token's rows over the ranks it went to
    layout = buffer.get_dispatch_layout(_dev(idx), experts)
    kw = dict(num_tokens_per_rank=layout[0], is_token_in_rank=layout[3], num_tokens_per_expert=layout[2])

    def dispatch(buf, xx=x, ww=w, **extra):
        args = dict(kw, topk_idx=_dev(idx), topk_weights=_dev(ww))
        args.update(extra)
        return buf.dispatch(_dev(xx), **args)

    def good_pair():
        recv_x, _, _, _, handle, _ = dispatch(buffer)
        y, _, _ = buffer.combine(recv_x, handle)
        assert torch.equal(_host(y), want)
        return recv_x, handle

    refused = lambda call, *pieces: _refused(call, pieces, good_pair)  # noqa: E731

    seen = 0
    seen += refused(lambda: dispatch(buffer, xx=x[0]), "x must be [num_tokens, hidden]", f"({HIDDEN},)")
    seen += refused(lambda: dispatch(buffer, is_token_in_rank=layout[3][:2]), "is_token_in_rank", f"[5, {world}]")
    seen += refused(lambda: dispatch(buffer, ww=w.double()), "topk_weights has dtype float64")
    recv_x, handle = good_pair()
    seen += refused(lambda: buffer.combine(recv_x, "handle"), "needs handle=", "got str")
    recv_x_other, _, _, _, handle_other, _ = dispatch(other)
    other.combine(recv_x_other, handle_other)
    seen += refused(lambda: buffer.combine(recv_x, handle_other), "another Buffer's dispatch")
    return seen


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("body, refusals", [(_ll_refusals_body, 8), (_normal_refusals_body, 5)],
                         ids=["low_latency", "normal"])
def test_refusals(body, refusals, world):
    if CUDA and world > 1:
        pytest.skip("cuda backend: one GPU, world 1")
    assert _run(body, world) == [refusals] * world
