"""Ferry's wire formats in NumPy (docs/quant.md), for the Python tests: decoding the delivered payload and scales,
the receiver scale layouts, an fp8 (e4m3, fp32 scale per 128) quantizer bit for bit with the host codec, and the
documented error bounds.

Everything here is read off docs/quant.md; the C++ (src/wire/) is the implementation under test.
"""

from __future__ import annotations

import numpy as np

from reference import bf16_to_float

FORMATS = ["fp8", "fp8_ue8m0", "nvfp4", "mxfp4"]
# (format, layout) pairs the receiver can lay scales out in (ScaleLayout in include/ferry/wire_format.hpp)
LAYOUTS = {
    "fp8": ["row_major", "mn_major_tma"],
    "fp8_ue8m0": ["row_major", "mn_major_tma", "mn_major_tma_packed_ue8m0"],
    "nvfp4": ["row_major", "mn_major_tma", "blocked_128x4"],
    "mxfp4": ["row_major", "mn_major_tma", "mn_major_tma_packed_ue8m0", "blocked_128x4"],
}
ALL_LAYOUTS = ["row_major", "mn_major_tma", "mn_major_tma_packed_ue8m0", "blocked_128x4"]
BLOCK = {"bf16": 1, "fp8": 128, "fp8_ue8m0": 128, "nvfp4": 16, "mxfp4": 32}
SCALE_BYTES = {"fp8": 4, "fp8_ue8m0": 1, "nvfp4": 1, "mxfp4": 1}


def is_fp8(fmt: str) -> bool:
    return fmt in ("fp8", "fp8_ue8m0")


def payload_cols(fmt: str, hidden: int) -> int:
    """Columns of the delivered payload: one byte per element (fp8), two elements per byte (fp4)."""
    return hidden if is_fp8(fmt) else hidden // 2


def num_scales(fmt: str, hidden: int) -> int:
    return hidden // BLOCK[fmt]


# ---- element decoding -------------------------------------------------------------------------------------------

def _e4m3_table() -> np.ndarray:
    codes = np.arange(256)
    exponent, mantissa = (codes >> 3) & 0xF, codes & 0x7
    magnitude = np.where(exponent == 0, mantissa * 2.0 ** -9, (8 + mantissa) * 2.0 ** (exponent - 10.0))
    values = np.where(codes & 0x80, -magnitude, magnitude)
    values[(codes & 0x7F) == 0x7F] = np.nan
    return values.astype(np.float32)


E4M3 = _e4m3_table()  # code -> value (0x7F / 0xFF: NaN)
E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def ue8m0(byte: np.ndarray) -> np.ndarray:
    """UE8M0 byte b -> 2^(b - 127) (0xFF: NaN), exact in float32."""
    b = np.asarray(byte, np.uint8).astype(np.int64)
    out = np.ldexp(np.float32(1), (b - 127).astype(np.int32)).astype(np.float32)
    return np.where(b == 0xFF, np.float32(np.nan), out).astype(np.float32)


def unpack_e2m1(payload: np.ndarray) -> np.ndarray:
    """[..., hidden / 2] bytes -> [..., hidden] codes; element 2i is the low nibble of byte i."""
    p = np.asarray(payload, np.uint8)
    out = np.empty(p.shape[:-1] + (p.shape[-1] * 2,), np.uint8)
    out[..., 0::2] = p & 0xF
    out[..., 1::2] = p >> 4
    return out


def dequantize(fmt: str, payload: np.ndarray, scales: np.ndarray, token_scales: np.ndarray | None = None):
    """fp32 values [rows, hidden] of delivered rows: payload [rows, payload_cols] (uint8), row-major block scales
    [rows, num_scales] (float32 for fp8, uint8 otherwise), nvfp4's per-token scales [rows]. As docs/quant.md:
    y = fl(element * scale) with scale the fp32 block scale, 2^(b - 127), or fl(e4m3(b) * s_t) (nvfp4)."""
    payload = np.asarray(payload).view(np.uint8)
    rows = payload.shape[0]
    if is_fp8(fmt):
        elements = E4M3[payload]
    else:
        elements = E2M1[unpack_e2m1(payload)]
    hidden = elements.shape[1]
    if fmt == "fp8":
        scale = np.asarray(scales, np.float32)
    elif fmt == "nvfp4":
        t = np.asarray(token_scales, np.float32).reshape(rows, 1)
        scale = (E4M3[np.asarray(scales, np.uint8)] * t).astype(np.float32)
    else:
        scale = ue8m0(scales)
    scale = np.repeat(scale.reshape(rows, -1), BLOCK[fmt], axis=1)[:, :hidden]
    with np.errstate(invalid="ignore"):
        return (elements * scale).astype(np.float32)


