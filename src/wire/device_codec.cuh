// Device codecs of the wire formats, the functions the dispatch and combine kernels call: one warp quantizes a row
// into its wire layout, or dequantizes a wire row, with 16-byte vector loads and CUDA's conversion intrinsics
// (cuda_fp8.h, cuda_fp4.h, cuda_bf16.h). The scale rules are rules.hpp's, shared with the host codecs, so the bytes
// and values equal host_codec.cpp's (tests/gpu/test_quant_device.cu). docs/quant.md specifies formats and rules.
//
// Work split: lane l takes the 16-byte vectors l, l + 32, ... of the row (8 bf16 or 4 fp32 elements each). A scale
// block spans kGroup consecutive lanes (block elements / vector elements: 2 to 32), which reduce its amax with
// shuffles; the block's first lane writes the scale. nvfp4 reads the row twice: the per-token scale (from the row's
// amax) enters every block scale.
//
// Build without -ftz=true (--use_fast_math sets it): flushing denormal inputs to zero would change the codes of
// denormal elements (bf16 denormals times a 2^126 inverse scale are ordinary e4m3 values), and the host does not flush.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp4.h>
#include <cuda_fp8.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "comm/device/arch_sm90.cuh"
#include "wire/layout.hpp"
#include "wire/rules.hpp"

namespace ferry::device {

namespace wire_detail {

inline constexpr int kWarpSize = 32;
inline constexpr unsigned kFullWarp = 0xFFFFFFFFu;

// Elements of T in one 16-byte vector.
template <typename T>
inline constexpr int kVecElems = 16 / static_cast<int>(sizeof(T));

template <typename T>
inline constexpr bool kSupportedElem = std::is_same_v<T, float> || std::is_same_v<T, __nv_bfloat16>;

template <bool kNcSource>
__device__ __forceinline__ int4 load_vec(int4 const* ptr) {
  if constexpr (kNcSource)
    return arch::load_nc_v4(ptr);
  else
    return arch::load_v4(ptr);
}

// 16 bytes of T -> fp32 (exact). bf16 element 2w is the low half of word w.
template <typename T>
__device__ __forceinline__ void unpack(int4 raw, float (&x)[kVecElems<T>]) {
  uint32_t const words[4] = {static_cast<uint32_t>(raw.x), static_cast<uint32_t>(raw.y), static_cast<uint32_t>(raw.z),
                             static_cast<uint32_t>(raw.w)};
  if constexpr (std::is_same_v<T, float>) {
#pragma unroll
    for (int i = 0; i < 4; ++i) x[i] = __uint_as_float(words[i]);
  } else {
#pragma unroll
    for (int w = 0; w < 4; ++w) {
      x[2 * w] = __uint_as_float(words[w] << 16);
      x[2 * w + 1] = __uint_as_float(words[w] & 0xFFFF0000u);
    }
  }
}

// max(m, |x|) with a NaN propagated (PTX max.NaN, sm_80 and later): over a set of values, a finite result is their
// amax and says that every value was finite (an Inf is its own max, a NaN wins).
__device__ __forceinline__ float max_abs_nan(float m, float x) {
  float r;
  asm("max.NaN.f32 %0, %1, %2;" : "=f"(r) : "f"(m), "f"(fabsf(x)));
  return r;
}

// The largest |x| over the finite elements of x[0, kN), and whether all of them are finite (non-finite elements stay
// out of a block's amax: e4m3 codes them NaN, an e2m1 block gets a NaN scale). One max per element; the test of each
// element runs only for a set that holds an Inf or a NaN, where a test and a select per element ran for every set.
template <int kN>
__device__ __forceinline__ float finite_amax(float const* x, bool& all_finite) {
  float m = 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i) m = max_abs_nan(m, x[i]);
  all_finite = wire::is_finite(m);
  if (all_finite) return m;
  float amax = 0.0f;
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (wire::is_finite(x[i])) amax = fmaxf(amax, wire::abs_value(x[i]));
  return amax;
}

// Max over the kGroup consecutive lanes of an aligned lane group (exact, order-free: values are finite and >= 0).
template <int kGroup>
__device__ __forceinline__ float group_max(float value) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2)
    value = fmaxf(value, __shfl_xor_sync(kFullWarp, value, offset));
  return value;
}

