"""Entry tokens in the binding (low-latency mode): dispatch(x_repeat=k) sends entry i of an unexpanded x's row i // k,
combine(group=k, group_weights=w) sums each token's k entries back with weights given at combine. World 1 on the cpu
backend, bit for bit against torch (fp32 products and sums, k ascending, one rounding), fresh inputs per run (the
seed is printed); and the refusals, each naming its argument. The C++ test of the same (worlds 1, 2, 4) is
tests/unit/test_ll_cpu.cpp; ferry.deep_ep's low-latency calls run on these (test_deep_ep_compat.py)."""

from __future__ import annotations

import random

import pytest

from support import run_ranks

torch = pytest.importorskip("torch")

HIDDEN, K, T, EXPERTS = 256, 4, 6, 8


def _body(ctx, seed):
    import ferry

    comm = ctx.init()
    buf = ferry.EpBuffer(comm, hidden=HIDDEN, num_experts=EXPERTS, topk=1, max_tokens_per_rank=T * K, mode="ll")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((T, HIDDEN), generator=gen).to(torch.bfloat16)
    idx = torch.stack([torch.randperm(EXPERTS, generator=gen)[:K] for _ in range(T)])
    idx[torch.rand((T, K), generator=gen) < 0.25] = -1
    ones = torch.ones((T * K, 1))
    got = buf.dispatch(x, idx.view(-1, 1), ones, x_repeat=K)
    slots = got.expert_x.size(1)
    # every filled slot holds its entry's row of x: entry i = (token i // K) of this rank
    src = got.recv_src[:, 1].long()
    for e in range(EXPERTS):
        for s in range(int(got.expert_counts[e])):
            entry = int(src[int(got.expert_src_row[e, s])])
            assert int(idx.view(-1)[entry]) == e
            assert torch.equal(got.expert_x[e, s], x[entry // K]), (e, s, entry)
    assert int(got.expert_counts.sum()) == int((idx >= 0).sum())

    eout = torch.randn((EXPERTS, slots, HIDDEN), generator=gen).to(torch.bfloat16)
    w = torch.rand((T, K), generator=gen) * 2 - 1
    w[idx < 0] = float("nan")  # an entry that went nowhere adds nothing, whatever its weight
    y = torch.full((T + 1, HIDDEN), 7.0, dtype=torch.bfloat16)
    out = buf.combine(eout, "expert", out=y[:T], group=K, group_weights=w)
    assert out.data_ptr() == y.data_ptr()
    entry_row = {}
    for e in range(EXPERTS):
        for s in range(int(got.expert_counts[e])):
            entry_row[int(src[int(got.expert_src_row[e, s])])] = eout[e, s].float()
    want = torch.empty((T, HIDDEN), dtype=torch.bfloat16)
    for t in range(T):
        acc = torch.zeros(HIDDEN, dtype=torch.float32)
        for k in range(K):
            if int(idx[t, k]) >= 0:
                acc = acc + w[t, k] * entry_row[t * K + k]  # fp32 product, then fp32 sum: two roundings
        want[t] = acc.to(torch.bfloat16)
    assert torch.equal(y[:T], want)
    assert bool((y[T] == 7.0).all())  # nothing past the T rows

    refusals = {  # the combines first: a refused dispatch leaves no dispatch to combine
        "group=5": lambda: buf.combine(eout, "expert", group=5, group_weights=torch.ones((T * K // 5 + 1, 5))),
        "group_weights has shape": lambda: buf.combine(eout, "expert", group=K, group_weights=torch.ones((T, K + 1))),
        "group=4 needs group_weights": lambda: buf.combine(eout, "expert", group=K),
        "x_repeat=0": lambda: buf.dispatch(x, idx.view(-1, 1), ones, x_repeat=0),
    }
    for part, call in refusals.items():
        with pytest.raises(ferry.InputError, match=part.replace("(", r"\(")):
            call()
    normal = ferry.EpBuffer(comm, hidden=HIDDEN, num_experts=EXPERTS, topk=K, max_tokens_per_rank=T)
    with pytest.raises(ferry.InputError, match="x_repeat=2 belongs to low-latency mode"):
        normal.dispatch(x[:3], idx[:6], torch.ones((6, K)), x_repeat=2)
    return True


def test_entry_tokens_world_1():
    seed = random.randrange(1 << 30)
    print(f"seed {seed}")
    assert run_ranks(_body, 1, seed) == [True]
