// Lane-level pieces of the device codecs, for kernels that move the pieces of a wire row to different places (the
// payload into one buffer, the block scales into a tensor of the receiver's layout, the nvfp4 token scale into a
// third) or that produce and consume rows on the fly (combine reduces its partial row as it quantizes it). The rules
// are rules.hpp's and the arithmetic is device_codec.cuh's, operation for operation, so the bytes and values equal
// quantize_row_warp / dequantize_row_warp and the host codecs (tests/gpu/test_quant_device.cu).
//
// Work split: a row is cut into units of kUnitElems consecutive elements; lane l of a warp takes units l, l + 32, ...
// A unit's payload is one store: 16 bytes (fp8 x 16 elements, e2m1 x 32) or 8 bytes (e2m1 x 16). A unit holds one or
// two whole scale blocks (fp4), or a scale block spans kLanesPerBlock consecutive lanes (fp8: 8 lanes of 16), which
// reduce its amax with shuffles; the block's first lane (the leader) stores its scale(s).
#pragma once

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "wire/device_codec.cuh"

namespace ferry::device {

template <WireFormat kFormat, int kUnitElems>
struct UnitCodec {
  static constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  static_assert(kFormat != WireFormat::bf16, "UnitCodec is for the quantized formats (bf16 rows are copied)");
  static_assert(kUnitElems == 16 || kUnitElems == 32, "a unit is 16 or 32 elements (two or four bf16 vectors)");
  static_assert(kUnitElems % kTraits.block_elems == 0 || kTraits.block_elems % kUnitElems == 0,
                "a unit holds whole scale blocks or a scale block holds whole units");
  // Payload bytes of one unit.
  static constexpr int kPieceBytes = kUnitElems * kTraits.bits_per_elem / 8;
  static_assert(kPieceBytes == 8 || kPieceBytes == 16, "a unit's payload is one 8- or 16-byte store");
  // Elements of one scale block inside one unit, scale blocks per unit, lanes per scale block.
  static constexpr int kBlockInUnit = kTraits.block_elems < kUnitElems ? kTraits.block_elems : kUnitElems;
  static constexpr int kScalesPerUnit = kUnitElems / kBlockInUnit;
  static constexpr int kLanesPerBlock = kTraits.block_elems / kBlockInUnit;
  static_assert(kLanesPerBlock <= wire_detail::kWarpSize, "a scale block must fit in one warp step");
  // Bytes of scale a leader lane stores for its unit (its blocks' scales are consecutive in every row-major place).
  static constexpr int kScaleStoreBytes = kScalesPerUnit * kTraits.scale_bytes;
  static_assert(kScaleStoreBytes == 1 || kScaleStoreBytes == 2 || kScaleStoreBytes == 4,
                "a unit's scales are one 1-, 2- or 4-byte store");
  // 16-byte bf16 vectors of one unit.
  static constexpr int kVecs = kUnitElems / 8;

  // The first scale block of unit u.
  __device__ static std::size_t block_of(std::size_t unit) { return unit * kUnitElems / kTraits.block_elems; }
  // Whether this lane stores the scales of its unit.
  __device__ static bool leader(int lane) { return lane % kLanesPerBlock == 0; }

  // Largest |x| over the finite elements of a unit (a lane's share of a row amax).
  __device__ static float finite_amax(float const (&x)[kUnitElems]) {
    bool all_finite;
    return wire_detail::finite_amax<kUnitElems>(x, all_finite);
  }

  // nvfp4: the per-token scale from a row amax that every lane holds its share of (reduced over the warp here).
  __device__ static float token_scale_from_lane_amax(float lane_amax) {
    return wire::nvfp4_token_scale(wire_detail::group_max<wire_detail::kWarpSize>(lane_amax));
  }