template <int kGroup>
__device__ __forceinline__ int group_any(int flag) {
#pragma unroll
  for (int offset = kGroup / 2; offset > 0; offset /= 2) flag |= __shfl_xor_sync(kFullWarp, flag, offset);
  return flag;
}

// Stores kBytes (2, 4, 8 or 16; ptr aligned to them) taken from the low bytes of words.
template <int kBytes>
__device__ __forceinline__ void store_bytes(uint8_t* ptr, uint32_t const (&words)[4]) {
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "payload pieces are 2, 4, 8 or 16 bytes");
  if constexpr (kBytes == 16)
    *reinterpret_cast<uint4*>(ptr) = make_uint4(words[0], words[1], words[2], words[3]);
  else if constexpr (kBytes == 8)
    *reinterpret_cast<uint2*>(ptr) = make_uint2(words[0], words[1]);
  else if constexpr (kBytes == 4)
    *reinterpret_cast<uint32_t*>(ptr) = words[0];
  else
    *reinterpret_cast<uint16_t*>(ptr) = static_cast<uint16_t>(words[0]);
}

template <int kBytes>
__device__ __forceinline__ void load_bytes(uint8_t const* ptr, uint32_t (&words)[4]) {
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16, "payload pieces are 2, 4, 8 or 16 bytes");
  words[0] = words[1] = words[2] = words[3] = 0;
  if constexpr (kBytes == 16) {
    uint4 const v = *reinterpret_cast<uint4 const*>(ptr);
    words[0] = v.x, words[1] = v.y, words[2] = v.z, words[3] = v.w;
  } else if constexpr (kBytes == 8) {
    uint2 const v = *reinterpret_cast<uint2 const*>(ptr);
    words[0] = v.x, words[1] = v.y;
  } else if constexpr (kBytes == 4) {
    words[0] = *reinterpret_cast<uint32_t const*>(ptr);
  } else {
    words[0] = *reinterpret_cast<uint16_t const*>(ptr);
  }
}

__device__ __forceinline__ float e4m3_value(uint8_t code) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(code, __NV_E4M3)));
}

// e4m3 codes of x * inverse, element i in byte i; non-finite x become e4m3's NaN (0x7F). all_finite: x holds no Inf
// or NaN (finite_amax says so), and the codes need no test per element.
template <int kN>
__device__ __forceinline__ void e4m3_codes(float const (&x)[kN], float inverse, bool all_finite, uint32_t (&words)[4]) {
  static_assert(kN % 4 == 0, "whole 32-bit words of codes");
#pragma unroll
  for (int w = 0; w < kN / 4; ++w) {
    uint32_t word = 0;
#pragma unroll
    for (int k = 0; k < 2; ++k) {
      float const a = x[4 * w + 2 * k], b = x[4 * w + 2 * k + 1];
      uint32_t const pair = __nv_cvt_float2_to_fp8x2(make_float2(wire::mul_rn(a, inverse), wire::mul_rn(b, inverse)),
                                                     __NV_SATFINITE, __NV_E4M3);
      word |= pair << (16 * k);
    }
    words[w] = word;
  }
  if (all_finite) return;
#pragma unroll
  for (int i = 0; i < kN; ++i)
    if (!wire::is_finite(x[i]))
      words[i / 4] =
          (words[i / 4] & ~(0xFFu << (8 * (i % 4)))) | (static_cast<uint32_t>(wire::kE4m3Nan) << (8 * (i % 4)));
}

