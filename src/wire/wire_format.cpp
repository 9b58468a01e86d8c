#include "ferry/wire_format.hpp"

#include "ferry/error.hpp"
#include "wire/layout.hpp"

namespace ferry {

namespace {
struct FormatName {
  WireFormat format;
  char const* name;
};

constexpr FormatName kFormats[] = {
    {WireFormat::bf16, "bf16"},   {WireFormat::fp8_e4m3, "fp8"}, {WireFormat::fp8_e4m3_ue8m0, "fp8_ue8m0"},
    {WireFormat::nvfp4, "nvfp4"}, {WireFormat::mxfp4, "mxfp4"},
};

constexpr struct {
  ScaleLayout layout;
  char const* name;
} kScaleLayouts[] = {
    {ScaleLayout::row_major, "row_major"},
    {ScaleLayout::mn_major_tma, "mn_major_tma"},
    {ScaleLayout::mn_major_tma_packed_ue8m0, "mn_major_tma_packed_ue8m0"},
    {ScaleLayout::blocked_128x4, "blocked_128x4"},
};

FormatName const& entry(WireFormat format) {
  for (auto const& item : kFormats)
    if (item.format == format) return item;
  FERRY_THROW(ConfigError, "config", "unknown wire format ", static_cast<int>(format));
}

void check_hidden(WireFormat format, int hidden) {
  int const block = wire::format_traits(entry(format).format).block_elems;
  // NOTE: rows move as 16-byte vectors of bf16 (8 elements), and every scale block must be whole.
  int const unit = block > 8 ? block : 8;
  FERRY_CHECK_CONFIG(hidden > 0 && hidden % unit == 0, "hidden=", hidden, " is not a positive multiple of ", unit,
                     " elements, which wire format ", wire_format_name(format),
                     " needs (16-byte vectors and whole scale blocks); use hidden=",
                     (hidden > 0 ? (hidden + unit - 1) / unit : 1) * unit);
}

void check_scale_layout(WireFormat format, ScaleLayout layout, int hidden) {
  check_hidden(format, hidden);
  FERRY_CHECK_CONFIG(wire::supports_scale_layout(format, layout), "scale layout ", scale_layout_name(layout),
                     " cannot hold the scales of wire format ", wire_format_name(format),
                     format == WireFormat::bf16 ? " (bf16 has no scales)" : "",
                     "; row_major and mn_major_tma hold every scaled format, mn_major_tma_packed_ue8m0 the UE8M0 ones "
                     "(fp8_ue8m0, mxfp4), blocked_128x4 the fp4 ones (nvfp4, mxfp4)");
}
}  // namespace

ScaleLayout parse_scale_layout(std::string const& name) {
  std::string choices;
  for (auto const& item : kScaleLayouts) {
    if (name == item.name) return item.layout;
    choices += choices.empty() ? item.name : std::string(", ") + item.name;
  }
  FERRY_THROW(ConfigError, "config", "scale layout '", name, "' is unknown; use one of ", choices);
}

char const* wire_format_name(WireFormat format) {
  return entry(format).name;
}

WireFormat parse_wire_format(std::string const& name) {
  for (auto const& item : kFormats)
    if (name == item.name) return item.format;
  FERRY_THROW(ConfigError, "config", "wire format '", name,
              "' is unknown; use one of bf16, fp8, fp8_ue8m0, nvfp4, mxfp4");
}

int wire_block_elems(WireFormat format) {
  return wire::format_traits(entry(format).format).block_elems;
}

std::size_t wire_payload_bytes(WireFormat format, int hidden) {
  return wire_row_layout(format, hidden).payload_bytes;
}

std::size_t wire_row_bytes(WireFormat format, int hidden) {
  return wire_row_layout(format, hidden).row_bytes;
}

WireRowLayout wire_row_layout(WireFormat format, int hidden) {
  check_hidden(format, hidden);
  return wire::make_row_layout(format, hidden);
}

char const* scale_layout_name(ScaleLayout layout) {
  for (auto const& item : kScaleLayouts)
    if (item.layout == layout) return item.name;
  FERRY_THROW(ConfigError, "config", "unknown scale layout ", static_cast<int>(layout));
}

bool scale_layout_supported(WireFormat format, ScaleLayout layout) {
  return wire::supports_scale_layout(entry(format).format, layout);
}

std::size_t scale_tensor_bytes(WireFormat format, ScaleLayout layout, int rows, int hidden) {
  check_scale_layout(format, layout, hidden);
  FERRY_CHECK_INPUT(rows >= 0, "rows=", rows, " is negative; pass the number of received rows (0 or more)");
  return wire::scale_tensor_size(format, layout, static_cast<std::size_t>(rows), hidden);
}

std::size_t scale_byte_offset(WireFormat format, ScaleLayout layout, int rows, int hidden, int row, int block) {
  check_scale_layout(format, layout, hidden);
  int const num_scales = hidden / wire_block_elems(format);
  FERRY_CHECK_INPUT(row >= 0 && row < rows, "row=", row, " is outside [0, ", rows, ")");
  FERRY_CHECK_INPUT(block >= 0 && block < num_scales, "block=", block, " is outside [0, ", num_scales,
                    "), the scale blocks of a row of ", hidden, " elements");
  return wire::scale_offset(format, layout, static_cast<std::size_t>(rows), hidden, static_cast<std::size_t>(row),
                             static_cast<std::size_t>(block));
}

}  // namespace ferry
