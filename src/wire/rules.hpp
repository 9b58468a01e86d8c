// Scale rules of the wire formats, shared by the host codecs (host_codec.cpp) and the device codecs
// (device_codec.cuh) so both compute every scale with the same fp32 operations in the same order. Element
// conversions (fp32 -> e4m3 / e2m1 / UE8M0) are not here: the host has its own plain C++ ones, the device uses
// CUDA's intrinsics, and the tests hold them bit-exact. docs/quant.md states the rules in words.
#pragma once

#include <cstdint>
#include <cstring>

#include "wire/layout.hpp"

namespace ferry::wire {

inline constexpr float kE4m3Max = 448.0f;  // largest finite e4m3
inline constexpr float kE2m1Max = 6.0f;    // largest e2m1
// Smallest block scale: the smallest normal fp32. Every scale is normal (a consumer that flushes denormals still sees
// it) and its reciprocal, at most 2^126, is finite.
inline constexpr float kMinScale = 0x1p-126f;
// Smallest nvfp4 per-token scale: 2^-126 / 2^-9 (2^-9 is the smallest non-zero e4m3), so that every non-zero block
// scale times the token scale is a normal fp32 with a finite reciprocal.
inline constexpr float kMinTokenScale = 0x1p-117f;
inline constexpr float kNvfp4TokenDivisor = kE4m3Max * kE2m1Max;  // 2688

inline constexpr uint8_t kE4m3Nan = 0x7F;     // e4m3 has no infinity; 0x7F / 0xFF are its NaNs
inline constexpr uint8_t kUe8m0Nan = 0xFF;    // UE8M0's only NaN
inline constexpr uint16_t kBf16Nan = 0x7FFF;  // the canonical NaN CUDA's fp32 -> bf16 conversion returns

FERRY_QUANT_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
#endif
}

FERRY_QUANT_HD float bits_float(uint32_t bits) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(bits);
#else
  float x;
  std::memcpy(&x, &bits, sizeof x);
  return x;
#endif
}

// IEEE round-to-nearest-even division and product, whatever the compiler flags (no fast-math reciprocal, no FMA
// contraction on the device).
FERRY_QUANT_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

FERRY_QUANT_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}

FERRY_QUANT_HD bool is_finite(float x) {
  return (float_bits(x) & 0x7F800000u) != 0x7F800000u;
}

FERRY_QUANT_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}

FERRY_QUANT_HD float abs_value(float x) {
  return bits_float(float_bits(x) & 0x7FFFFFFFu);
}

// max of two non-NaN values (exact, so the order of a reduction does not matter).
FERRY_QUANT_HD float max_value(float a, float b) {
  return a > b ? a : b;
}

// A quiet NaN with a fixed bit pattern.
FERRY_QUANT_HD float nan_value() {
  return bits_float(0x7FC00000u);
}

// UE8M0 byte b is 2^(b - 127); 0xFF is NaN. Exact.
FERRY_QUANT_HD float ue8m0_value(uint8_t byte) {
  if (byte == kUe8m0Nan) return nan_value();
  if (byte == 0) return bits_float(0x00400000u);  // 2^-127, a denormal
  return bits_float(static_cast<uint32_t>(byte) << 23);
}

// 1 / ue8m0_value(byte) = 2^(127 - b), exact for every byte but NaN.
FERRY_QUANT_HD float ue8m0_inverse(uint8_t byte) {
  if (byte == kUe8m0Nan) return nan_value();
  uint32_t const exponent = 254u - byte;              // biased exponent of 2^(127 - b)
  if (exponent == 0) return bits_float(0x00400000u);  // byte 254: 2^-127, a denormal
  return bits_float(exponent << 23);
}

// ---- fp8_e4m3: fp32 scale per 128 ----------------------------------------------------------------------------------
// amax: the largest |x| over the block's finite elements (0 when none).
FERRY_QUANT_HD float fp8_scale(float amax) {
  return max_value(div_rn(amax, kE4m3Max), kMinScale);
}

// ---- fp8_e4m3_ue8m0 and mxfp4: UE8M0 scale; the byte is the ceiling power of two of this value --------------------
FERRY_QUANT_HD float fp8_ue8m0_scale_target(float amax) {
  return max_value(div_rn(amax, kE4m3Max), kMinScale);
}

FERRY_QUANT_HD float mxfp4_scale_target(float amax) {
  return max_value(div_rn(amax, kE2m1Max), kMinScale);
}

// ---- nvfp4: fp32 per-token scale, e4m3 block scale per 16 ----------------------------------------------------------
// row_amax: the largest |x| over the row's finite elements.
FERRY_QUANT_HD float nvfp4_token_scale(float row_amax) {
  return max_value(div_rn(row_amax, kNvfp4TokenDivisor), kMinTokenScale);
}

// The value the block's e4m3 scale is rounded from.
FERRY_QUANT_HD float nvfp4_block_scale_target(float block_amax, float token_scale) {
  return div_rn(block_amax, mul_rn(kE2m1Max, token_scale));
}

// The block's effective scale: decoded e4m3 block scale times the token scale. Quantize divides by it (through its
// reciprocal), dequantize multiplies by it.
FERRY_QUANT_HD float nvfp4_effective_scale(float block_scale, float token_scale) {
  return mul_rn(block_scale, token_scale);
}

// e2m1 code of x for x not NaN (an infinity saturates), the same as e2m1_from_float: round to nearest even,
// saturating at +-6, a zero result keeps the sign. The device conversion on sm_90, which has no fp4 instruction (the
// fp4 quantizers are bound by this arithmetic): one fp32 addition rounds a = min(|x|, 6) to the e2m1 spacing of its
// binade and leaves the code in the sum's low bits. The addend M = 2^(22 + r) + 2r ulps, r = 0 for a < 2 (spacing
// 0.5), 1 for [2, 4) (spacing 1), 2 for [4, 6] (spacing 2): M's ulp is the spacing, so a + M rounds a to the e2m1
// grid with ties to even (M's low bits are even, so the parity of the sum's is a's), and the sum's mantissa holds
// round(a / spacing) + 2r, which is the code (0.5 -> 1, 1 -> 2, 2 -> 4, 3 -> 5, 4 -> 6, 6 -> 7). About ten operations
// per element and no branch (the seven compares of e2m1_from_float, or a branch per binade, took twice as many).
// Checked against e2m1_from_float for every non-NaN fp32 bit pattern (tests/unit/test_quant.cpp).
FERRY_QUANT_HD uint32_t e2m1_code_not_nan(float x) {
  uint32_t const bits = float_bits(x);
#if defined(__CUDA_ARCH__)
  float const a = fminf(fabsf(x), kE2m1Max);  // one FMNMX
#else
  float const magnitude = abs_value(x);
  float const a = magnitude < kE2m1Max ? magnitude : kE2m1Max;
#endif
  uint32_t const exponent = float_bits(a) >> 23;
  uint32_t const e = exponent > 127u ? exponent : 127u;  // 127 + r
  // M = e * (2^23 + 2) + (bits(2^22) - 127 * (2^23 + 2)): exponent 149 + r, mantissa 2r
  float const m = bits_float(e * 0x800002u + (0x4A800000u - 127u * 0x800002u));
  return (float_bits(add_rn(a, m)) & 7u) | ((bits >> 28) & 8u);
}

// e2m1 code of a signed zero: the sign bit of x (bit 3), magnitude 0. Used where the block scale is zero.
FERRY_QUANT_HD uint8_t e2m1_signed_zero(float x) {
  return static_cast<uint8_t>((float_bits(x) >> 28) & 0x8u);
}

}  // namespace ferry::wire