// ---- e2m1 conversions
// sm_100 and later convert in hardware. sm_90 has no fp4 instruction: cuda_fp4.hpp emulates it (encode through
// double, decode through fp6), tens of instructions per element (docs/design-notes.md, "The e2m1 conversions", has
// what that cost). On sm_90 the encode is the same conversion (round to nearest even, saturating at +-6, a zero result
// keeps the sign) in one fp32 addition and a few integer operations (wire::e2m1_code_not_nan, equal to
// wire::e2m1_from_float on every fp32 but NaN, itself bit-exact with cuda_fp4.h; the device tests compare every row).
// The quantizers call it with x = element * inverse scale of a block whose elements are all finite (a block with an Inf
// or a NaN gets a NaN scale and zero codes), so x is never NaN and the NaN test (NaN -> +6) is left out.
__device__ __forceinline__ uint32_t e2m1_code_not_nan(float x) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 1000
  return static_cast<uint32_t>(__nv_cvt_float_to_fp4(x, __NV_E2M1, cudaRoundNearest)) & 0xFu;
#else
  return wire::e2m1_code_not_nan(x);
#endif
}

// Two elements (not NaN) into one byte, lo in the low nibble.
__device__ __forceinline__ uint32_t e2m1_pair(float lo, float hi) {
  return e2m1_code_not_nan(lo) | (e2m1_code_not_nan(hi) << 4);
}

// Both values of a byte of e2m1 codes (low nibble first), exact. A code's magnitude bits (e e m) placed at bits 11..9
// of an fp16 are its exponent field's low bits and its mantissa's top bit, so that fp16 is the code's value times
// 2^-14 (code 1, 0.5, is the fp16 denormal 2^-15), and one fp16x2 product by 2^14 gives both values: eight
// operations for the pair (two are the fp16 -> fp32 conversions), where a select chain took about twelve per nibble.
__device__ __forceinline__ float2 e2m1_pair_values(uint32_t byte) {
  uint32_t const spread = (byte & 0xFFu) * 0x00200200u;  // byte << 9 | byte << 21: low nibble at 9, high at 21
  uint32_t const bits =
      (spread & 0x0E000E00u) | ((spread << 3) & 0x80008000u);  // magnitudes at 9 / 25, signs at 15 / 31
  __half2 codes;
  static_assert(sizeof codes == sizeof bits, "an fp16x2 is one 32-bit word");
  memcpy(&codes, &bits, sizeof bits);  // the low half is .x
  return __half22float2(__hmul2(codes, __float2half2_rn(16384.0f)));
}

// Codes 2k and 2k + 1 of a payload held as 32-bit words (element 0 in the lowest byte / nibble), exact and unscaled:
// an e4m3 pair is a half word, an e2m1 pair a byte.
template <WireFormat kFormat>
__device__ __forceinline__ float2 code_pair(uint32_t const* words, int k) {
  if constexpr (kFormat == WireFormat::fp8_e4m3 || kFormat == WireFormat::fp8_e4m3_ue8m0) {
    auto const pair = static_cast<__nv_fp8x2_storage_t>(words[k / 2] >> (16 * (k % 2)));
    return __half22float2(__half2(__nv_cvt_fp8x2_to_halfraw2(pair, __NV_E4M3)));
  } else {
    static_assert(kFormat == WireFormat::nvfp4 || kFormat == WireFormat::mxfp4, "a scaled format");
    return e2m1_pair_values(words[k / 4] >> (8 * (k % 4)));
  }
}

// What a block's codes are multiplied by: its scale element (fp8_e4m3: the fp32's bits; the others: the byte), for
// nvfp4 times the row's token scale (one fp32 product, the effective scale quantize divided by).
template <WireFormat kFormat>
__device__ __forceinline__ float block_multiplier(uint32_t scale, float token_scale) {
  if constexpr (kFormat == WireFormat::fp8_e4m3)
    return __uint_as_float(scale);
  else if constexpr (kFormat == WireFormat::nvfp4)
    return wire::nvfp4_effective_scale(e4m3_value(static_cast<uint8_t>(scale)), token_scale);
  else
    return wire::ue8m0_value(static_cast<uint8_t>(scale));
}

