// Wire formats: how rows travel between ranks, and their byte sizes.
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
// Bytes of one row of `hidden` elements: payload + scales (+ per-token scale).
std::size_t wire_row_bytes(WireFormat format, int hidden);
// Bytes of the payload alone.
std::size_t wire_payload_bytes(WireFormat format, int hidden);

}  // namespace ferry
