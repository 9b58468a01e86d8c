"""Errors: the C++ family as Python classes with the same messages; bad input refused as ferry.InputError naming the
argument, before anything is sent. One rank (world 1) in this process: every check here is local."""

from __future__ import annotations

import re

import numpy as np
import pytest

import ferry

KINDS = ["Error", "ConfigError", "InputError", "CudaError", "NcclError", "TimeoutError", "BootstrapError"]
FORMAT = r"^{subsystem} error \([\w.]+:\d+\): "


@pytest.mark.parametrize("kind", KINDS)
def test_each_cpp_error_maps_to_its_class_with_the_message(kind):
    with pytest.raises(getattr(ferry, kind)) as caught:
        ferry._ext._raise_for_test(kind, "what happened; what to do")
    assert type(caught.value) is getattr(ferry, kind)
    assert re.match(FORMAT.format(subsystem="test") + "what happened; what to do$", str(caught.value))


def test_hierarchy():
    assert issubclass(ferry.Error, RuntimeError)
    for kind in KINDS[1:]:
        assert issubclass(getattr(ferry, kind), ferry.Error)
    assert ferry.TimeoutError is not TimeoutError  # ferry's, a RuntimeError like every ferry.Error


@pytest.fixture(scope="module")
def comm():
    return ferry.init(backend="cpu", rank=0, world=1)


@pytest.fixture(scope="module")
def buf(comm):
    return ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8, expert_capacity=8)


def _inputs(tokens=5, hidden=64, topk=2):
    x = np.zeros((tokens, hidden), np.uint16)
    idx = np.tile(np.array([0, 3], np.int64), (tokens, 1))[:, :topk]
    w = np.full((tokens, topk), 0.5, np.float32)
    return x, idx, w


def _input_error(call, *pieces):
    with pytest.raises(ferry.InputError) as caught:
        call()
    message = str(caught.value)
    assert re.match(FORMAT.format(subsystem="input"), message), message
    for piece in pieces:
        assert piece in message, message
    return message


def test_bad_dtypes(buf):
    x, idx, w = _inputs()
    _input_error(lambda: buf.dispatch(x.astype(np.float32), idx, w), "x has dtype float32", "bfloat16")
    _input_error(lambda: buf.dispatch(x, idx.astype(np.float32), w), "topk_idx has dtype float32", "int32 or int64")
    _input_error(lambda: buf.dispatch(x, idx, w.astype(np.float64)), "topk_weights has dtype float64", "float32")


def test_bad_shapes(buf):
    x, idx, w = _inputs()
    _input_error(lambda: buf.dispatch(x[:, :32], idx, w), "x has shape [5, 32]", "expected [num_tokens, 64]")
    _input_error(lambda: buf.dispatch(x, idx[:4], w), "topk_idx has shape [4, 2]", "expected [5, 2]")
    _input_error(lambda: buf.dispatch(x, idx, w[:, :1]), "topk_weights has shape [5, 1]", "expected [5, 2]")
    _input_error(lambda: buf.dispatch(x[0], idx, w), "x has shape [64]")


def test_not_contiguous_not_aligned_not_an_array(buf):
    x, idx, w = _inputs()
    _input_error(lambda: buf.dispatch(np.asfortranarray(x), idx, w), "x of shape [5, 64] is not contiguous")
    raw = np.zeros(5 * 64 + 1, np.uint16)
    unaligned = raw[1:].reshape(5, 64)
    _input_error(lambda: buf.dispatch(unaligned, idx, w), "is not 16-byte aligned")
    _input_error(lambda: buf.dispatch(x.tolist(), idx, w), "x must be an array", "got list")


def test_expert_ids_and_token_counts(buf):
    x, idx, w = _inputs()
    bad = idx.copy()
    bad[2, 1] = 4
    _input_error(lambda: buf.dispatch(x, bad, w), "topk_idx[2, 1]=4", "[-1, num_experts=4)")
    bad[2, 1] = -2
    _input_error(lambda: buf.dispatch(x, bad, w), "topk_idx[2, 1]=-2")
    x9, idx9, w9 = _inputs(tokens=9)
    _input_error(lambda: buf.dispatch(x9, idx9, w9), "num_tokens=9", "max_tokens_per_rank=8")


def test_stream_on_cpu_backend(buf):
    x, idx, w = _inputs()
    _input_error(lambda: buf.dispatch(x, idx, w, stream=1234), "stream must be null")
    _input_error(lambda: buf.dispatch(x, idx, w, stream="s"), "stream must be None, an int")