  // Quantizes one unit: its payload bytes into payload (kPieceBytes, low word first, element 0 in the lowest byte /
  // nibble) and its scale element(s) into scales (kScaleStoreBytes, the first block in the low bytes; fp8_e4m3: the
  // fp32 bits). Every lane of the warp must call it (the block reductions are shuffles); a lane without a unit passes
  // zeros and stores nothing. token_scale: nvfp4's per-token scale (unused otherwise).
  __device__ static void quantize(float const (&x)[kUnitElems], float token_scale, uint32_t (&payload)[4],
                                  uint32_t& scales) {
    using namespace wire_detail;
    payload[0] = payload[1] = payload[2] = payload[3] = 0;
    scales = 0;
    if constexpr (kFormat == WireFormat::fp8_e4m3 || kFormat == WireFormat::fp8_e4m3_ue8m0) {
      // non-finite elements become e4m3's NaN in e4m3_codes; they are left out of the amax
      bool all_finite;
      float const amax = group_max<kLanesPerBlock>(wire_detail::finite_amax<kUnitElems>(x, all_finite));
      if constexpr (kFormat == WireFormat::fp8_e4m3) {
        float const scale = wire::fp8_scale(amax);
        scales = __float_as_uint(scale);
        e4m3_codes<kUnitElems>(x, wire::div_rn(1.0f, scale), all_finite, payload);
      } else {
        uint8_t const byte =
            __nv_cvt_float_to_e8m0(wire::fp8_ue8m0_scale_target(amax), __NV_SATFINITE, cudaRoundPosInf);
        scales = byte;
        e4m3_codes<kUnitElems>(x, wire::ue8m0_inverse(byte), all_finite, payload);
      }
    } else {
#pragma unroll
      for (int b = 0; b < kScalesPerUnit; ++b) {
        bool all_finite;
        float const amax =
            group_max<kLanesPerBlock>(wire_detail::finite_amax<kBlockInUnit>(x + b * kBlockInUnit, all_finite));
        int const non_finite = group_any<kLanesPerBlock>(all_finite ? 0 : 1);
        // e2m1 has no NaN: a block with a non-finite element gets a NaN scale and zero codes
        uint32_t byte = kFormat == WireFormat::nvfp4 ? wire::kE4m3Nan : wire::kUe8m0Nan;
        if (!non_finite) {
          float inverse = 0.0f;
          bool zeros = false;
          if constexpr (kFormat == WireFormat::nvfp4) {
            byte = __nv_cvt_float_to_fp8(wire::nvfp4_block_scale_target(amax, token_scale), __NV_SATFINITE, __NV_E4M3);
            float const block_scale = e4m3_value(static_cast<uint8_t>(byte));
            zeros = block_scale == 0.0f;
            if (!zeros) inverse = wire::div_rn(1.0f, wire::nvfp4_effective_scale(block_scale, token_scale));
          } else {
            byte = __nv_cvt_float_to_e8m0(wire::mxfp4_scale_target(amax), __NV_SATFINITE, cudaRoundPosInf);
            inverse = wire::ue8m0_inverse(static_cast<uint8_t>(byte));
          }
#pragma unroll
          for (int k = 0; k < kBlockInUnit / 2; ++k) {
            float const a = x[b * kBlockInUnit + 2 * k], c = x[b * kBlockInUnit + 2 * k + 1];
            uint32_t pair;
            if (zeros) {
              pair = static_cast<uint32_t>(wire::e2m1_signed_zero(a)) |
                     (static_cast<uint32_t>(wire::e2m1_signed_zero(c)) << 4);
            } else {
              pair = wire_detail::e2m1_pair(wire::mul_rn(a, inverse), wire::mul_rn(c, inverse));
            }
            int const byte_idx = b * kBlockInUnit / 2 + k;
            payload[byte_idx / 4] |= (pair & 0xFFu) << (8 * (byte_idx % 4));
          }
        }
        scales |= byte << (8 * b);
      }
    }
  }