// The multiplier (block_multiplier) of the block holding element `elem` of a wire row whose block scales start at
// `scales`; the row must be visible to this thread (plain loads).
template <WireFormat kFormat>
__device__ __forceinline__ float multiplier_at(uint8_t const* scales, std::size_t elem, float token_scale) {
  constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  std::size_t const block = elem / kTraits.block_elems;
  uint32_t const scale =
      kTraits.scale_bytes == 4 ? *reinterpret_cast<uint32_t const*>(scales + 4 * block) : scales[block];
  return block_multiplier<kFormat>(scale, token_scale);
}

// y[i] = code i * multiplier (one fp32 product each) for the kN codes of `words`: the dequantization of every device
// path (dequantize_row_warp, dequantize_vec, UnitCodec::dequantize), equal to the host codec's.
template <WireFormat kFormat, int kN>
__device__ __forceinline__ void scale_codes(uint32_t const* words, float multiplier, float* y) {
  static_assert(kN % 2 == 0, "whole pairs of codes");
#pragma unroll
  for (int k = 0; k < kN / 2; ++k) {
    float2 const q = code_pair<kFormat>(words, k);
    y[2 * k] = wire::mul_rn(q.x, multiplier);
    y[2 * k + 1] = wire::mul_rn(q.y, multiplier);
  }
}

// e2m1 codes of x * inverse, element 2k in the low nibble of byte k.
template <int kN>
__device__ __forceinline__ void e2m1_codes(float const (&x)[kN], float inverse, uint32_t (&words)[4]) {
  static_assert(kN % 2 == 0, "whole bytes of codes");
  words[0] = words[1] = words[2] = words[3] = 0;
#pragma unroll
  for (int k = 0; k < kN / 2; ++k) {
    uint32_t const byte = e2m1_pair(wire::mul_rn(x[2 * k], inverse), wire::mul_rn(x[2 * k + 1], inverse));
    words[k / 4] |= byte << (8 * (k % 4));
  }
}

// Signed zeros (the sign bit of each x), for an nvfp4 block whose scale rounded to zero.
template <int kN>
__device__ __forceinline__ void e2m1_signed_zeros(float const (&x)[kN], uint32_t (&words)[4]) {
  words[0] = words[1] = words[2] = words[3] = 0;
#pragma unroll
  for (int i = 0; i < kN; ++i) words[i / 8] |= static_cast<uint32_t>(wire::e2m1_signed_zero(x[i])) << (4 * (i % 8));
}

__device__ __forceinline__ void zero_range(uint8_t* dst, std::size_t begin, std::size_t end, int lane) {
  for (std::size_t i = begin + lane; i < end; i += kWarpSize) dst[i] = 0;
}

// The largest |x| over the finite elements of a row of num_vecs 16-byte vectors of T, reduced over the warp (every
// lane returns it): nvfp4's per-token scale comes from it. kInFlight vectors per lane are loaded before the
// arithmetic (one at a time, a 7168-wide bf16 row is 28 dependent round trips).
template <typename T, bool kNcSource, int kInFlight>
__device__ __forceinline__ float row_finite_amax_warp(int4 const* in, int num_vecs, int lane) {
  float amax = 0.0f;
  for (int v0 = lane; v0 < num_vecs; v0 += kWarpSize * kInFlight) {
    int4 raw[kInFlight];
#pragma unroll
    for (int i = 0; i < kInFlight; ++i)
      raw[i] = v0 + i * kWarpSize < num_vecs ? load_vec<kNcSource>(in + v0 + i * kWarpSize) : make_int4(0, 0, 0, 0);
#pragma unroll
    for (int i = 0; i < kInFlight; ++i) {
      float x[kVecElems<T>];
      unpack<T>(raw[i], x);
      bool all_finite;
      amax = fmaxf(amax, finite_amax<kVecElems<T>>(x, all_finite));
    }
  }
  return group_max<kWarpSize>(amax);
}

