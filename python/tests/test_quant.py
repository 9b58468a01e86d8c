"""Quantized wire formats from Python (cpu backend, NumPy): every format x scale layout delivers views of the shapes
and dtypes docs/python.md gives; the payload and scales decode (quant_reference.py, from docs/quant.md) to the sent
rows within the documented bound, and fp8 bit for bit as a NumPy quantizer makes them; dispatch_dequantize equals
decoding the delivered payload yourself; pre-quantized input gives byte-identical outputs; quantized combine stays
within docs/quant.md's combine bound; bad combinations raise the C++ errors. Fresh data every run (the seed is
printed; FERRY_TEST_SEED replays it)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest

import ferry
import quant_reference as q
import reference as ref
from support import run_ranks

SEED = int(os.environ.get("FERRY_TEST_SEED") or np.random.SeedSequence().entropy % (1 << 31))
print(f"quant tests: seed {SEED} (FERRY_TEST_SEED={SEED} replays it)")

HIDDEN = 256  # two fp8 blocks, 16 nvfp4 blocks, 8 mxfp4 blocks
PAIRS = [(fmt, layout) for fmt in q.FORMATS for layout in q.LAYOUTS[fmt]]


def _rows(rng, tokens: int, hidden: int) -> np.ndarray:
    """bf16 rows whose blocks span many magnitudes (scales differ block to block), with an occasional zero block."""
    values = rng.standard_normal((tokens, hidden), dtype=np.float32)
    magnitude = np.exp2(rng.integers(-12, 12, (tokens, hidden // 16))).astype(np.float32)
    values *= np.repeat(magnitude, 16, axis=1)
    if tokens:
        values[rng.integers(0, tokens), :16] = 0.0
    return ref.float_to_bf16(values)


def _routing(rng, tokens: int, num_experts: int, topk: int, mask_rate: float = 0.0):
    idx = np.stack([rng.permutation(num_experts)[:topk] for _ in range(tokens)]).astype(np.int64) if tokens else \
        np.zeros((0, topk), np.int64)
    if mask_rate and tokens:
        masked = rng.random(idx.shape) < mask_rate
        masked[:, 0] = False  # every token keeps one expert
        idx[masked] = -1
    weights = rng.random((tokens, topk), dtype=np.float32)
    weights[idx < 0] = 0.0
    return idx, weights


def _copy(value):
    return None if value is None else np.array(value, copy=True)


def _outputs(got) -> dict:
    names = ["recv_x", "recv_scales", "recv_token_scales", "recv_topk_idx", "recv_topk_weights", "recv_src",
             "expert_counts", "expert_x", "expert_src_row", "expert_scales", "expert_token_scales"]
    return {name: _copy(getattr(got, name)) for name in names} | {"num_recv": got.num_recv_host}


@pytest.fixture(scope="module")
def comm():
    return ferry.init(backend="cpu", rank=0, world=1)


# ---- one rank: shapes, dtypes, views, layouts, dequantize --------------------------------------------------------

TOKENS, EXPERTS, TOPK, MAX_TOKENS, SLOTS = 6, 4, 2, 8, 8


def _buffer(comm, fmt, layout="row_major", **kwargs):
    return ferry.EpBuffer(comm, hidden=HIDDEN, num_experts=EXPERTS, topk=TOPK, max_tokens_per_rank=MAX_TOKENS,
                          expert_capacity=SLOTS, dispatch_format=fmt, recv_scale_layout=layout, **kwargs)


def _check_shapes(got, fmt: str, layout: str, rows: int, capacity: int, expand: bool) -> None:
    ns = q.num_scales(fmt, HIDDEN)
    assert got.recv_x.dtype == np.uint8 and got.recv_x.shape == (rows, q.payload_cols(fmt, HIDDEN))
    shape, dtype = q.scale_shape(fmt, layout, capacity, HIDDEN)
    if layout == "row_major":
        shape = (rows, ns)
    assert got.recv_scales.dtype == dtype and got.recv_scales.shape == shape, (got.recv_scales.shape, shape)
    assert got.recv_scales.flags.c_contiguous
    if layout != "row_major":
        assert got.recv_scales.nbytes == ferry.scale_tensor_bytes(fmt, layout, capacity, HIDDEN)
    if fmt == "nvfp4":
        assert got.recv_token_scales.dtype == np.float32 and got.recv_token_scales.shape == (rows,)
    else:
        assert got.recv_token_scales is None
    if not expand:
        for name in ("expert_x", "expert_scales", "expert_token_scales", "expert_src_row"):
            assert getattr(got, name) is None, name
        return
    assert got.expert_x.dtype == np.uint8 and got.expert_x.shape == (EXPERTS, SLOTS, q.payload_cols(fmt, HIDDEN))
    shape, dtype = q.scale_shape(fmt, layout, SLOTS, HIDDEN)
    assert got.expert_scales.dtype == dtype and got.expert_scales.shape == (EXPERTS,) + shape
    assert got.expert_scales[0].nbytes == ferry.scale_tensor_bytes(fmt, layout, SLOTS, HIDDEN)
    if fmt == "nvfp4":
        assert got.expert_token_scales.dtype == np.float32 and got.expert_token_scales.shape == (EXPERTS, SLOTS)
    else:
        assert got.expert_token_scales is None


@pytest.mark.parametrize("fmt,layout", PAIRS)
def test_outputs_have_the_documented_shapes_and_dtypes(comm, fmt, layout):
    rng = np.random.default_rng([SEED, 1])
    x = _rows(rng, TOKENS, HIDDEN)
    idx, w = _routing(rng, TOKENS, EXPERTS, TOPK)
    buf = _buffer(comm, fmt, layout)
    assert buf.config.dispatch_format == fmt and buf.config.recv_scale_layout == layout
    assert buf.config.delivers_quantized and not buf.config.dispatch_dequantize
    assert buf.config.recv_row_bytes == q.payload_cols(fmt, HIDDEN) == ferry.wire_payload_bytes(fmt, HIDDEN)
    cap = buf.recv_capacity

    eager = buf.dispatch(x, idx, w, expand=True)
    _check_shapes(eager, fmt, layout, TOKENS, cap, True)
    lazy = buf.dispatch(x, idx, w, expand=True, eager=False)
    _check_shapes(lazy, fmt, layout, cap, cap, True)
    plain = buf.dispatch(x, idx, w)
    _check_shapes(plain, fmt, layout, TOKENS, cap, False)

    # zero copy: the views are made once and reused (eager ones are slices of them)
    again = buf.dispatch(x, idx, w, expand=True, eager=False)
    for name in ("recv_x", "recv_scales", "expert_x", "expert_scales", "recv_token_scales", "expert_token_scales"):
        assert getattr(again, name) is getattr(lazy, name), name
    assert np.shares_memory(eager.recv_x, lazy.recv_x) and np.shares_memory(eager.recv_scales, lazy.recv_scales)

    # every layout holds the scales of the row-major one; expert-major groups hold those of their slots' rows
    row_major = _outputs(_buffer(comm, fmt).dispatch(x, idx, w, expand=True))
    got = _outputs(buf.dispatch(x, idx, w, expand=True))
    n = got["num_recv"]
    np.testing.assert_array_equal(got["recv_x"], row_major["recv_x"])
    rm = row_major["recv_scales"]
    np.testing.assert_array_equal(q.to_row_major(fmt, layout, got["recv_scales"], cap, HIDDEN)[:n], rm[:n])
    for e in range(EXPERTS):
        count = min(int(got["expert_counts"][e]), SLOTS)
        src = got["expert_src_row"][e, :count]
        np.testing.assert_array_equal(got["expert_x"][e, :count], got["recv_x"][src])
        np.testing.assert_array_equal(q.to_row_major(fmt, layout, got["expert_scales"][e], SLOTS, HIDDEN)[:count],
                                      rm[src])
        if fmt == "nvfp4":
            np.testing.assert_array_equal(got["expert_token_scales"][e, :count], got["recv_token_scales"][src])

    # the delivered rows decode to the sent ones within docs/quant.md's bound
    sent = ref.bf16_to_float(x[got["recv_src"][:, 1]])
    decoded = q.dequantize(fmt, got["recv_x"], rm[:n], got["recv_token_scales"])
    assert np.all(np.abs(decoded.astype(np.float64) - sent) <= q.dequant_bound(fmt, sent))


@pytest.mark.parametrize("fmt", q.FORMATS)
def test_dequantize_equals_decoding_the_payload_yourself(comm, fmt):
    # dispatch_dequantize=True delivers bf16(fl(element * scale)): the same as decoding the quantized delivery with a
    # 256-entry e4m3 table (16-entry e2m1), the scales per block, and rounding to bf16.
    rng = np.random.default_rng([SEED, 2])
    x = _rows(rng, TOKENS, HIDDEN)
    idx, w = _routing(rng, TOKENS, EXPERTS, TOPK)
    quantized = _outputs(_buffer(comm, fmt).dispatch(x, idx, w, expand=True))
    buf = _buffer(comm, fmt, dispatch_dequantize=True)
    assert not buf.config.delivers_quantized and buf.config.recv_row_bytes == 2 * HIDDEN
    got = buf.dispatch(x, idx, w, expand=True)
    assert got.recv_x.dtype == np.uint16 and got.recv_x.shape == (TOKENS, HIDDEN)
    assert got.expert_x.dtype == np.uint16 and got.expert_x.shape == (EXPERTS, SLOTS, HIDDEN)
    for name in ("recv_scales", "recv_token_scales", "expert_scales", "expert_token_scales"):
        assert getattr(got, name) is None, name
    want = ref.float_to_bf16(q.dequantize(fmt, quantized["recv_x"], quantized["recv_scales"],
                                          quantized["recv_token_scales"]))
    np.testing.assert_array_equal(got.recv_x, want)
    for e in range(EXPERTS):
        count = min(int(got.expert_counts[e]), SLOTS)
        np.testing.assert_array_equal(got.expert_x[e, :count], want[got.expert_src_row[e, :count]])


def test_fp8_payload_matches_a_numpy_quantizer_bit_for_bit(comm):
    # The quantizer of quant_reference.py (docs/quant.md's fp8 rule) gives the delivered bytes and scales exactly:
    # what the GPU test (gpu_worker.py --quant) compares the cuda backend with.
    rng = np.random.default_rng([SEED, 3])
    x = _rows(rng, TOKENS, HIDDEN)
    idx, w = _routing(rng, TOKENS, EXPERTS, TOPK)
    got = _buffer(comm, "fp8").dispatch(x, idx, w)
    payload, scales = q.quantize_fp8(x[got.recv_src[:, 1]])
    np.testing.assert_array_equal(got.recv_x, payload)
    np.testing.assert_array_equal(got.recv_scales.view(np.uint32), scales.view(np.uint32))


@pytest.mark.parametrize("fmt,layout", PAIRS)
def test_prequantized_input_gives_identical_outputs(comm, fmt, layout):
    # x = the delivered payload of a first dispatch of the same rows, x_scales its row-major scales (and nvfp4's
    # per-token scales): dispatch forwards them, and every output is the same, byte for byte.
    rng = np.random.default_rng([SEED, 4])
    x = _rows(rng, TOKENS, HIDDEN)
    idx, w = _routing(rng, TOKENS, EXPERTS, TOPK, mask_rate=0.3)
    first = _outputs(_buffer(comm, fmt).dispatch(x, idx, w))
    assert np.array_equal(first["recv_src"][:, 1], np.arange(TOKENS))  # one rank: every token once, in order
    buf = _buffer(comm, fmt, layout)
    want = _outputs(buf.dispatch(x, idx, w, expand=True))
    got = _outputs(buf.dispatch(first["recv_x"], idx, w, x_scales=first["recv_scales"],
                                x_token_scales=first["recv_token_scales"], expand=True))
    for name, value in want.items():
        if value is None:
            assert got[name] is None, name
        else:
            np.testing.assert_array_equal(got[name], value, err_msg=name)
    # int8 payload is accepted as the same bytes
    signed = _outputs(buf.dispatch(first["recv_x"].view(np.int8), idx, w, x_scales=first["recv_scales"],
                                   x_token_scales=first["recv_token_scales"]))
    np.testing.assert_array_equal(signed["recv_x"], want["recv_x"])


# ---- two ranks: quantized dispatch (normal and low-latency) and combine --------------------------------------------

CONFIG = ref.Config(hidden=HIDDEN, num_experts=6, topk=3, max_tokens_per_rank=12, expert_capacity=24)
NUM_TOKENS = [12, 7]


def _dispatch_body(ctx, fmt: str, seed: int):
    comm = ctx.init()
    mine = ref.make_inputs(CONFIG, NUM_TOKENS, seed, 0.2)[ctx.rank]
    args = (mine.x, mine.topk_idx, mine.topk_weights)
    out = {}
    for layout in q.LAYOUTS[fmt]:
        buf = ferry.EpBuffer(comm, dispatch_format=fmt, recv_scale_layout=layout, **CONFIG.kwargs())
        out[layout] = _outputs(buf.dispatch(*args, expand=True))
        out[layout]["capacity"] = buf.recv_capacity
    buf = ferry.EpBuffer(comm, dispatch_format=fmt, dispatch_dequantize=True, **CONFIG.kwargs())
    out["dequantized"] = _outputs(buf.dispatch(*args, expand=True))
    ll = ferry.EpBuffer(comm, dispatch_format=fmt, mode="ll", **{**CONFIG.kwargs(), "expert_capacity": None})
    got = ll.dispatch(*args)
    out["ll"] = _outputs(got) | {"slots": got.expert_slots}
    return out


@pytest.mark.parametrize("fmt", q.FORMATS)
def test_two_ranks_deliver_what_the_reference_sends(fmt):
    results = run_ranks(_dispatch_body, 2, fmt, SEED)
    inputs = ref.make_inputs(CONFIG, NUM_TOKENS, SEED, 0.2)
    for rank, out in enumerate(results):
        want = ref.dispatch(CONFIG, 2, rank, inputs)
        n = want.num_recv
        base = out["row_major"]
        assert base["num_recv"] == n
        np.testing.assert_array_equal(base["recv_src"], want.recv_src)
        np.testing.assert_array_equal(base["recv_topk_idx"], want.recv_topk_idx)
        np.testing.assert_array_equal(base["recv_topk_weights"], want.recv_topk_weights)
        np.testing.assert_array_equal(base["expert_counts"], want.expert_counts)
        sent = ref.bf16_to_float(want.recv_x)
        decoded = q.dequantize(fmt, base["recv_x"], base["recv_scales"], base["recv_token_scales"])
        assert np.all(np.abs(decoded.astype(np.float64) - sent) <= q.dequant_bound(fmt, sent)), f"rank {rank}"
        if fmt == "fp8":
            payload, scales = q.quantize_fp8(want.recv_x)
            np.testing.assert_array_equal(base["recv_x"], payload)
            np.testing.assert_array_equal(base["recv_scales"], scales)
        for layout in q.LAYOUTS[fmt]:
            got = out[layout]
            np.testing.assert_array_equal(got["recv_x"], base["recv_x"])
            np.testing.assert_array_equal(
                q.to_row_major(fmt, layout, got["recv_scales"], got["capacity"], HIDDEN)[:n], base["recv_scales"])
        deq = out["dequantized"]
        np.testing.assert_array_equal(deq["recv_x"], ref.float_to_bf16(decoded), err_msg=f"rank {rank}")
        # low-latency mode: the expert-major layout only, payload + scales
        ll = out["ll"]
        assert ll["recv_x"] is None and ll["recv_scales"] is None and ll["recv_token_scales"] is None
        assert ll["expert_x"].shape == (CONFIG.num_local(2), ll["slots"], q.payload_cols(fmt, HIDDEN))
        shape, dtype = q.scale_shape(fmt, "row_major", ll["slots"], HIDDEN)
        assert ll["expert_scales"].shape == (CONFIG.num_local(2),) + shape and ll["expert_scales"].dtype == dtype
        for e in range(CONFIG.num_local(2)):
            count = int(want.expert_counts[e])
            rows = want.expert_src_row[e, :count]
            np.testing.assert_array_equal(ll["expert_x"][e, :count], base["recv_x"][rows])
            np.testing.assert_array_equal(ll["expert_scales"][e, :count], base["recv_scales"][rows])
            if fmt == "nvfp4":
                np.testing.assert_array_equal(ll["expert_token_scales"][e, :count], base["recv_token_scales"][rows])


COMBINE_FORMATS = ["bf16"] + q.FORMATS


def _rank_rows(rank: int, rows: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, 4000 + rank])
    return _rows(rng, rows, HIDDEN)


def _combine_body(ctx, seed: int):
    comm = ctx.init()
    mine = ref.make_inputs(CONFIG, NUM_TOKENS, seed, 0.2)[ctx.rank]
    out = {}
    for fmt in COMBINE_FORMATS:
        for dispatch_format in ("bf16", "fp8") if fmt == "fp8" else ("bf16",):
            buf = ferry.EpBuffer(comm, combine_format=fmt, dispatch_format=dispatch_format, **CONFIG.kwargs())
            got = buf.dispatch(mine.x, mine.topk_idx, mine.topk_weights, expand=True)
            expert = np.array(buf.combine(ref.expert_outputs(CONFIG, ctx.world, ctx.rank, seed), "expert"))
            rank = np.array(buf.combine(_rank_rows(ctx.rank, got.num_recv_host, seed), "rank"))
            out[(fmt, dispatch_format)] = {"expert": expert, "rank": rank}
    return out


def test_quantized_combine_is_within_the_documented_bound():
    # Each token's y is the sum of one row per rank it went to: those rows are quantized in the combine format, sent,
    # dequantized and summed in fp32. docs/quant.md "Combine bound" bounds |y - exact sum| elementwise by
    # rel_c * sum|x_i| + block_c * sum block_amax_i + row_c * sum row_amax_i + floor_c, with the per-format
    # coefficients (fp8 rel 1/17, fp4 1/5, ...). bf16 combine is the exact reference's; the quantized ones are also
    # compared with it.
    results = run_ranks(_combine_body, 2, SEED)
    inputs = ref.make_inputs(CONFIG, NUM_TOKENS, SEED, 0.2)
    received = [ref.dispatch(CONFIG, 2, d, inputs) for d in range(2)]
    sent_rows = {
        "expert": [ref.reduce_local_experts(CONFIG, received[d], ref.expert_outputs(CONFIG, 2, d, SEED))
                   for d in range(2)],
        "rank": [_rank_rows(d, received[d].num_recv, SEED) for d in range(2)],
    }
    worst = {}
    for rank in range(2):
        tokens = NUM_TOKENS[rank]
        for layout, rows in sent_rows.items():
            # the rows x_i of this rank's tokens, one per destination (zero where the token did not go)
            terms = []
            for d in range(2):
                term = np.zeros((tokens, HIDDEN), np.float64)
                for t in range(tokens):
                    i = received[d].row_of.get((rank, t))
                    if i is not None:
                        term[t] = ref.bf16_to_float(rows[d][i])
                terms.append(term)
            exact = terms[0] + terms[1]
            y_bf16 = ref.bf16_to_float(results[rank][("bf16", "bf16")][layout]).astype(np.float64)
            np.testing.assert_array_equal(results[rank][("bf16", "bf16")][layout],
                                          ref.combine(CONFIG, 2, rank, inputs, received, rows))
            for (fmt, dispatch_format), ys in results[rank].items():
                y = ref.bf16_to_float(ys[layout]).astype(np.float64)
                bound = q.combine_bound(fmt, terms)
                err = np.abs(y - exact)
                assert np.all(err <= bound), (fmt, dispatch_format, layout, rank, float((err / bound).max()))
                # against the bf16 combine: both bounds together
                assert np.all(np.abs(y - y_bf16) <= bound + q.combine_bound("bf16", terms))
                key = (fmt, layout)
                worst[key] = max(worst.get(key, 0.0), float((err / bound).max()) if err.size else 0.0)
    print("combine: worst error / documented bound: " +
          ", ".join(f"{fmt} {layout} {value:.2f}" for (fmt, layout), value in sorted(worst.items())))


# ---- errors: the C++ messages ------------------------------------------------------------------------------------

FORMAT = r"^{subsystem} error \([\w.]+:\d+\): "


def _raises(kind, call, *pieces):
    with pytest.raises(kind) as caught:
        call()
    message = str(caught.value)
    assert re.match(FORMAT.format(subsystem="config" if kind is ferry.ConfigError else "input"), message), message
    for piece in pieces:
        assert piece in message, message
    return message


def test_bad_configs_are_config_errors(comm):
    _raises(ferry.ConfigError, lambda: _buffer(comm, "bf16", dispatch_dequantize=True),
            "dispatch_dequantize=true needs a quantized dispatch_format")
    _raises(ferry.ConfigError, lambda: _buffer(comm, "fp8", "blocked_128x4"),
            "recv_scale_layout=blocked_128x4 cannot hold the scales of dispatch_format=fp8")
    _raises(ferry.ConfigError, lambda: _buffer(comm, "nvfp4", "mn_major_tma_packed_ue8m0"),
            "recv_scale_layout=mn_major_tma_packed_ue8m0", "dispatch_format=nvfp4")
    _raises(ferry.ConfigError, lambda: _buffer(comm, "fp8", "column_major"), "scale layout 'column_major' is unknown",
            "row_major")
    _raises(ferry.ConfigError, lambda: _buffer(comm, "fp8_e5m2"), "wire format 'fp8_e5m2' is unknown")
    _raises(ferry.ConfigError, lambda: ferry.EpBuffer(comm, hidden=96, num_experts=4, topk=2, max_tokens_per_rank=8,
                                                      dispatch_format="fp8"), "hidden=96", "fp8")
    for fmt, layout in PAIRS:
        assert ferry.scale_layout_supported(fmt, layout)
    assert not ferry.scale_layout_supported("fp8", "blocked_128x4")
    assert not ferry.scale_layout_supported("bf16", "row_major")


def test_bad_prequantized_input_is_an_input_error(comm):
    rng = np.random.default_rng([SEED, 5])
    x = _rows(rng, 3, HIDDEN)
    idx, w = _routing(rng, 3, EXPERTS, TOPK)
    scales = np.ones((3, 2), np.float32)
    _raises(ferry.InputError, lambda: _buffer(comm, "bf16").dispatch(x, idx, w, x_scales=scales),
            "x_scales is set (pre-quantized input) but dispatch_format=bf16 has no scales")
    fp8 = _buffer(comm, "fp8")
    payload = np.zeros((3, HIDDEN), np.uint8)
    _raises(ferry.InputError, lambda: fp8.dispatch(x, idx, w, x_scales=scales), "x has dtype uint16",
            "float8_e4m3fn or uint8")
    _raises(ferry.InputError, lambda: fp8.dispatch(payload, idx, w, x_scales=scales.astype(np.uint8)),
            "x_scales has dtype uint8", "float32")
    _raises(ferry.InputError, lambda: fp8.dispatch(payload, idx, w, x_scales=scales[:, :1]),
            "x_scales has shape [3, 1]", "expected [3, 2]")
    _raises(ferry.InputError, lambda: fp8.dispatch(payload[:, :128], idx, w, x_scales=scales),
            "x has shape [3, 128]", f"[num_tokens, {HIDDEN}]")
    _raises(ferry.InputError, lambda: fp8.dispatch(payload, idx, w, x_scales=scales,
                                                   x_token_scales=np.ones(3, np.float32)),
            "x_token_scales is set, but it belongs only to pre-quantized nvfp4 input")
    _raises(ferry.InputError, lambda: fp8.dispatch(x, idx, w, x_token_scales=np.ones(3, np.float32)),
            "x_token_scales is set")
    nvfp4 = _buffer(comm, "nvfp4")
    packed = np.zeros((3, HIDDEN // 2), np.uint8)
    block_scales = np.zeros((3, HIDDEN // 16), np.uint8)
    _raises(ferry.InputError, lambda: nvfp4.dispatch(packed, idx, w, x_scales=block_scales),
            "pre-quantized nvfp4 input needs x_token_scales")
    _raises(ferry.InputError, lambda: nvfp4.dispatch(packed, idx, w, x_scales=block_scales,
                                                     x_token_scales=np.ones(3, np.float64)),
            "x_token_scales has dtype float64", "float32")
    _raises(ferry.InputError, lambda: nvfp4.dispatch(payload, idx, w, x_scales=block_scales,
                                                     x_token_scales=np.ones(3, np.float32)),
            f"x has shape [3, {HIDDEN}]", f"[num_tokens, {HIDDEN // 2}]")


# ---- torch (CPU tensors on the cpu backend; the GPU path is gpu_worker.py --quant) ----------------------------------

@pytest.mark.parametrize("fmt", q.FORMATS)
def test_torch_views_and_prequantized_torch_input(comm, fmt):
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng([SEED, 6])
    x = _rows(rng, TOKENS, HIDDEN)
    idx, w = _routing(rng, TOKENS, EXPERTS, TOPK)
    layout = "mn_major_tma_packed_ue8m0" if fmt in ("fp8_ue8m0", "mxfp4") else "row_major"
    buf = _buffer(comm, fmt, layout)
    tx = torch.from_numpy(x.view(np.int16)).view(torch.bfloat16)
    got = buf.dispatch(tx, torch.from_numpy(idx), torch.from_numpy(w), expand=True)
    payload_dtype = torch.float8_e4m3fn if q.is_fp8(fmt) else torch.uint8
    assert got.recv_x.dtype == payload_dtype and tuple(got.recv_x.shape) == (TOKENS, q.payload_cols(fmt, HIDDEN))
    assert got.expert_x.dtype == payload_dtype
    assert got.expert_x.shape == (EXPERTS, SLOTS, q.payload_cols(fmt, HIDDEN))
    shape, dtype = q.scale_shape(fmt, layout, buf.recv_capacity, HIDDEN)
    if layout == "row_major":
        shape = (TOKENS, shape[1])
    assert tuple(got.recv_scales.shape) == shape
    assert got.recv_scales.dtype == {np.float32: torch.float32, np.uint8: torch.uint8, np.int32: torch.int32}[dtype]
    again = buf.dispatch(tx, torch.from_numpy(idx), torch.from_numpy(w), expand=True)
    assert again.recv_x.data_ptr() == got.recv_x.data_ptr() and again.expert_scales is got.expert_scales
    numpy_out = _outputs(_buffer(comm, fmt, layout).dispatch(x, idx, w, expand=True))
    np.testing.assert_array_equal(got.recv_x.view(torch.uint8).numpy(), numpy_out["recv_x"])
    np.testing.assert_array_equal(got.recv_scales.numpy(), numpy_out["recv_scales"])

    # pre-quantized torch input in torch's own one-byte dtypes: fp8 payload, fp4x2 payload, e8m0 / e4m3 scales
    first = _outputs(_buffer(comm, fmt).dispatch(x, idx, w))
    xq = torch.from_numpy(first["recv_x"])
    if q.is_fp8(fmt):
        xq = xq.view(torch.float8_e4m3fn)
    elif hasattr(torch, "float4_e2m1fn_x2"):
        xq = xq.view(torch.float4_e2m1fn_x2)
    scales = torch.from_numpy(first["recv_scales"])
    if fmt == "nvfp4":
        scales = scales.view(torch.float8_e4m3fn)
    elif fmt != "fp8" and hasattr(torch, "float8_e8m0fnu"):
        scales = scales.view(torch.float8_e8m0fnu)
    token = None if first["recv_token_scales"] is None else torch.from_numpy(first["recv_token_scales"])
    pre = buf.dispatch(xq, torch.from_numpy(idx), torch.from_numpy(w), x_scales=scales, x_token_scales=token,
                       expand=True)
    np.testing.assert_array_equal(pre.recv_x.view(torch.uint8).numpy(), numpy_out["recv_x"])
    np.testing.assert_array_equal(pre.expert_scales.numpy(), numpy_out["expert_scales"])
