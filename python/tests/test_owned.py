"""EpBuffer.dispatch_owned: a normal-mode dispatch whose rank-major outputs are fresh torch tensors the caller owns.
Worlds 1 and 2 on the cpu backend (torch CPU tensors), fresh inputs per run (the seed is printed): the outputs equal
the views of the same dispatch, stay as they were after later dispatches, keep the ids' dtype, and the saved handle
combines them back; lazy and cached calls, and the refusals. (ferry.deep_ep's normal mode runs on it:
test_deep_ep_compat.py.)"""

from __future__ import annotations

import os
import random

import pytest

from support import run_ranks

torch = pytest.importorskip("torch")

HIDDEN, TOPK, T = 256, 3, 7
SEED = int(os.environ.get("FERRY_TEST_SEED") or random.SystemRandom().randrange(1 << 31))
print(f"test_owned: seed {SEED} (FERRY_TEST_SEED={SEED} replays it)")


def _inputs(gen, experts, dtype=torch.int64):
    x = torch.randn((T, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(experts, generator=gen)[:TOPK] for _ in range(T)]).to(dtype)
    idx[torch.rand((T, TOPK), generator=gen) < 0.2] = -1
    w = torch.rand((T, TOPK), generator=gen)
    return x, idx, w


def _body(ctx):
    import ferry

    comm = ctx.init()
    world, rank = ctx.world, ctx.rank
    experts = 4 * world
    buf = ferry.EpBuffer(comm, hidden=HIDDEN, num_experts=experts, topk=TOPK, max_tokens_per_rank=T)
    gen = torch.Generator().manual_seed(SEED + rank)
    x, idx, w = _inputs(gen, experts)

    recv_x, scales, ids, weights, counts, handle, num_recv, _ = buf.dispatch_owned(x, idx, w, save_handle=True)
    view = buf.dispatch(x, idx, w)  # the same routing: the same rows, as views of the buffer
    rows = view.num_recv_host
    assert scales is None and isinstance(handle, ferry.DispatchHandle) and int(num_recv[0]) == rows
    assert recv_x.shape == (rows, HIDDEN) and ids.shape == (rows, TOPK) and weights.shape == (rows, TOPK)
    assert ids.dtype == torch.int64 and weights.dtype == torch.float32  # int64 ids come back int64
    assert torch.equal(recv_x, view.recv_x) and torch.equal(weights, view.recv_topk_weights)
    assert torch.equal(ids, view.recv_topk_idx.long())
    assert counts == view.expert_counts.tolist()
    kept = [t.clone() for t in (recv_x, ids, weights)]

    # a later dispatch of other tokens rewrites the buffer's views, never the owned tensors
    x2, idx2, w2 = _inputs(gen, experts)
    later = buf.dispatch(x2, idx2, w2)
    assert all(torch.equal(a, b) for a, b in zip((recv_x, ids, weights), kept))
    assert later.recv_x.data_ptr() != recv_x.data_ptr()

    # the handle combines the owned rows back: each token's row summed over the ranks it went to (exact in bf16:
    # a row times 1 or 2)
    y = buf.combine(recv_x, "rank", handle=handle)
    valid = idx >= 0
    ranks_hit = torch.tensor([len({int(e) // 4 for e, v in zip(row, ok) if v}) for row, ok in zip(idx, valid)],
                             dtype=torch.float32).unsqueeze(1)
    assert torch.equal(y, (x.float() * ranks_hit).to(torch.bfloat16))

    # int32 ids come back int32; lazy: recv_capacity rows and no counts; cached: no ids, weights or counts
    _, _, ids32, _, _, _, _, _ = buf.dispatch_owned(x, idx.int(), w)
    assert ids32.dtype == torch.int32 and torch.equal(ids32.long(), kept[1])
    lazy = buf.dispatch_owned(x, idx, w, eager=False)
    assert lazy[0].shape[0] == buf.recv_capacity and lazy[4] is None
    assert torch.equal(lazy[0][:rows], kept[0])
    cached = buf.dispatch_owned(x, handle=handle)
    assert cached[2] is None and cached[3] is None and cached[4] is None and torch.equal(cached[0], kept[0])

    # refusals (collective: every rank makes the same bad call)
    with pytest.raises(ferry.InputError, match="x must be a torch tensor"):
        buf.dispatch_owned(x.view(torch.int16).numpy(), idx, w)
    with pytest.raises(ferry.InputError, match="saves no handle"):
        buf.dispatch_owned(x, handle=handle, save_handle=True)
    return rows


@pytest.mark.parametrize("world", [1, 2])
def test_dispatch_owned(world):
    assert all(rows >= 0 for rows in run_ranks(_body, world))