  // Dequantizes one unit to fp32: y = code * scale as one fp32 product (nvfp4: code * (block scale * token scale)),
  // exactly as dequantize_row_warp. payload / scales as quantize() produces them.
  __device__ static void dequantize(uint32_t const (&payload)[4], uint32_t scales, float token_scale,
                                    float (&y)[kUnitElems]) {
    // a unit's blocks: one (fp8: part of a block) or two (e2m1 x 16 each, the second block's codes from word 2)
    constexpr int kWordsPerBlock = kBlockInUnit * kTraits.bits_per_elem / 32;
#pragma unroll
    for (int b = 0; b < kScalesPerUnit; ++b) {
      uint32_t const scale = kTraits.scale_bytes == 4 ? scales : (scales >> (8 * b)) & 0xFFu;
      wire_detail::scale_codes<kFormat, kBlockInUnit>(payload + b * kWordsPerBlock,
                                                       wire_detail::block_multiplier<kFormat>(scale, token_scale),
                                                       y + b * kBlockInUnit);
    }
  }

  // A unit's payload to dst (kPieceBytes, aligned to them; local or a peer's memory).
  __device__ static void store_piece(void* dst, uint32_t const (&payload)[4]) {
    if constexpr (kPieceBytes == 16)
      arch::store_na_v4(static_cast<int4*>(dst), make_int4(static_cast<int>(payload[0]), static_cast<int>(payload[1]),
                                                           static_cast<int>(payload[2]), static_cast<int>(payload[3])));
    else
      *static_cast<uint2*>(dst) = make_uint2(payload[0], payload[1]);
  }

  // A unit's payload from src: kNcSource for the caller's input (read-only during the kernel), otherwise a coherent
  // load (data a peer published before a signal this CTA acquired).
  template <bool kNcSource>
  __device__ static void load_piece(void const* src, uint32_t (&payload)[4]) {
    payload[0] = payload[1] = payload[2] = payload[3] = 0;
    if constexpr (kPieceBytes == 16) {
      int4 const v =
          kNcSource ? arch::load_nc_v4(static_cast<int4 const*>(src)) : arch::load_v4(static_cast<int4 const*>(src));
      payload[0] = static_cast<uint32_t>(v.x), payload[1] = static_cast<uint32_t>(v.y);
      payload[2] = static_cast<uint32_t>(v.z), payload[3] = static_cast<uint32_t>(v.w);
    } else {
      uint2 const v = *static_cast<uint2 const*>(src);  // plain (coherent) load: no __restrict__, no __ldg
      payload[0] = v.x, payload[1] = v.y;
    }
  }

  // A unit's scales (kScaleStoreBytes) to dst, aligned to them.
  __device__ static void store_scales(void* dst, uint32_t scales) {
    if constexpr (kScaleStoreBytes == 4)
      *static_cast<uint32_t*>(dst) = scales;
    else if constexpr (kScaleStoreBytes == 2)
      *static_cast<uint16_t*>(dst) = static_cast<uint16_t>(scales);
    else
      *static_cast<uint8_t*>(dst) = static_cast<uint8_t>(scales);
  }

  // A unit's scales from src. Byte by byte for one-byte scales, so src needs no alignment beyond the element's
  // (pre-quantized inputs are row-major [rows][num_scales]); volatile: never the non-coherent path.
  __device__ static uint32_t load_scales(void const* src) {
    if constexpr (kTraits.scale_bytes == 4) {
      return *static_cast<uint32_t const volatile*>(src);
    } else {
      auto const* bytes = static_cast<uint8_t const volatile*>(src);
      uint32_t scales = 0;
#pragma unroll
      for (int b = 0; b < kScaleStoreBytes; ++b) scales |= static_cast<uint32_t>(bytes[b]) << (8 * b);
      return scales;
    }
  }

  // The bf16 vectors of units base + f * 32 + lane (f < kInFlight) of a row, zeros for units at or past end (not
  // loaded). row: read-only for the kernel's lifetime (non-coherent loads).
  template <int kInFlight>
  __device__ static void load_units(int4 const* row, int base, int end, int lane, int4 (&raw)[kInFlight][kVecs]) {
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const u = base + f * 32 + lane;
#pragma unroll
      for (int i = 0; i < kVecs; ++i)
        raw[f][i] = u < end ? arch::load_nc_v4(row + static_cast<std::size_t>(u) * kVecs + i) : make_int4(0, 0, 0, 0);
    }
  }

