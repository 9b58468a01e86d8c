#include "ferry/wire_format.hpp"

#include "ferry/error.hpp"

namespace ferry {

namespace {
struct FormatInfo {
  WireFormat format;
  char const* name;
  int block_elems;        // elements per scale
  int bits_per_elem;      // payload bits
  int scale_bytes;        // bytes per block scale
  int token_scale_bytes;  // bytes per row scale
};

constexpr FormatInfo kFormats[] = {
    {WireFormat::bf16, "bf16", 1, 16, 0, 0},
    {WireFormat::fp8_e4m3, "fp8", 128, 8, 4, 0},
    {WireFormat::fp8_e4m3_ue8m0, "fp8_ue8m0", 128, 8, 1, 0},
    {WireFormat::nvfp4, "nvfp4", 16, 4, 1, 4},
    {WireFormat::mxfp4, "mxfp4", 32, 4, 1, 0},
};

FormatInfo const& info(WireFormat format) {
  for (auto const& entry : kFormats)
    if (entry.format == format) return entry;
  FERRY_THROW(ConfigError, "config", "unknown wire format ", static_cast<int>(format));
}
}  // namespace

char const* wire_format_name(WireFormat format) {
  return info(format).name;
}

WireFormat parse_wire_format(std::string const& name) {
  for (auto const& entry : kFormats)
    if (name == entry.name) return entry.format;
  FERRY_THROW(ConfigError, "config", "wire format '", name,
              "' is unknown; use one of bf16, fp8, fp8_ue8m0, nvfp4, mxfp4");
}

int wire_block_elems(WireFormat format) {
  return info(format).block_elems;
}

std::size_t wire_payload_bytes(WireFormat format, int hidden) {
  return static_cast<std::size_t>(hidden) * info(format).bits_per_elem / 8;
}

std::size_t wire_row_bytes(WireFormat format, int hidden) {
  FormatInfo const& entry = info(format);
  std::size_t const blocks = entry.scale_bytes ? (static_cast<std::size_t>(hidden) / entry.block_elems) : 0;
  return wire_payload_bytes(format, hidden) + blocks * entry.scale_bytes + entry.token_scale_bytes;
}

}  // namespace ferry
