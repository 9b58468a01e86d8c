// Host reference codecs (codec.hpp). The scale rules come from rules.hpp, shared with the device codecs; the element
// conversions below are written from the formats' definitions (round to nearest even on the bit patterns) and tested
// bit-exact against CUDA's host-callable conversions.
#include "wire/codec.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

#include "ferry/error.hpp"
#include "wire/layout.hpp"
#include "wire/rules.hpp"

namespace ferry::wire {

// ---- element conversions
// ---------------------------------------------------------------------------------------------

namespace {
// Rounds the integer significand `sig` right by `shift` bits, to nearest, ties to even.
uint32_t shift_round_even(uint32_t sig, int shift) {
  uint32_t const kept = sig >> shift;
  uint32_t const rest = sig & ((1u << shift) - 1u);
  uint32_t const half = 1u << (shift - 1);
  return kept + ((rest > half || (rest == half && (kept & 1u))) ? 1u : 0u);
}
}  // namespace

uint8_t e4m3_from_float(float x) {
  uint32_t const bits = float_bits(x);
  uint32_t const mag = bits & 0x7FFFFFFFu;
  auto const sign = static_cast<uint8_t>((bits >> 24) & 0x80u);
  if (mag > 0x7F800000u) return kE4m3Nan;                  // NaN (CUDA canonicalizes it to a positive NaN first)
  if (mag >= 0x43E00000u) return sign | 0x7Eu;             // |x| >= 448, Inf included: saturate to +-448
  if (mag <= 0x3A800000u) return sign;                     // |x| <= 2^-10 (half the smallest denormal, a tie to 0)
  int const exponent = static_cast<int>(mag >> 23) - 127;  // in [-10, 8]
  uint32_t const sig = (mag & 0x7FFFFFu) | 0x800000u;      // 1.f as a 24-bit integer
  if (exponent >= -6) {
    // Normal e4m3: biased exponent exponent + 7, 3 fraction bits. A carry out of the fraction bumps the exponent,
    // which is what rounding up to the next binade means; |x| < 448 cannot round past 448 (0x7E).
    uint32_t const fraction = shift_round_even(sig, 20);  // 4 significant bits, 8..16
    return sign | static_cast<uint8_t>(((static_cast<uint32_t>(exponent + 7)) << 3) + fraction - 8u);
  }
  // Denormal e4m3: |x| / 2^-9 rounded to an integer 0..8 (8 is 2^-6, the smallest normal, code 0x08).
  return sign | static_cast<uint8_t>(shift_round_even(sig, 14 - exponent));
}

float e4m3_to_float(uint8_t code) {
  if ((code & 0x7Fu) == 0x7Fu) return std::numeric_limits<float>::quiet_NaN();
  int const exponent = (code >> 3) & 0xF;
  int const mantissa = code & 0x7;
  float const magnitude = exponent == 0 ? std::ldexp(static_cast<float>(mantissa), -9)
                                        : std::ldexp(static_cast<float>(8 + mantissa), exponent - 10);
  return (code & 0x80u) ? -magnitude : magnitude;
}

uint8_t e2m1_from_float(float x) {
  uint32_t const bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return 0x7u;  // NaN: +6, as CUDA (e2m1 has no NaN)
  auto const sign = static_cast<uint8_t>((bits >> 28) & 0x8u);
  float const a = abs_value(x);
  // The magnitude code counts the midpoints below |x|. Each midpoint is a tie between an even and an odd code and
  // rounds to the even one: '>' where the even code is below the midpoint, '>=' where it is above.
  int const code = (a > 0.25f) + (a >= 0.75f) + (a > 1.25f) + (a >= 1.75f) + (a > 2.5f) + (a >= 3.5f) + (a > 5.0f);
  return sign | static_cast<uint8_t>(code);
}

float e2m1_to_float(uint8_t code) {
  static constexpr float kMagnitude[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
  float const magnitude = kMagnitude[code & 0x7u];
  return (code & 0x8u) ? -magnitude : magnitude;
}

uint8_t ue8m0_from_float_ceil(float x) {
  uint32_t const mag = float_bits(x) & 0x7FFFFFFFu;
  if (mag > 0x7F800000u) return kUe8m0Nan;
  if (mag == 0x7F800000u) return 0xFEu;  // Inf saturates
  uint32_t const exponent = mag >> 23;
  uint32_t const fraction = mag & 0x7FFFFFu;
  if (exponent == 0) return fraction > 0x400000u ? 1u : 0u;  // denormal: <= 2^-127 -> 2^-127, else 2^-126
  uint32_t const ceiling = exponent + (fraction != 0 ? 1u : 0u);
  return static_cast<uint8_t>(ceiling > 0xFEu ? 0xFEu : ceiling);
}

float ue8m0_to_float(uint8_t byte) {
  return ue8m0_value(byte);
}

uint16_t bf16_from_float(float x) {
  uint32_t const bits = float_bits(x);
  if ((bits & 0x7FFFFFFFu) > 0x7F800000u) return kBf16Nan;
  uint32_t const upper = bits >> 16;
  uint32_t const rest = bits & 0xFFFFu;
  return static_cast<uint16_t>(upper + ((rest > 0x8000u || (rest == 0x8000u && (upper & 1u))) ? 1u : 0u));
}

float bf16_to_float(uint16_t bits) {
  return bits_float(static_cast<uint32_t>(bits) << 16);
}

// ---- rows
// ------------------------------------------------------------------------------------------------------------

namespace {

void store_f32(uint8_t* dst, float value) {
  std::memcpy(dst, &value, sizeof value);
}

float load_f32(uint8_t const* src) {
  float value;
  std::memcpy(&value, src, sizeof value);
  return value;
}

// Largest |x| over the finite elements of x[0, count), and whether any element is not finite.
struct Amax {
  float amax = 0.0f;
  bool non_finite = false;
};

Amax block_amax(float const* x, int count) {
  Amax result;
  for (int i = 0; i < count; ++i) {
    if (is_finite(x[i]))
      result.amax = max_value(result.amax, abs_value(x[i]));
    else
      result.non_finite = true;
  }
  return result;
}

void set_e2m1(uint8_t* payload, int i, uint8_t code) {
  uint8_t& byte = payload[i / 2];
  byte =
      (i % 2 == 0) ? static_cast<uint8_t>((byte & 0xF0u) | code) : static_cast<uint8_t>((byte & 0x0Fu) | (code << 4));
}

uint8_t get_e2m1(uint8_t const* payload, int i) {
  return (i % 2 == 0) ? (payload[i / 2] & 0x0Fu) : (payload[i / 2] >> 4);
}

void quantize_values(WireFormat format, float const* x, int hidden, uint8_t* wire) {
  WireRowLayout const layout = wire_row_layout(format, hidden);
  std::memset(wire, 0, layout.row_bytes);
  uint8_t* const payload = wire;
  uint8_t* const scales = wire + layout.scales_offset;
  int const block = layout.block_elems;
  switch (format) {
    case WireFormat::bf16:
      for (int i = 0; i < hidden; ++i) {
        uint16_t const value = bf16_from_float(x[i]);
        std::memcpy(payload + 2 * i, &value, sizeof value);
      }
      return;
    case WireFormat::fp8_e4m3:
    case WireFormat::fp8_e4m3_ue8m0:
      for (int j = 0; j < layout.num_scales; ++j) {
        float const* xb = x + j * block;
        Amax const a = block_amax(xb, block);
        float inverse;
        if (format == WireFormat::fp8_e4m3) {
          float const scale = fp8_scale(a.amax);
          inverse = div_rn(1.0f, scale);
          store_f32(scales + 4 * j, scale);
        } else {
          uint8_t const byte = ue8m0_from_float_ceil(fp8_ue8m0_scale_target(a.amax));
          inverse = ue8m0_inverse(byte);
          scales[j] = byte;
        }
        // Non-finite elements become e4m3's NaN; the scale comes from the finite ones.
        for (int i = 0; i < block; ++i)
          payload[j * block + i] = is_finite(xb[i]) ? e4m3_from_float(mul_rn(xb[i], inverse)) : kE4m3Nan;
      }
      return;
    case WireFormat::nvfp4: {
      float const token_scale = nvfp4_token_scale(block_amax(x, hidden).amax);
      store_f32(wire + layout.token_scale_offset, token_scale);
      for (int j = 0; j < layout.num_scales; ++j) {
        float const* xb = x + j * block;
        Amax const a = block_amax(xb, block);
        if (a.non_finite) {
          // e2m1 has no NaN: the block scale carries it, the codes stay 0.
          scales[j] = kE4m3Nan;
          continue;
        }
        uint8_t const block_code = e4m3_from_float(nvfp4_block_scale_target(a.amax, token_scale));
        scales[j] = block_code;
        float const block_scale = e4m3_to_float(block_code);
        if (block_scale == 0.0f) {
          for (int i = 0; i < block; ++i) set_e2m1(payload, j * block + i, e2m1_signed_zero(xb[i]));
          continue;
        }
        float const inverse = div_rn(1.0f, nvfp4_effective_scale(block_scale, token_scale));
        for (int i = 0; i < block; ++i) set_e2m1(payload, j * block + i, e2m1_from_float(mul_rn(xb[i], inverse)));
      }
      return;
    }
    case WireFormat::mxfp4:
      for (int j = 0; j < layout.num_scales; ++j) {
        float const* xb = x + j * block;
        Amax const a = block_amax(xb, block);
        if (a.non_finite) {
          scales[j] = kUe8m0Nan;
          continue;
        }
        uint8_t const byte = ue8m0_from_float_ceil(mxfp4_scale_target(a.amax));
        scales[j] = byte;
        float const inverse = ue8m0_inverse(byte);
        for (int i = 0; i < block; ++i) set_e2m1(payload, j * block + i, e2m1_from_float(mul_rn(xb[i], inverse)));
      }
      return;
  }
  FERRY_THROW(ConfigError, "config", "unknown wire format ", static_cast<int>(format));
}

}  // namespace

void quantize_row(WireFormat format, float const* x, int hidden, uint8_t* wire) {
  quantize_values(format, x, hidden, wire);
}

void quantize_row(WireFormat format, uint16_t const* x_bf16, int hidden, uint8_t* wire) {
  wire_row_layout(format, hidden);  // validates hidden before it sizes the buffer
  std::vector<float> values(static_cast<std::size_t>(hidden));
  for (int i = 0; i < hidden; ++i) values[i] = bf16_to_float(x_bf16[i]);
  quantize_values(format, values.data(), hidden, wire);
}

void dequantize_row(WireFormat format, uint8_t const* wire, int hidden, float* y) {
  WireRowLayout const layout = wire_row_layout(format, hidden);
  uint8_t const* const payload = wire;
  uint8_t const* const scales = wire + layout.scales_offset;
  int const block = layout.block_elems;
  switch (format) {
    case WireFormat::bf16:
      for (int i = 0; i < hidden; ++i) {
        uint16_t value;
        std::memcpy(&value, payload + 2 * i, sizeof value);
        y[i] = bf16_to_float(value);
      }
      return;
    case WireFormat::fp8_e4m3:
      for (int i = 0; i < hidden; ++i) y[i] = mul_rn(e4m3_to_float(payload[i]), load_f32(scales + 4 * (i / block)));
      return;
    case WireFormat::fp8_e4m3_ue8m0:
      for (int i = 0; i < hidden; ++i) y[i] = mul_rn(e4m3_to_float(payload[i]), ue8m0_value(scales[i / block]));
      return;
    case WireFormat::nvfp4: {
      float const token_scale = load_f32(wire + layout.token_scale_offset);
      for (int i = 0; i < hidden; ++i) {
        float const scale = nvfp4_effective_scale(e4m3_to_float(scales[i / block]), token_scale);
        y[i] = mul_rn(e2m1_to_float(get_e2m1(payload, i)), scale);
      }
      return;
    }
    case WireFormat::mxfp4:
      for (int i = 0; i < hidden; ++i)
        y[i] = mul_rn(e2m1_to_float(get_e2m1(payload, i)), ue8m0_value(scales[i / block]));
      return;
  }
  FERRY_THROW(ConfigError, "config", "unknown wire format ", static_cast<int>(format));
}

void dequantize_row(WireFormat format, uint8_t const* wire, int hidden, uint16_t* y_bf16) {
  wire_row_layout(format, hidden);
  std::vector<float> values(static_cast<std::size_t>(hidden));
  dequantize_row(format, wire, hidden, values.data());
  for (int i = 0; i < hidden; ++i) y_bf16[i] = bf16_from_float(values[i]);
}

// ---- receiver scale tensors
// ------------------------------------------------------------------------------------------

void write_scale_tensor(WireFormat format, ScaleLayout layout, uint8_t const* wire, std::size_t wire_stride, int rows,
                        int hidden, void* out) {
  std::size_t const bytes = ferry::scale_tensor_bytes(format, layout, rows, hidden);
  WireRowLayout const row_layout = wire_row_layout(format, hidden);
  auto* const dst = static_cast<uint8_t*>(out);
  std::memset(dst, 0, bytes);
  for (int r = 0; r < rows; ++r) {
    uint8_t const* const scales = wire + static_cast<std::size_t>(r) * wire_stride + row_layout.scales_offset;
    for (int j = 0; j < row_layout.num_scales; ++j) {
      std::size_t const offset = wire::scale_offset(format, layout, static_cast<std::size_t>(rows), hidden,
                                                     static_cast<std::size_t>(r), static_cast<std::size_t>(j));
      std::memcpy(dst + offset, scales + static_cast<std::size_t>(j) * row_layout.scale_bytes,
                  static_cast<std::size_t>(row_layout.scale_bytes));
    }
  }
}

void write_token_scales(WireFormat format, uint8_t const* wire, std::size_t wire_stride, int rows, int hidden,
                        float* out) {
  WireRowLayout const layout = wire_row_layout(format, hidden);
  FERRY_CHECK_CONFIG(layout.has_token_scale, "wire format ", wire_format_name(format),
                     " has no per-token scale; only nvfp4 does");
  FERRY_CHECK_INPUT(rows >= 0, "rows=", rows, " is negative");
  for (int r = 0; r < rows; ++r)
    out[r] = load_f32(wire + static_cast<std::size_t>(r) * wire_stride + layout.token_scale_offset);
}

// ---- error bounds
// ---------------------------------------------------------------------------------------------------- Every constant
// is derived in docs/quant.md ("Error bounds"); eps = 2^-24 is fp32's unit roundoff, 1/(2^p + 1) the largest relative
// error of rounding to nearest with p significant bits (1/17 for e4m3, 1/5 for e2m1, 1/257 for bf16).

namespace {
constexpr double kBf16Rel = 1.0 / 257.0;
constexpr double kBf16Denormal = 0x1p-134;  // half the spacing of bf16 denormals

ErrorBound f32_bound(WireFormat format) {
  ErrorBound bound;
  switch (format) {
    case WireFormat::bf16:
      bound.rel = kBf16Rel;
      bound.floor = kBf16Denormal;
      return bound;
    case WireFormat::fp8_e4m3:
      bound.rel = 1.0 / 17.0 + 0x1p-22;
      bound.block = 0x1p-10 / 448.0 * (1.0 + 0x1p-22);
      bound.floor = 0x1p-136 * (1.0 + 0x1p-23) + 0x1p-149;
      return bound;
    case WireFormat::fp8_e4m3_ue8m0:
      bound.rel = 1.0 / 17.0;
      bound.block = 0x1p-9 / 448.0 * (1.0 + 0x1p-23);
      bound.floor = 0x1p-135;
      return bound;
    case WireFormat::nvfp4:
      bound.rel = 1.0 / 5.0 + 0x1p-22;
      bound.block = 3.0 / 68.0 * (1.0 + 0x1p-22);
      bound.row = 25.0 * 0x1p-12 / 2688.0 * (1.0 + 0x1p-16);
      bound.floor = 25.0 * 0x1p-129 * (1.0 + 0x1p-16) + 0x1p-149;
      return bound;
    case WireFormat::mxfp4:
      bound.rel = 1.0 / 5.0;
      bound.block = 1.0 / 12.0 * (1.0 + 0x1p-23);
      bound.floor = 0x1p-127;
      return bound;
  }
  FERRY_THROW(ConfigError, "config", "unknown wire format ", static_cast<int>(format));
}
}  // namespace

ErrorBound quant_error_bound(WireFormat format, DequantTo to) {
  ErrorBound const f32 = f32_bound(format);
  // bf16 -> bf16 is a copy: no second rounding.
  if (to == DequantTo::f32 || format == WireFormat::bf16) return f32;
  // One more rounding, of d = dequantized fp32 with |d| <= |x| + e: |bf16(d) - d| <= |d| / 257 + 2^-134.
  ErrorBound bound;
  bound.rel = f32.rel * (1.0 + kBf16Rel) + kBf16Rel;
  bound.block = f32.block * (1.0 + kBf16Rel);
  bound.row = f32.row * (1.0 + kBf16Rel);
  bound.floor = f32.floor * (1.0 + kBf16Rel) + kBf16Denormal;
  return bound;
}

ErrorBound combine_error_bound(WireFormat format, int num_terms) {
  FERRY_CHECK_INPUT(num_terms >= 1, "num_terms=", num_terms, " must be at least 1");
  ErrorBound const term = f32_bound(format);
  // fp32 summation of N terms in any order: |fl(sum d) - sum d| <= gamma_{N-1} sum |d_i|; then one bf16 rounding.
  double const eps = 0x1p-24;
  double const n1 = static_cast<double>(num_terms - 1);
  double const gamma = n1 * eps / (1.0 - n1 * eps);
  double const k = gamma + (1.0 + gamma) * kBf16Rel;
  ErrorBound bound;
  bound.rel = term.rel * (1.0 + k) + k;
  bound.block = term.block * (1.0 + k);
  bound.row = term.row * (1.0 + k);
  bound.floor = static_cast<double>(num_terms) * term.floor * (1.0 + k) + kBf16Denormal;
  return bound;
}

CombineRowError measure_combine_row(WireFormat format, int hidden, uint16_t const* const* terms, int num_terms,
                                    uint16_t const* y) {
  ErrorBound const bound = combine_error_bound(format, num_terms);
  int const block = wire_block_elems(format);
  auto const value = [](uint16_t bits) { return static_cast<double>(bf16_to_float(bits)); };
  std::vector<double> row_amax(static_cast<std::size_t>(num_terms), 0.0);
  for (int i = 0; i < num_terms; ++i)
    for (int h = 0; h < hidden; ++h) row_amax[i] = std::max(row_amax[i], std::fabs(value(terms[i][h])));
  CombineRowError out;
  for (int h = 0; h < hidden; ++h) {
    double exact = 0, abs_sum = 0, block_sum = 0, row_sum = 0;
    for (int i = 0; i < num_terms; ++i) {
      double const v = value(terms[i][h]);
      exact += v;
      abs_sum += std::fabs(v);
      double block_amax = 0;
      for (int b = h / block * block; b < (h / block + 1) * block; ++b)
        block_amax = std::max(block_amax, std::fabs(value(terms[i][b])));
      block_sum += block_amax;
      row_sum += row_amax[i];
    }
    double const got = value(y[h]);
    double const error = std::fabs(got - exact);
    double const limit = bound.at(abs_sum, block_sum, row_sum);
    if (limit > 0) out.worst_ratio = std::max(out.worst_ratio, error / limit);
    if (!(error <= limit) && out.first_over < 0) {
      out.first_over = h;
      out.over_y = got, out.over_exact = exact, out.over_error = error, out.over_bound = limit;
    }
    out.error_sq += error * error;
    out.exact_sq += exact * exact;
  }
  return out;
}

}  // namespace ferry::wire
