"""Torch tensors come in through torch's DLPack C exchange API (torch.Tensor.__dlpack_c_exchange_api__, torch >= 2.11)
where torch has it, else through torch's DLPack export (a capsule). Both ways must read the same arrays and refuse the
same arguments with the same message: each test runs its calls both ways (ferry._ext._use_exchange_api) and compares.
Seeds are printed; skips without torch, or where this torch has no exchange API (then only the capsule way exists)."""

from __future__ import annotations

import numpy as np
import pytest

import ferry
from ferry import _ext

torch = pytest.importorskip("torch")

HIDDEN, EXPERTS, TOPK, TOKENS = 64, 4, 2, 5


@pytest.fixture(autouse=True)
def _exchange_api_restored():
    yield
    _ext._use_exchange_api(True)


@pytest.fixture()
def seed():
    value = int(np.random.default_rng().integers(1 << 31))
    print(f"seed {value}")
    return value


def _both_ways(run):
    """run() with the exchange API and without it: the two results (or raised messages)."""
    out = []
    for on in (True, False):
        if on and not _ext._use_exchange_api(True):
            pytest.skip(f"torch {torch.__version__} has no DLPack C exchange API")
        _ext._use_exchange_api(on)
        try:
            out.append(("ok", run()))
        except Exception as error:  # noqa: BLE001 - the refusals are what is compared
            out.append((type(error).__name__, str(error)))
    return out


def _buffer(mode="normal"):
    comm = ferry.init(backend="cpu", rank=0, world=1)
    return ferry.EpBuffer(comm, hidden=HIDDEN, num_experts=EXPERTS, topk=TOPK, max_tokens_per_rank=8,
                          expert_capacity=8, mode=mode)


def _inputs(seed):
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.integers(0, 0x3F80, (TOKENS, HIDDEN), dtype=np.uint16).view(np.int16)).view(torch.bfloat16)
    idx = torch.from_numpy(np.stack([rng.permutation(EXPERTS)[:TOPK] for _ in range(TOKENS)]).astype(np.int64))
    w = torch.from_numpy(rng.random((TOKENS, TOPK), dtype=np.float32))
    return x, idx, w


@pytest.mark.parametrize("mode", ["normal", "ll"])
def test_both_ways_deliver_and_combine_the_same_rows(mode, seed):
    x, idx, w = _inputs(seed)
    expert_out = torch.from_numpy(
        np.random.default_rng(seed + 1).integers(0, 0x3F80, (EXPERTS, 8, HIDDEN), dtype=np.uint16).view(np.int16)
    ).view(torch.bfloat16)

    def run():
        buf = _buffer(mode)
        got = buf.dispatch(x, idx, w, expand=True)
        out = torch.full((TOKENS, HIDDEN), float("nan"), dtype=torch.bfloat16)  # poisoned: combine writes every row
        assert buf.combine(expert_out, "expert", out=out) is out
        return got.expert_x.clone(), got.expert_counts.clone(), out

    (kind_a, a), (kind_b, b) = _both_ways(run)
    assert kind_a == kind_b == "ok", (a, b)
    for got_a, got_b in zip(a, b):
        assert torch.equal(got_a.view(torch.int16), got_b.view(torch.int16))
    assert int(a[1].sum()) == int((idx >= 0).sum())  # every entry landed in a slot
    assert not torch.isnan(a[2].float()).any()


def _refusals(seed):
    x, idx, w = _inputs(seed)
    return {
        "x dtype": lambda buf: buf.dispatch(x.float(), idx, w),
        "x shape": lambda buf: buf.dispatch(x[:, : HIDDEN // 2].contiguous(), idx, w),
        "x not contiguous": lambda buf: buf.dispatch(torch.cat([x, x], 1)[:, ::2], idx, w),
        "topk_idx dtype": lambda buf: buf.dispatch(x, idx.to(torch.int16), w),
        "topk_idx shape": lambda buf: buf.dispatch(x, idx[:, :1].contiguous(), w),
        "topk_weights transposed": lambda buf: buf.dispatch(x, idx, w.t().contiguous().t()),
        "too many tokens": lambda buf: buf.dispatch(torch.cat([x, x]), torch.cat([idx, idx]), torch.cat([w, w])),
        "not an array": lambda buf: buf.dispatch(x.tolist(), idx, w),
        "combine out dtype": lambda buf: (buf.dispatch(x, idx, w, expand=True),
                                          buf.combine(torch.zeros(EXPERTS, 8, HIDDEN, dtype=torch.bfloat16), "expert",
                                                      out=torch.zeros(TOKENS, HIDDEN)))[1],
        "combine x shape": lambda buf: (buf.dispatch(x, idx, w, expand=True),
                                        buf.combine(torch.zeros(EXPERTS, 4, HIDDEN, dtype=torch.bfloat16), "expert"))[1],
    }


@pytest.mark.parametrize("case", list(_refusals(0)))
def test_both_ways_refuse_with_the_same_message(case, seed):
    call = _refusals(seed)[case]
    (kind_a, a), (kind_b, b) = _both_ways(lambda: call(_buffer()))
    assert kind_a == kind_b == "InputError", (a, b)
    assert a == b


def test_both_ways_read_the_same_stream_argument(seed):
    # the cpu backend takes no stream: a given one is refused the same way by both
    x, idx, w = _inputs(seed)
    (kind_a, a), (kind_b, b) = _both_ways(lambda: _buffer().dispatch(x, idx, w, stream=7))
    assert kind_a == kind_b == "InputError" and a == b and "stream must be null" in a