// One vector's step of a scaled format's codec: vector v of a row (elements [v * kVec, (v + 1) * kVec), fp32 values
// x) into the wire row at `row`: its payload piece and, from the first lane of its scale block, the block scale. Every
// lane of the warp calls it (the block amax is reduced over the kGroup lanes that hold the block, lane l holding
// vector base + l for a base that is a multiple of the block's vectors); lanes whose vector is past the row (active
// false) pass zeros and store nothing (a block is all active or all not). token_scale: nvfp4's per-token scale.
template <WireFormat kFormat, int kVec>
__device__ __forceinline__ void quantize_vector_step(float const (&x)[kVec], bool active, int v, int lane, uint8_t* row,
                                                     std::size_t scales_offset, float token_scale) {
  static_assert(kFormat != WireFormat::bf16, "a scaled format; bf16 rows are copied");
  constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  constexpr int kPayloadBytes = kVec * kTraits.bits_per_elem / 8;
  constexpr int kGroup = kTraits.block_elems > kVec ? kTraits.block_elems / kVec : 1;
  static_assert(kTraits.block_elems % kVec == 0, "a 16-byte vector must not straddle two scale blocks");
  static_assert(kGroup <= kWarpSize, "a scale block must fit in one warp step");
  bool all_finite;
  float const amax = group_max<kGroup>(finite_amax<kVec>(x, all_finite));
  int const non_finite = group_any<kGroup>(all_finite ? 0 : 1);
  bool const leader = active && lane % kGroup == 0;
  std::size_t const block = static_cast<std::size_t>(v) * kVec / kTraits.block_elems;
  uint8_t* const scale_ptr = row + scales_offset + block * kTraits.scale_bytes;
  uint32_t words[4] = {0, 0, 0, 0};

  if constexpr (kFormat == WireFormat::fp8_e4m3) {
    float const scale = wire::fp8_scale(amax);
    if (leader) *reinterpret_cast<float*>(scale_ptr) = scale;
    e4m3_codes<kVec>(x, wire::div_rn(1.0f, scale), all_finite, words);
  } else if constexpr (kFormat == WireFormat::fp8_e4m3_ue8m0) {
    uint8_t const byte = __nv_cvt_float_to_e8m0(wire::fp8_ue8m0_scale_target(amax), __NV_SATFINITE, cudaRoundPosInf);
    if (leader) *scale_ptr = byte;
    e4m3_codes<kVec>(x, wire::ue8m0_inverse(byte), all_finite, words);
  } else if constexpr (kFormat == WireFormat::nvfp4) {
    // e2m1 has no NaN: a block with a non-finite element gets a NaN scale and zero codes
    uint8_t byte = wire::kE4m3Nan;
    if (!non_finite) {
      byte = __nv_cvt_float_to_fp8(wire::nvfp4_block_scale_target(amax, token_scale), __NV_SATFINITE, __NV_E4M3);
      float const block_scale = e4m3_value(byte);
      if (block_scale == 0.0f)
        e2m1_signed_zeros<kVec>(x, words);
      else
        e2m1_codes<kVec>(x, wire::div_rn(1.0f, wire::nvfp4_effective_scale(block_scale, token_scale)), words);
    }
    if (leader) *scale_ptr = byte;
  } else if constexpr (kFormat == WireFormat::mxfp4) {
    uint8_t byte = wire::kUe8m0Nan;
    if (!non_finite) {
      byte = __nv_cvt_float_to_e8m0(wire::mxfp4_scale_target(amax), __NV_SATFINITE, cudaRoundPosInf);
      e2m1_codes<kVec>(x, wire::ue8m0_inverse(byte), words);
    }
    if (leader) *scale_ptr = byte;
  }
  if (active) store_bytes<kPayloadBytes>(row + static_cast<std::size_t>(v) * kPayloadBytes, words);
}

}  // namespace wire_detail

