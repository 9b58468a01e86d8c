// Wire formats: how rows travel between ranks, their byte layout, and the scale tensors a receiver hands a grouped
// GEMM. The quantization rules, byte layouts and error bounds are specified in docs/quant.md.
#pragma once

#include <cstddef>
#include <string>

namespace ferry {

enum class WireFormat {
  bf16,            // 2 bytes per element
  fp8_e4m3,        // 1 byte per element + one fp32 scale per 128 elements
  fp8_e4m3_ue8m0,  // 1 byte per element + one power-of-two (UE8M0) scale per 128 elements
  nvfp4,           // e2m1 (half a byte) + one e4m3 scale per 16 elements + one fp32 per-token scale
  mxfp4,           // e2m1 (half a byte) + one UE8M0 scale per 32 elements
};

char const* wire_format_name(WireFormat format);
// Accepts the names wire_format_name() prints; throws ConfigError naming the value and the choices.
WireFormat parse_wire_format(std::string const& name);

// Elements that share one scale (1 for bf16: no scale).
int wire_block_elems(WireFormat format);
// Bytes of one row of `hidden` elements on the wire: payload, scales and per-token scale, each piece starting at a
// 16-byte aligned offset and the row padded to a multiple of 16 bytes (so rows packed back to back stay 16-byte
// aligned). Throws ConfigError when hidden is not a positive multiple of 8 and of wire_block_elems(format).
std::size_t wire_row_bytes(WireFormat format, int hidden);
// Bytes of the payload alone (hidden * bits per element / 8, unpadded). Throws like wire_row_bytes().
std::size_t wire_payload_bytes(WireFormat format, int hidden);

// Where each piece of a wire row lives. A row is
//   [payload: payload_bytes][zero pad to 16][scales: num_scales * scale_bytes][zero pad to 16]
//   [per-token scale: fp32, nvfp4 only][zero pad to 16]
// Payload: element i of fp8 formats is byte i; e2m1 elements 2i and 2i+1 share byte i, 2i in the low nibble.
// Scales: block j (elements [j*block_elems, (j+1)*block_elems)) at scales_offset + j*scale_bytes, fp32 little-endian
// for fp8_e4m3, one byte (UE8M0 biased exponent, or e4m3) otherwise.
struct WireRowLayout {
  int hidden = 0;
  int block_elems = 1;                 // elements per scale (1 for bf16)
  int num_scales = 0;                  // hidden / block_elems; 0 for bf16
  int scale_bytes = 0;                 // bytes of one block scale: 4 (fp32), 1 (UE8M0 or e4m3), 0 (bf16)
  bool has_token_scale = false;        // nvfp4 only
  std::size_t payload_bytes = 0;       // at offset 0
  std::size_t scales_offset = 0;       // 16-byte aligned
  std::size_t token_scale_offset = 0;  // 16-byte aligned; meaningful when has_token_scale
  std::size_t row_bytes = 0;           // multiple of 16; equals wire_row_bytes()
};
// Throws ConfigError like wire_row_bytes().
WireRowLayout wire_row_layout(WireFormat format, int hidden);

// How a receiver lays out the block scales of `rows` received rows for the GEMM that consumes them. Padding entries
// (rows or scale columns past the end) are zero. A grouped (expert-major) buffer is one such tensor per group, each
// scale_tensor_bytes(format, layout, rows_per_group, hidden) long, back to back (DeepGEMM's 3-D strides).
// nvfp4's per-token fp32 scales are a separate float[rows] in every layout.
enum class ScaleLayout {
  // [rows][num_scales] scale elements, the order of the wire. Every scaled format.
  row_major,
  // DeepGEMM's get_mn_major_tma_aligned_tensor (sm90, fp32 scales): [num_scales][rows_aligned], element (row, j) at
  // j * rows_aligned + row, rows_aligned = rows rounded up to 16 bytes of scale elements (a multiple of 4 for fp32,
  // of 16 for one-byte scales). Every scaled format.
  mn_major_tma,
  // DeepGEMM's get_mn_major_tma_aligned_packed_ue8m0_tensor (sm100): uint32 words [ceil(num_scales / 4)][rows_aligned],
  // rows_aligned a multiple of 4; word (row, p) at p * rows_aligned + row holds the UE8M0 bytes of blocks 4p..4p+3,
  // block 4p in the low byte. fp8_e4m3_ue8m0 and mxfp4.
  mn_major_tma_packed_ue8m0,
  // cuBLASLt's VEC16_UE4M3 / VEC32_UE8M0 block-scale layout (torch SWIZZLE_32_4_4): rows padded to 128, scale columns
  // to 4; 512-byte tiles of 128 rows x 4 columns, tile (row / 128, j / 4) at ((row / 128) * ceil(num_scales / 4) +
  // j / 4) * 512, and inside it byte (row % 32) * 16 + (row % 128 / 32) * 4 + j % 4. nvfp4 and mxfp4.
  blocked_128x4,
};

char const* scale_layout_name(ScaleLayout layout);
// Accepts the names scale_layout_name() prints; throws ConfigError naming the value and the choices.
ScaleLayout parse_scale_layout(std::string const& name);
// Whether `layout` can hold the scales of `format` (see the list above; bf16 has no scales).
bool scale_layout_supported(WireFormat format, ScaleLayout layout);
// Bytes of the scale tensor of `rows` rows of `hidden` elements, padding included. Throws ConfigError for an
// unsupported (format, layout) pair or an invalid hidden, InputError for rows < 0.
std::size_t scale_tensor_bytes(WireFormat format, ScaleLayout layout, int rows, int hidden);
// Byte offset of the scale of (row, block) in that tensor. Throws like scale_tensor_bytes, and InputError when row or
// block is out of range.
std::size_t scale_byte_offset(WireFormat format, ScaleLayout layout, int rows, int hidden, int row, int block);

}  // namespace ferry
