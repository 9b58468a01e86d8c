"""Outputs are views of the EpBuffer's own buffers, built once and reused: no copy, and a call allocates nothing but
the view objects it returns."""

from __future__ import annotations

import gc

import numpy as np
import pytest

import ferry


def _address(array) -> int:
    return array.__array_interface__["data"][0]


@pytest.fixture()
def buf():
    comm = ferry.init(backend="cpu", rank=0, world=1)
    return ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8, expert_capacity=8)


def _inputs(tokens, seed):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, 0x3F80, (tokens, 64), dtype=np.uint16)
    idx = np.stack([rng.permutation(4)[:2] for _ in range(tokens)]).astype(np.int64)
    w = rng.random((tokens, 2), dtype=np.float32)
    return x, idx, w


def test_views_share_the_buffers_across_calls(buf):
    first = buf.dispatch(*_inputs(6, 1), expand=True)
    second = buf.dispatch(*_inputs(3, 2), expand=True)
    for name in ("recv_x", "recv_topk_idx", "recv_topk_weights", "recv_src"):
        a, b = getattr(first, name), getattr(second, name)
        assert _address(a) == _address(b), name
        assert np.shares_memory(a, b), name
        # eager views are slices of one cached full-capacity view
        assert a.base is not None and a.base is b.base, name
        assert a.base.shape[0] == buf.recv_capacity
    assert first.recv_x.shape[0] == 6 and second.recv_x.shape[0] == 3  # one row per token per destination rank
    assert _address(first.expert_x) == _address(second.expert_x)
    assert first.expert_x is second.expert_x  # full views are returned as they are
    assert first.num_recv is second.num_recv


def test_lazy_views_are_the_cached_objects(buf):
    first = buf.dispatch(*_inputs(4, 3), eager=False)
    second = buf.dispatch(*_inputs(5, 4), eager=False)
    assert first.recv_x is second.recv_x and first.recv_x.shape == (buf.recv_capacity, 64)
    assert first.recv_src is second.recv_src


def test_an_unchanged_result_is_the_same_object(buf):
    x, idx, w = _inputs(4, 8)
    first = buf.dispatch(x, idx, w, eager=False)
    assert buf.dispatch(x, idx, w, eager=False) is first  # every field the same: no new record
    third = buf.dispatch(*_inputs(3, 9))  # eager, 3 rows: a record of its own, the earlier one unchanged
    assert third is not first and third.recv_x.shape[0] == 3
    assert first.recv_x.shape[0] == buf.recv_capacity


def test_views_see_the_data_without_copy(buf):
    x, idx, w = _inputs(4, 5)
    got = buf.dispatch(x, idx, w)
    # every token goes to this (only) rank once, in token order
    np.testing.assert_array_equal(got.recv_x, x)
    np.testing.assert_array_equal(got.recv_src[:, 1], np.arange(4))
    assert got.recv_x.dtype == np.uint16 and got.recv_x.flags.c_contiguous


def test_combine_writes_into_out_and_allocates_only_without_it(buf):
    x, idx, w = _inputs(5, 6)
    got = buf.dispatch(x, idx, w, expand=True)
    out = np.empty((5, 64), np.uint16)
    assert buf.combine(got.expert_x, "expert", out=out) is out
    fresh = buf.combine(got.expert_x, "expert")
    assert fresh is not out and fresh.dtype == np.uint16 and fresh.shape == (5, 64)
    np.testing.assert_array_equal(fresh, out)


def test_views_keep_the_buffer_alive():
    comm = ferry.init(backend="cpu", rank=0, world=1)
    buf = ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8)
    x, idx, w = _inputs(3, 7)
    recv_x = buf.dispatch(x, idx, w).recv_x
    del buf, comm
    gc.collect()
    np.testing.assert_array_equal(recv_x, x)  # the memory is still mapped: the view owns a reference


def test_torch_cpu_views_are_bfloat16_and_shared():
    torch = pytest.importorskip("torch")
    comm = ferry.init(backend="cpu", rank=0, world=1)
    buf = ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8, expert_capacity=8)
    x, idx, w = _inputs(4, 8)
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    first = buf.dispatch(tx, torch.from_numpy(idx), torch.from_numpy(w), expand=True)
    second = buf.dispatch(tx, torch.from_numpy(idx), torch.from_numpy(w), expand=True)
    assert isinstance(first.recv_x, torch.Tensor) and first.recv_x.dtype == torch.bfloat16
    assert first.recv_x.data_ptr() == second.recv_x.data_ptr()
    assert torch.equal(first.recv_x, tx)
    y = buf.combine(first.expert_x, "expert")
    assert isinstance(y, torch.Tensor) and y.dtype == torch.bfloat16 and tuple(y.shape) == (4, 64)


def test_eager_slices_follow_the_row_count(buf):
    """Eager calls hand out cached slices of the full views: a call of the last call's row count gets the same object
    (showing the new call's rows), another count a slice of its own. (Fails when the slice cache ignores the count: the
    second call then returns 6 rows.)"""
    x6, idx6, w6 = _inputs(6, 11)
    x3, idx3, w3 = _inputs(3, 12)
    first = buf.dispatch(x6, idx6, w6)
    second = buf.dispatch(x3, idx3, w3)
    assert second.recv_x.shape == (3, 64) and second.recv_src.shape == (3, 2)
    np.testing.assert_array_equal(second.recv_x, x3)
    x6b, idx6b, w6b = _inputs(6, 13)
    third = buf.dispatch(x6b, idx6b, w6b)
    assert third.recv_x.shape == (6, 64) and third.recv_topk_weights.shape == (6, 2)
    np.testing.assert_array_equal(third.recv_x, x6b)
    np.testing.assert_array_equal(first.recv_x, x6b)  # a view of the same rows: the last dispatch's contents
    x6c, idx6c, w6c = _inputs(6, 14)
    fourth = buf.dispatch(x6c, idx6c, w6c)
    assert fourth.recv_x is third.recv_x  # the cached slice (the last count), now showing the fourth call's rows
    np.testing.assert_array_equal(third.recv_x, x6c)
    np.testing.assert_array_equal(fourth.recv_topk_weights, w6c)