// Quantizes one row of `hidden` elements (T = __nv_bfloat16 or float) into its wire layout
// (wire::make_row_layout(kFormat, hidden)), padding bytes included. Every lane of the warp must call it with the same
// arguments. src: 16-byte aligned; dst: 16-byte aligned, row_bytes long, local or a peer's (plain stores); hidden: a
// positive multiple of 8 and of the format's block (validated on the host). kNcSource: src is read-only for the
// kernel's lifetime and may be read through the non-coherent path.
template <WireFormat kFormat, typename T, bool kNcSource = false, int kUnroll = 4>
__device__ __forceinline__ void quantize_row_warp(T const* __restrict__ src, int hidden, uint8_t* __restrict__ dst) {
  using namespace wire_detail;
  static_assert(kSupportedElem<T>, "quantize_row_warp reads rows of __nv_bfloat16 or float");
  constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  constexpr int kVec = kVecElems<T>;
  constexpr int kPayloadBytes = kVec * kTraits.bits_per_elem / 8;  // bf16; quantize_vector_step has its own
  static_assert(kUnroll >= 1, "kUnroll counts the vectors each lane loads before converting");

  int const lane = static_cast<int>(threadIdx.x) % kWarpSize;
  WireRowLayout const layout = wire::make_row_layout(kFormat, hidden);
  int const num_vecs = hidden / kVec;
  auto const* in = reinterpret_cast<int4 const*>(src);

  float token_scale = 0.0f;
  if constexpr (kFormat == WireFormat::nvfp4) {
    // 1. the row's amax over its finite elements, then the per-token scale (lane 0 stores it)
    token_scale = wire::nvfp4_token_scale(row_finite_amax_warp<T, kNcSource, 1>(in, num_vecs, lane));
    if (lane == 0) *reinterpret_cast<float*>(dst + layout.token_scale_offset) = token_scale;
  }

  // 2. kUnroll vectors per lane in flight, then block by block: amax over the group, scale, codes
  for (int base = 0; base < num_vecs; base += kWarpSize * kUnroll) {
    int4 raw[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      int const v = base + u * kWarpSize + lane;
      raw[u] = v < num_vecs ? load_vec<kNcSource>(in + v) : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      // Lanes past the row's end join the shuffles with zeros and store nothing. num_vecs is a multiple of a scale
      // block's vectors, so a block is all in or all out.
      int const v = base + u * kWarpSize + lane;
      bool const active = v < num_vecs;
      float x[kVec];
      unpack<T>(raw[u], x);
      if constexpr (kFormat == WireFormat::bf16) {
        uint32_t words[4] = {0, 0, 0, 0};
        if constexpr (std::is_same_v<T, __nv_bfloat16>) {
          words[0] = raw[u].x, words[1] = raw[u].y, words[2] = raw[u].z, words[3] = raw[u].w;
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i)
            words[i / 2] |= static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(x[i]))) << (16 * (i % 2));
        }
        if (active) store_bytes<kPayloadBytes>(dst + static_cast<std::size_t>(v) * kPayloadBytes, words);
      } else {
        quantize_vector_step<kFormat, kVec>(x, active, v, lane, dst, layout.scales_offset, token_scale);
      }
    }
  }

  // 3. zero the padding so the row's bytes are fully defined
  std::size_t const scales_end =
      layout.scales_offset + static_cast<std::size_t>(layout.num_scales) * static_cast<std::size_t>(layout.scale_bytes);
  zero_range(dst, layout.payload_bytes, layout.scales_offset, lane);
  if (layout.has_token_scale) {
    zero_range(dst, scales_end, layout.token_scale_offset, lane);
    zero_range(dst, layout.token_scale_offset + sizeof(float), layout.row_bytes, lane);
  } else {
    zero_range(dst, scales_end, layout.row_bytes, lane);
  }
}