  // kVecs 16-byte bf16 vectors of a unit -> fp32 (exact).
  __device__ static void unpack_bf16(int4 const (&raw)[kVecs], float (&x)[kUnitElems]) {
#pragma unroll
    for (int v = 0; v < kVecs; ++v) {
      float part[8];
      wire_detail::unpack<__nv_bfloat16>(raw[v], part);
#pragma unroll
      for (int i = 0; i < 8; ++i) x[8 * v + i] = part[i];
    }
  }
};

// The scales of a warp's walk along a row, gathered across its steps where a scale block spans several lanes (fp8: 8
// lanes of 16 elements, so a step's leaders hold 4 scales per unit group): lane L keeps the scale of block first + L,
// and a full window of 32 blocks goes out as one warp store of 32 consecutive scales (128 bytes of fp32 scales), where
// the leaders stored 4 scales apiece every step (16-byte writes, each a separate NVLink packet to a peer).
// kInFlight: units per lane per step (the walk's units of a step are base + f * 32 + lane, f < kInFlight).
template <class Codec, int kInFlight>
struct ScaleWindow {
  static_assert(Codec::kScalesPerUnit == 1 && Codec::kLanesPerBlock > 1, "for blocks that span several lanes");
  static constexpr int kBlocksPerGroup = wire_detail::kWarpSize / Codec::kLanesPerBlock;  // per f of a step
  static constexpr int kBlocksPerStep = kInFlight * kBlocksPerGroup;
  static_assert(wire_detail::kWarpSize % kBlocksPerStep == 0, "a window is whole steps");

  std::size_t first;   // the block of lane 0's scale
  uint32_t value = 0;  // this lane's scale (block first + lane)

  __device__ explicit ScaleWindow(std::size_t first_block) : first(first_block) {}

  // Takes the scales of the step whose first unit is `base` (scales[f]: the leaders' scales of units base + f * 32 +
  // lane); every lane must call it (shuffles). Returns whether the window is full: the caller flushes, then next().
  __device__ bool take(std::size_t base, uint32_t const (&scales)[kInFlight], int lane) {
    std::size_t const step_first = Codec::block_of(base);
    int const rel = lane - static_cast<int>(step_first - first);  // this lane's block relative to the step's first
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const idx = rel - f * kBlocksPerGroup;
      uint32_t const got = __shfl_sync(0xffffffffu, scales[f], (idx & (kBlocksPerGroup - 1)) * Codec::kLanesPerBlock);
      if (idx >= 0 && idx < kBlocksPerGroup) value = got;
    }
    return step_first + kBlocksPerStep - first == static_cast<std::size_t>(wire_detail::kWarpSize);
  }
  // store(block, scale) for this lane's block if it is below end_block (the walk's end).
  template <typename Store>
  __device__ void flush(std::size_t end_block, int lane, Store&& store) const {
    if (first + lane < end_block) store(first + lane, value);
  }
  __device__ void next() {
    first += wire_detail::kWarpSize;
  }
};
// Where a unit holds whole blocks (fp4) the leaders' stores of a step are already one contiguous warp store.
struct NoScaleWindow {
  __device__ explicit NoScaleWindow(std::size_t) {}
};
template <class Codec, int kInFlight>
using ScaleWindowFor = std::conditional_t<(Codec::kLanesPerBlock > 1), ScaleWindow<Codec, kInFlight>, NoScaleWindow>;

// The unit size kernels use for a format and hidden: 16-byte payload stores where the row allows it (fp8 x 16,
// e2m1 x 32), else 8 bytes (nvfp4 with hidden not a multiple of 32).
__host__ __device__ constexpr int unit_elems_for(WireFormat format, int hidden) {
  switch (format) {
    case WireFormat::fp8_e4m3:
    case WireFormat::fp8_e4m3_ue8m0:
      return 16;
    case WireFormat::nvfp4:
      return hidden % 32 == 0 ? 32 : 16;
    case WireFormat::mxfp4:
      return 32;
    default:
      return 0;
  }
}

}  // namespace ferry::device