# ---- fp8 quantizer (fp8_e4m3, fp32 scale per 128), bit for bit with src/wire/host_codec.cpp -----------------------

_E4M3_POSITIVE = E4M3[:127].astype(np.float64)  # codes 0..126, ascending


def cvt_e4m3(v: np.ndarray) -> np.ndarray:
    """float32 -> e4m3 code, round to nearest even, saturating to 448 (finite input); the sign is kept (-0 -> 0x80)."""
    v = np.asarray(v, np.float32)
    a = np.minimum(np.abs(v).astype(np.float64), 448.0)
    upper = np.clip(np.searchsorted(_E4M3_POSITIVE, a, side="left"), 0, 126)
    lower = np.maximum(upper - 1, 0)
    d_up = _E4M3_POSITIVE[upper] - a
    d_lo = a - _E4M3_POSITIVE[lower]
    pick_up = (d_up < d_lo) | ((d_up == d_lo) & (upper % 2 == 0))
    code = np.where(pick_up, upper, lower).astype(np.uint8)
    negative = np.signbit(v)
    return np.where(negative, code | np.uint8(0x80), code).astype(np.uint8)


def quantize_fp8(x_bits: np.ndarray):
    """bf16 rows [rows, hidden] (uint16 bits, finite) -> (payload uint8 [rows, hidden], scales float32 [rows,
    hidden / 128]): scale = max(fl(amax / 448), 2^-126), code = cvt_e4m3(fl(x * fl(1 / scale)))."""
    x = bf16_to_float(x_bits)
    rows, hidden = x.shape
    blocks = x.reshape(rows, hidden // 128, 128)
    amax = np.abs(blocks).max(axis=2)
    scale = np.maximum((amax / np.float32(448)).astype(np.float32), np.float32(2.0 ** -126)).astype(np.float32)
    inv = (np.float32(1) / scale).astype(np.float32)
    codes = cvt_e4m3((blocks * inv[:, :, None]).astype(np.float32))
    return codes.reshape(rows, hidden), scale


# ---- receiver scale layouts (docs/quant.md "Receiver scale layouts") ----------------------------------------------

def to_row_major(fmt: str, layout: str, tensor: np.ndarray, rows: int, hidden: int) -> np.ndarray:
    """One scale tensor (the view dispatch returned for one group) -> [rows, num_scales] in the wire's order."""
    ns = num_scales(fmt, hidden)
    raw = np.ascontiguousarray(tensor).view(np.uint8).reshape(-1)
    elem = SCALE_BYTES[fmt]
    dtype = np.float32 if elem == 4 else np.uint8
    if layout == "row_major":  # (an eager result's row-major scales are sliced to the rows received)
        rows = min(rows, raw.size // (ns * elem))
    r = np.arange(rows)[:, None]
    j = np.arange(ns)[None, :]
    if layout == "row_major":
        offset = (r * ns + j) * elem
    elif layout == "mn_major_tma":
        aligned = tensor.shape[-1]
        assert aligned % (16 // elem) == 0 and aligned >= rows, (aligned, rows)
        offset = (j * aligned + r) * elem
    elif layout == "mn_major_tma_packed_ue8m0":
        aligned = tensor.shape[-1]
        assert aligned % 4 == 0 and aligned >= rows
        offset = ((j // 4) * aligned + r) * 4 + j % 4
    elif layout == "blocked_128x4":
        offset = ((r // 128) * ((ns + 3) // 4) + j // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + j % 4
    else:
        raise ValueError(layout)
    if elem == 4:
        out = np.stack([raw[offset + b] for b in range(4)], axis=-1).copy().view(np.float32)[..., 0]
    else:
        out = raw[offset]
    return np.asarray(out, dtype).reshape(rows, ns)


def scale_shape(fmt: str, layout: str, rows: int, hidden: int) -> tuple:
    """The shape and dtype docs/python.md gives one scale tensor of `rows` rows."""
    ns = num_scales(fmt, hidden)
    elem = SCALE_BYTES[fmt]
    dtype = np.float32 if elem == 4 else np.uint8
    if layout == "row_major":
        return (rows, ns), dtype
    if layout == "mn_major_tma":
        step = 16 // elem
        return (ns, -(-rows // step) * step), dtype
    if layout == "mn_major_tma_packed_ue8m0":
        return (-(-ns // 4), -(-rows // 4) * 4), np.int32
    if layout == "blocked_128x4":
        return (-(-rows // 128) * 128 * (-(-ns // 4) * 4),), np.uint8
    raise ValueError(layout)


# ---- error bounds (docs/quant.md "Error bounds"; |y - x| <= rel |x| + block * block_amax + row * row_amax + floor) ---

EPS = 2.0 ** -24
F32_BOUND = {  # fp32 output of one quantized element: (rel, block, row, floor)
    "bf16": (1 / 257, 0.0, 0.0, 2.0 ** -134),
    "fp8": (1 / 17 + 2.0 ** -22, 2.0 ** -10 / 448 * (1 + 2.0 ** -22), 0.0,
            2.0 ** -136 * (1 + 2.0 ** -23) + 2.0 ** -149),
    "fp8_ue8m0": (1 / 17, 2.0 ** -9 / 448 * (1 + 2.0 ** -23), 0.0, 2.0 ** -135),
    "nvfp4": (1 / 5 + 2.0 ** -22, 3 / 68 * (1 + 2.0 ** -22), 25 * 2.0 ** -12 / 2688 * (1 + 2.0 ** -16),
              25 * 2.0 ** -129 * (1 + 2.0 ** -16) + 2.0 ** -149),
    "mxfp4": (1 / 5, 1 / 12 * (1 + 2.0 ** -23), 0.0, 2.0 ** -127),
}


def _amaxes(fmt: str, x: np.ndarray):
    """Per element: the amax of its block and of its row."""
    x = np.abs(np.asarray(x, np.float64))
    rows, hidden = x.shape
    block = BLOCK[fmt]
    block_amax = np.repeat(x.reshape(rows, hidden // block, block).max(axis=2), block, axis=1)
    row_amax = np.broadcast_to(x.max(axis=1, keepdims=True), x.shape)
    return block_amax, row_amax


def dequant_bound(fmt: str, x: np.ndarray) -> np.ndarray:
    """Elementwise bound on |y - x| for y the fp32 dequantized value of x (finite rows [rows, hidden])."""
    rel, block, row, floor = F32_BOUND[fmt]
    block_amax, row_amax = _amaxes(fmt, x)
    return rel * np.abs(np.asarray(x, np.float64)) + block * block_amax + row * row_amax + floor


def combine_bound(fmt: str, terms: list[np.ndarray]) -> np.ndarray:
    """Elementwise bound on |y - sum_i x_i| for y the bf16 combine of the rows x_i [tokens, hidden] (one per rank
    the token went to; zero rows where it did not), docs/quant.md "Combine bound" with N = len(terms)."""
    rel, block, row, floor = F32_BOUND[fmt]
    n = len(terms)
    gamma = (n - 1) * EPS / (1 - (n - 1) * EPS)
    k = gamma + (1 + gamma) / 257
    rel_c, block_c, row_c = rel * (1 + k) + k, block * (1 + k), row * (1 + k)
    floor_c = n * floor * (1 + k) + 2.0 ** -134
    total = np.zeros(np.shape(terms[0]), np.float64)
    for x in terms:
        block_amax, row_amax = _amaxes(fmt, x)
        total += rel_c * np.abs(np.asarray(x, np.float64)) + block_c * block_amax + row_c * row_amax
    return total + floor_c