// Dequantizes one wire row into `hidden` values of T (__nv_bfloat16 or float): y = code * scale as one fp32 product
// (nvfp4: code * (block scale * token scale)), rounded once to bf16 for bf16 output. Every lane of the warp must call
// it with the same arguments. src: 16-byte aligned wire row, already visible to this thread (plain loads); dst:
// 16-byte aligned. kInFlight vectors per lane are loaded (payload pieces and their scales) before the first
// conversion: one at a time, a 7168-wide row took 28 dependent round trips per lane.
template <WireFormat kFormat, typename T, int kInFlight = 4>
__device__ __forceinline__ void dequantize_row_warp(uint8_t const* __restrict__ src, int hidden, T* __restrict__ dst) {
  using namespace wire_detail;
  static_assert(kSupportedElem<T>, "dequantize_row_warp writes rows of __nv_bfloat16 or float");
  constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  constexpr int kVec = kVecElems<T>;
  constexpr int kPayloadBytes = kVec * kTraits.bits_per_elem / 8;

  int const lane = static_cast<int>(threadIdx.x) % kWarpSize;
  WireRowLayout const layout = wire::make_row_layout(kFormat, hidden);
  int const num_vecs = hidden / kVec;
  uint8_t const* const scales = src + layout.scales_offset;
  float token_scale = 0.0f;
  if constexpr (kFormat == WireFormat::nvfp4)
    token_scale = *reinterpret_cast<float const*>(src + layout.token_scale_offset);

  for (int base = lane; base < num_vecs; base += kWarpSize * kInFlight) {
    // 1. the step's payload pieces and block scales (bf16: no scale)
    uint32_t words[kInFlight][4];
    float scale[kInFlight];
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const v = base + f * kWarpSize;
      scale[f] = 0.0f;
      words[f][0] = words[f][1] = words[f][2] = words[f][3] = 0;
      if (v >= num_vecs) continue;
      load_bytes<kPayloadBytes>(src + static_cast<std::size_t>(v) * kPayloadBytes, words[f]);
      if constexpr (kFormat != WireFormat::bf16)
        scale[f] = multiplier_at<kFormat>(scales, static_cast<std::size_t>(v) * kVec, token_scale);
    }
    // 2. codes * scale, stored
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const v = base + f * kWarpSize;
      if (v >= num_vecs) continue;
      uint4* const out = reinterpret_cast<uint4*>(dst) + v;
      if constexpr (kFormat == WireFormat::bf16 && std::is_same_v<T, __nv_bfloat16>) {
        *out = make_uint4(words[f][0], words[f][1], words[f][2], words[f][3]);
      } else {
        float y[kVec];
        if constexpr (kFormat == WireFormat::bf16) {
#pragma unroll
          for (int i = 0; i < kVec; ++i) y[i] = __uint_as_float((words[f][i / 2] >> (16 * (i % 2))) << 16);
        } else {
          scale_codes<kFormat, kVec>(words[f], scale[f], y);
        }
        uint32_t packed[4] = {0, 0, 0, 0};
        if constexpr (std::is_same_v<T, float>) {
#pragma unroll
          for (int i = 0; i < 4; ++i) packed[i] = __float_as_uint(y[i]);
        } else {
#pragma unroll
          for (int i = 0; i < kVec; ++i)
            packed[i / 2] |= static_cast<uint32_t>(__bfloat16_as_ushort(__float2bfloat16_rn(y[i]))) << (16 * (i % 2));
        }
        *out = make_uint4(packed[0], packed[1], packed[2], packed[3]);
      }
    }
  }
}

}  // namespace ferry::device
