// Device pieces of the wire formats that kernels need beside the row codecs of device_codec.cuh:
//  - quantize_vec / dequantize_vec: one 16-byte vector of 8 bf16 elements, for kernels that hold a row chunk in
//    registers (the LL combine computes each partial row chunk by chunk and quantizes it where it is). They are the
//    inner step of quantize_row_warp / dequantize_row_warp, built from the same rules (rules.hpp) and the same
//    conversion helpers (wire_detail), so the bytes and values are the codec's (tests/gpu/test_ll_quant.cpp
//    compares the rows they make with the host codecs).
//  - deliver_scales_warp: a wire row's block scales into a receiver scale tensor (entry offsets from
//    wire::scale_offset, the function the host's scale_byte_offset uses) and its per-token scale.
#pragma once

#include <cstddef>
#include <cstdint>

#include "wire/device_codec.cuh"
#include "wire/layout.hpp"
#include "wire/rules.hpp"

namespace ferry::device {

// Elements of one bf16 vector (16 bytes).
inline constexpr int kBf16VecElems = 8;

// Quantizes vector v of a row (elements [8v, 8v + 8), as fp32 values x of bf16 numbers) into the wire row at `row`:
// its payload piece and, from the first lane of its scale block, the block scale. Every lane of the warp must call it
// (the block amax is reduced over the lanes that hold the block), with lane l holding vector base + l for a base that
// is a multiple of the block's vectors; lanes whose vector is past the row (active false) pass zeros and store
// nothing (a block is all active or all not). token_scale: nvfp4's per-token scale (ignored otherwise). Padding
// bytes of the row are not written. kFormat: a scaled format.
template <WireFormat kFormat>
__device__ __forceinline__ void quantize_vec(float const (&x)[kBf16VecElems], bool active, int v, uint8_t* row,
                                             std::size_t scales_offset, float token_scale) {
  static_assert(kFormat != WireFormat::bf16, "quantize_vec is for the scaled formats; bf16 is a copy");
  wire_detail::quantize_vector_step<kFormat, kBf16VecElems>(
      x, active, v, static_cast<int>(threadIdx.x) % wire_detail::kWarpSize, row, scales_offset, token_scale);
}

// Vector v of the wire row at `row` (elements [8v, 8v + 8)) as fp32: y = code * scale, one fp32 product (nvfp4: code
// * (block scale * token scale), token_scale read by the caller from the row), the values dequantize_row_warp gives.
// bf16: the exact fp32 of each element. The row must be visible to this thread (plain loads).
template <WireFormat kFormat>
__device__ __forceinline__ void dequantize_vec(uint8_t const* row, std::size_t scales_offset, int v, float token_scale,
                                               float (&y)[kBf16VecElems]) {
  using namespace wire_detail;
  constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  constexpr int kVec = kBf16VecElems;
  constexpr int kPayloadBytes = kVec * kTraits.bits_per_elem / 8;
  uint32_t words[4];
  load_bytes<kPayloadBytes>(row + static_cast<std::size_t>(v) * kPayloadBytes, words);
  if constexpr (kFormat == WireFormat::bf16) {
#pragma unroll
    for (int i = 0; i < kVec; ++i) y[i] = __uint_as_float((words[i / 2] >> (16 * (i % 2))) << 16);
  } else {
    float const multiplier =
        multiplier_at<kFormat>(row + scales_offset, static_cast<std::size_t>(v) * kVec, token_scale);
    scale_codes<kFormat, kVec>(words, multiplier, y);
  }
}

// Copies the block scales of the wire row at `wire` into entry (row, block) of a scale tensor of `rows` rows in
// `layout` (tensor: its first byte; wire::scale_offset gives the entry), and nvfp4's per-token scale to
// *token_scale (when non-null). Every lane of the warp calls it with the same arguments; the row must be visible to
// this thread. Padding entries of the tensor are not written (zero them once where the tensor is allocated).
// The scales are read as 32-bit words (the wire row's scales are 16-byte aligned and padded), kInFlight per lane
// before the first store (one scale at a time, an nvfp4 row's 448 scales were 14 dependent round trips per lane),
// and stored one scale per lane, consecutive scales on consecutive lanes (one-byte scales reach their lane by a
// shuffle), so a row-major store instruction writes 32 consecutive entries.
template <WireFormat kFormat>
__device__ __forceinline__ void deliver_scales_warp(uint8_t const* wire, int hidden, ScaleLayout layout,
                                                    std::size_t rows, std::size_t row, uint8_t* tensor,
                                                    float* token_scale) {
  static_assert(kFormat != WireFormat::bf16, "bf16 rows have no scales");
  constexpr wire::FormatTraits kTraits = wire::format_traits(kFormat);
  constexpr int kWarp = wire_detail::kWarpSize;
  constexpr int kPerWord = 4 / kTraits.scale_bytes;  // scales in one 32-bit word: 1 (fp32) or 4 (one-byte)
  constexpr int kInFlight = 4;
  WireRowLayout const wl = wire::make_row_layout(kFormat, hidden);
  int const lane = static_cast<int>(threadIdx.x) % kWarp;
  int const num_words = (wl.num_scales + kPerWord - 1) / kPerWord;
  // plain (coherent) loads: a peer may have written the row during this kernel
  auto const* const src = reinterpret_cast<uint32_t const*>(wire + wl.scales_offset);
  auto const store = [&](int j, uint32_t value) {
    std::size_t const at = wire::scale_offset(kFormat, layout, rows, hidden, row, static_cast<std::size_t>(j));
    if constexpr (wire::format_traits(kFormat).scale_bytes == 4)
      *reinterpret_cast<uint32_t*>(tensor + at) = value;
    else
      tensor[at] = static_cast<uint8_t>(value);
  };
  for (int w0 = 0; w0 < num_words; w0 += kWarp * kInFlight) {
    uint32_t words[kInFlight];
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const w = w0 + f * kWarp + lane;
      words[f] = w < num_words ? src[w] : 0u;
    }
    if constexpr (kPerWord == 1) {
#pragma unroll
      for (int f = 0; f < kInFlight; ++f)
        if (w0 + f * kWarp + lane < wl.num_scales) store(w0 + f * kWarp + lane, words[f]);
    } else {
      // scale j = 4 w0 + 32 k + lane is byte lane % 4 of word w0 + 8 k + lane / 4, which lane (8 k) % 32 + lane / 4
      // holds in words[k / 4]
#pragma unroll
      for (int k = 0; k < kPerWord * kInFlight; ++k) {
        uint32_t const word = __shfl_sync(wire_detail::kFullWarp, words[k / 4], (8 * k) % kWarp + lane / 4);
        int const j = kPerWord * w0 + kWarp * k + lane;
        if (j < wl.num_scales) store(j, word >> (8 * (lane % 4)));
      }
    }
  }
  if constexpr (kTraits.token_scale_bytes != 0)
    if (lane == 0 && token_scale != nullptr)
      *token_scale = *reinterpret_cast<float const*>(wire + wl.token_scale_offset);
}

}  // namespace ferry::device