def test_combine_arguments(comm):
    fresh = ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8, expert_capacity=8)
    x, idx, w = _inputs()
    expert_out = np.zeros((4, 8, 64), np.uint16)
    _input_error(lambda: fresh.combine(expert_out, "expert"), "combine called without a successful dispatch")
    fresh.dispatch(x, idx, w)  # no expand
    _input_error(lambda: fresh.combine(expert_out, "expert"), "needs the last dispatch to have expand=true")
    _input_error(lambda: fresh.combine(expert_out, "tokens"), "layout='tokens' is not a combine layout")
    _input_error(lambda: fresh.combine(expert_out[:, :4], "expert"), "x has shape [4, 4, 64]", "expected [4, 8, 64]")
    fresh.dispatch(x, idx, w, expand=True)
    _input_error(lambda: fresh.combine(expert_out, "expert", out=np.zeros((4, 64), np.uint16)),
                 "out has shape [4, 64]", "expected [5, 64]")
    read_only = np.zeros((5, 64), np.uint16)
    read_only.flags.writeable = False
    _input_error(lambda: fresh.combine(expert_out, "expert", out=read_only), "out must be an array", "writable")
    _input_error(lambda: fresh.combine(np.zeros((3, 64), np.uint16), "rank"), "x has 3 rows", "reads 5")


def test_expand_needs_expert_capacity(comm):
    plain = ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8)
    x, idx, w = _inputs()
    _input_error(lambda: plain.dispatch(x, idx, w, expand=True), "expand=true needs EpConfig::expert_capacity")
    _input_error(lambda: plain.combine(np.zeros((4, 0, 64), np.uint16), "expert"), "needs an expert-major layout")


@pytest.mark.parametrize(
    "kwargs, pieces",
    [
        (dict(hidden=100), ["hidden=100 is not a multiple of 8", "hidden=104"]),
        (dict(topk=0), ["topk=0 is outside [1, 16]"]),
        (dict(num_experts=2, topk=3), ["topk=3 is larger than num_experts=2"]),
        (dict(expert_capacity=0), ["expert_capacity=0 must be at least 1"]),
        (dict(dispatch_format="fp9"), ["fp9"]),
        (dict(mode="turbo"), ["turbo"]),
        (dict(dispatch_geometry=-1), ["dispatch_geometry.blocks=-1 is negative"]),
    ],
)
def test_config_errors(comm, kwargs, pieces):
    args = dict(hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8)
    args.update(kwargs)
    with pytest.raises(ferry.ConfigError) as caught:
        ferry.EpBuffer(comm, **args)
    assert re.match(FORMAT.format(subsystem=r"\w+"), str(caught.value)), str(caught.value)
    for piece in pieces:
        assert piece in str(caught.value)


def test_a_geometry_pin_is_a_cta_count(comm):
    pinned = ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8, dispatch_geometry=8)
    assert (pinned.config.dispatch_geometry, pinned.config.combine_geometry) == (8, None)
    with pytest.raises(TypeError):  # (blocks, warps): warps are not a setting
        ferry.EpBuffer(comm, hidden=64, num_experts=4, topk=2, max_tokens_per_rank=8, dispatch_geometry=(8, 16))


def test_a_removed_env_variable_is_refused(monkeypatch):
    monkeypatch.setenv("FERRY_DISPATCH_WARPS", "16")
    with pytest.raises(ferry.ConfigError, match="FERRY_DISPATCH_WARPS=16 is no longer read"):
        ferry.init(backend="cpu", rank=0, world=1)
    assert "FERRY_DISPATCH_WARPS" not in [name for name, _, _ in ferry.env_params()]


def test_backend_errors():
    with pytest.raises(ferry.ConfigError, match="gpu"):
        ferry.init(backend="gpu", rank=0, world=1)
    if not ferry.cuda_backend_compiled:
        with pytest.raises(ferry.ConfigError, match="backend cuda is not compiled"):
            ferry.init(backend="cuda", rank=0, world=1)


def test_bootstrap_errors(monkeypatch):
    with pytest.raises(ferry.BootstrapError):
        ferry.init(backend="cpu", rank=2, world=2)
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "1")
    with pytest.raises(ferry.BootstrapError, match="RANK"):
        ferry.init(backend="cpu")
    monkeypatch.setenv("RANK", "zero")
    with pytest.raises(ferry.BootstrapError, match="zero"):
        ferry.init(backend="cpu")


def test_env_init_and_env_table(monkeypatch):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    comm = ferry.init(backend="cpu")
    assert (comm.rank, comm.world, comm.backend, comm.device) == (0, 1, "cpu", -1)
    names = [name for name, _, _ in ferry.env_params()]
    assert "FERRY_TIMEOUT_S" in names
