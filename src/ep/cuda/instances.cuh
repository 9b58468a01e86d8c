// The template instances of the cuda backend's kernels, listed in one place (STYLE "Kernels"): every kernel family is
// compiled for each wire codec of kCodecs and each value of its other dimensions (protocol, index type, halves,
// layout), which the family folds into one variant number. A launcher describes its family in a few lines (the
// kernel of a (codec, variant), how a call picks its variant) and finds its kernel with find_instance; the tables are
// generated at compile time from kCodecs, so no family repeats the list. Included by the launchers (.cu) only.
#pragma once

#include <cstddef>
#include <utility>

#include "ep/run_record.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "wire/device_unit_codec.cuh"

namespace ferry::cuda_ep {

// A wire codec: the format and its elements per codec unit (0: bf16 rows are copied, no unit).
struct Codec {
  WireFormat format;
  int unit;
};

// Every codec the kernels are compiled for. nvfp4 has a narrower unit (8-byte payload pieces) for the hidden sizes
// that rule out 32 (device::unit_elems_for); it is the fallback detail::kFallbackNarrowUnits names.
inline constexpr Codec kCodecs[] = {
    {WireFormat::bf16, 0},   {WireFormat::fp8_e4m3, 16}, {WireFormat::fp8_e4m3_ue8m0, 16},
    {WireFormat::nvfp4, 32}, {WireFormat::nvfp4, 16},    {WireFormat::mxfp4, 32},
};
inline constexpr int kNumCodecs = static_cast<int>(sizeof(kCodecs) / sizeof(kCodecs[0]));

// The codec a format runs at a hidden size, or -1 when none is compiled.
constexpr int codec_index(WireFormat format, int hidden) {
  int const unit = format == WireFormat::bf16 ? 0 : device::unit_elems_for(format, hidden);
  for (int c = 0; c < kNumCodecs; ++c)
    if (kCodecs[c].format == format && kCodecs[c].unit == unit) return c;
  return -1;
}

// Whether another codec of the same format has wider units (the faster variant the hidden size ruled out).
constexpr bool narrow_unit(Codec codec) {
  for (Codec const& other : kCodecs)
    if (other.format == codec.format && other.unit > codec.unit) return true;
  return false;
}

// The static facts a family states: its kernel pointer type, how many variants, whether its kernels take a codec
// unit. The family adds kName and kFormatField (for the error of a missing instance), variant(...) and kernel<c, v>().
template <typename KernelT, int kVariantCount, bool kHasUnits>
struct InstanceFamily {
  using Kernel = KernelT;
  static constexpr int kVariants = kVariantCount;
  static constexpr bool kUnits = kHasUnits;
};

// The generated table of a family: Family::Kernel kernels[codec * Family::kVariants + variant], each
// Family::kernel<codec, variant>() (null where the family has no such instance, e.g. the landing zone's quantized
// formats).
template <typename Family, std::size_t... kI>
constexpr auto make_instance_table(std::index_sequence<kI...>) {
  using Kernel = typename Family::Kernel;
  struct Table {
    Kernel kernels[sizeof...(kI)];
  };
  return Table{{Family::template kernel<static_cast<int>(kI) / Family::kVariants,
                                        static_cast<int>(kI) % Family::kVariants>()...}};
}

// The kernel of `family` for (format at hidden, variant); records the codec unit that runs (families whose kernels
// take a unit, Family::kUnits) and the narrow-unit fallback in `record`. Throws ConfigError for a combination no
// instance serves (names the family's format field, the format and the unit).
template <typename Family>
typename Family::Kernel find_instance(WireFormat format, int hidden, int variant, detail::LegRecord* record) {
  static constexpr auto kTable =
      make_instance_table<Family>(std::make_index_sequence<static_cast<std::size_t>(kNumCodecs * Family::kVariants)>{});
  int const codec = codec_index(format, hidden);
  typename Family::Kernel const kernel = codec >= 0 && variant >= 0 && variant < Family::kVariants
                                             ? kTable.kernels[codec * Family::kVariants + variant]
                                             : nullptr;
  FERRY_CHECK_CONFIG(kernel != nullptr, "no ", Family::kName, " kernel for ", Family::kFormatField, "=",
                     wire_format_name(format), " with ",
                     format == WireFormat::bf16 ? 0 : device::unit_elems_for(format, hidden),
                     "-element units (hidden=", hidden, ", variant ", variant, ")");
  if (record && Family::kUnits) {
    record->unit = kCodecs[codec].unit;
    if (narrow_unit(kCodecs[codec])) record->fallbacks |= detail::kFallbackNarrowUnits;
  }
  return kernel;
}

}  // namespace ferry::cuda_ep
