// Layout arithmetic of the wire formats, shared by the host (wire_format.cpp, host_codec.cpp) and the device codecs
// (device_codec.cuh): one definition of every offset. No validation here: the public functions of wire_format.hpp
// validate, kernels get layouts the host validated.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/wire_format.hpp"

#if defined(__CUDACC__)
#define FERRY_QUANT_HD __host__ __device__ __forceinline__
#else
#define FERRY_QUANT_HD inline
#endif

namespace ferry::wire {

// Every piece of a wire row starts at a multiple of this, and rows are padded to it: 16-byte vector copies.
inline constexpr std::size_t kWireAlign = 16;

struct FormatTraits {
  int block_elems;        // elements per scale (1 for bf16)
  int bits_per_elem;      // payload bits per element
  int scale_bytes;        // bytes of one block scale (0 for bf16)
  int token_scale_bytes;  // bytes of the per-row scale (nvfp4 only)
};

FERRY_QUANT_HD constexpr FormatTraits format_traits(WireFormat format) {
  switch (format) {
    case WireFormat::bf16:
      return {1, 16, 0, 0};
    case WireFormat::fp8_e4m3:
      return {128, 8, 4, 0};
    case WireFormat::fp8_e4m3_ue8m0:
      return {128, 8, 1, 0};
    case WireFormat::nvfp4:
      return {16, 4, 1, 4};
    case WireFormat::mxfp4:
      return {32, 4, 1, 0};
  }
  return {0, 0, 0, 0};
}

FERRY_QUANT_HD constexpr std::size_t align_up(std::size_t value, std::size_t alignment) {
  return (value + alignment - 1) / alignment * alignment;
}

// hidden must be a positive multiple of 8 and of the format's block (checked by wire_row_layout()).
FERRY_QUANT_HD constexpr WireRowLayout make_row_layout(WireFormat format, int hidden) {
  FormatTraits const traits = format_traits(format);
  WireRowLayout layout;
  layout.hidden = hidden;
  layout.block_elems = traits.block_elems;
  layout.num_scales = traits.scale_bytes ? hidden / traits.block_elems : 0;
  layout.scale_bytes = traits.scale_bytes;
  layout.has_token_scale = traits.token_scale_bytes != 0;
  layout.payload_bytes = static_cast<std::size_t>(hidden) * traits.bits_per_elem / 8;
  layout.scales_offset = align_up(layout.payload_bytes, kWireAlign);
  std::size_t const scales_end =
      align_up(layout.scales_offset + static_cast<std::size_t>(layout.num_scales) * traits.scale_bytes, kWireAlign);
  layout.token_scale_offset = scales_end;
  layout.row_bytes = align_up(scales_end + traits.token_scale_bytes, kWireAlign);
  return layout;
}

// ---- receiver scale tensors (ScaleLayout, see wire_format.hpp) ------------------------------------------------------

FERRY_QUANT_HD constexpr bool supports_scale_layout(WireFormat format, ScaleLayout layout) {
  if (format == WireFormat::bf16) return false;
  switch (layout) {
    case ScaleLayout::row_major:
    case ScaleLayout::mn_major_tma:
      return true;
    case ScaleLayout::mn_major_tma_packed_ue8m0:
      return format == WireFormat::fp8_e4m3_ue8m0 || format == WireFormat::mxfp4;
    case ScaleLayout::blocked_128x4:
      return format == WireFormat::nvfp4 || format == WireFormat::mxfp4;
  }
  return false;
}

// Rows of the MN-major layouts rounded up so that each scale column is a multiple of 16 bytes (TMA).
FERRY_QUANT_HD constexpr std::size_t tma_aligned_rows(std::size_t rows, std::size_t elem_bytes) {
  return align_up(rows, kWireAlign / elem_bytes);
}

inline constexpr std::size_t kBlockedTileRows = 128;
inline constexpr std::size_t kBlockedTileCols = 4;
inline constexpr std::size_t kBlockedTileBytes = kBlockedTileRows * kBlockedTileCols;

// Bytes of the tensor; (format, layout) must be supported.
FERRY_QUANT_HD constexpr std::size_t scale_tensor_size(WireFormat format, ScaleLayout layout, std::size_t rows,
                                                       int hidden) {
  FormatTraits const traits = format_traits(format);
  std::size_t const num_scales = static_cast<std::size_t>(hidden) / traits.block_elems;
  std::size_t const elem = traits.scale_bytes;
  switch (layout) {
    case ScaleLayout::row_major:
      return rows * num_scales * elem;
    case ScaleLayout::mn_major_tma:
      return num_scales * tma_aligned_rows(rows, elem) * elem;
    case ScaleLayout::mn_major_tma_packed_ue8m0:
      return (num_scales + 3) / 4 * tma_aligned_rows(rows, 4) * 4;
    case ScaleLayout::blocked_128x4:
      return align_up(rows, kBlockedTileRows) * align_up(num_scales, kBlockedTileCols);
  }
  return 0;
}

// Byte offset of the scale of (row, block); (format, layout) must be supported, row < rows, block < num_scales.
FERRY_QUANT_HD constexpr std::size_t scale_offset(WireFormat format, ScaleLayout layout, std::size_t rows, int hidden,
                                                  std::size_t row, std::size_t block) {
  FormatTraits const traits = format_traits(format);
  std::size_t const num_scales = static_cast<std::size_t>(hidden) / traits.block_elems;
  std::size_t const elem = traits.scale_bytes;
  switch (layout) {
    case ScaleLayout::row_major:
      return (row * num_scales + block) * elem;
    case ScaleLayout::mn_major_tma:
      return (block * tma_aligned_rows(rows, elem) + row) * elem;
    case ScaleLayout::mn_major_tma_packed_ue8m0:
      return (block / 4 * tma_aligned_rows(rows, 4) + row) * 4 + block % 4;
    case ScaleLayout::blocked_128x4: {
      std::size_t const tile =
          row / kBlockedTileRows * ((num_scales + kBlockedTileCols - 1) / kBlockedTileCols) + block / kBlockedTileCols;
      std::size_t const in_tile = row % kBlockedTileRows;
      return tile * kBlockedTileBytes + in_tile % 32 * 16 + in_tile / 32 * 4 + block % kBlockedTileCols;
    }
  }
  return 0;
}

}  // namespace ferry::wire
