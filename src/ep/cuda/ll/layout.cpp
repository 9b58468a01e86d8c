// Low-latency mode's areas of the symmetric region (ll/layout.hpp).
#include "ep/cuda/ll/layout.hpp"

#include "ep/cuda/layout.hpp"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

void lay_out_ll(LlLayout& layout, AreaPacker& areas, EpConfig const& config, int world, int nodes) {
  std::size_t const w = static_cast<std::size_t>(world);
  // [2 parities][world][max_tokens]: the landing slots
  std::size_t const slots = 2 * w * static_cast<std::size_t>(config.max_tokens_per_rank);
  layout.meta_bytes = landing_record_bytes(config.topk);
  // NOTE: landing rows are wire rows (multiples of 16 bytes): a quantized leg's zone shrinks with its format.
  layout.dispatch_row_bytes = wire_row_bytes(config.dispatch_format, config.hidden);
  layout.combine_row_bytes = wire_row_bytes(config.combine_format, config.hidden);
  if (nodes > 1) {
    // across nodes the arrival counters are one range: the network's signals
    std::size_t const n = static_cast<std::size_t>(nodes);
    layout.num_signals = static_cast<uint32_t>(2 * w + n);
    layout.signals = areas.take((2 * w + n) * sizeof(uint64_t));
    layout.dispatch_arrivals = layout.signals;
    layout.combine_arrivals = layout.signals + w * sizeof(uint64_t);
    layout.fwd_arrivals = layout.signals + 2 * w * sizeof(uint64_t);
  } else {
    layout.dispatch_arrivals = areas.take(w * sizeof(uint64_t));
    layout.combine_arrivals = areas.take(w * sizeof(uint64_t));
  }
  layout.dispatch_tokens = areas.take(2 * w * sizeof(uint64_t));
  layout.dispatch_abort = areas.take(2 * w * sizeof(uint64_t));
  layout.combine_abort = areas.take(2 * w * sizeof(uint64_t));
  layout.dispatch_meta = areas.take(slots * layout.meta_bytes);
  layout.dispatch_rows = areas.take(slots * layout.dispatch_row_bytes);
  layout.combine_rows = areas.take(slots * layout.combine_row_bytes);
  if (nodes > 1) {
    std::size_t const max_tokens = static_cast<std::size_t>(config.max_tokens_per_rank);
    std::size_t const local = static_cast<std::size_t>(world / nodes);
    layout.send_rows = areas.take(2 * max_tokens * layout.dispatch_row_bytes);
    layout.send_meta = areas.take(slots * layout.meta_bytes);
    layout.combine_send = areas.take(slots * layout.combine_row_bytes);
    if (config.route() == InternodeRoute::forward) {
      std::size_t const n = static_cast<std::size_t>(nodes);
      std::size_t const per_node = 2 * n * max_tokens;  // [2][nodes][max_tokens]
      layout.fwd_rows = areas.take(per_node * layout.dispatch_row_bytes);
      layout.fwd_meta = areas.take(per_node * layout.meta_bytes);
      layout.fwd_tokens = areas.take(2 * n * sizeof(uint64_t));
      layout.fwd_abort = areas.take(2 * n * sizeof(uint64_t));
      layout.partials = areas.take(per_node * local * static_cast<std::size_t>(config.hidden) * 2);
      layout.partial_arrivals = areas.take(w * sizeof(uint64_t));
      layout.rail_send = areas.take(per_node * layout.combine_row_bytes);
    }
  }
  // rank masking: the agreement's words, the region's last area (ll_mask_area finds them from the total, so that
  // the layout, and with it every kernel's Params, is the same with masking off)
  if (config.rank_masking) areas.take(ll_mask_area_bytes(world));
}

std::size_t ll_mask_area_bytes(int world) {
  std::size_t const w = static_cast<std::size_t>(world);
  std::size_t const slots = static_cast<std::size_t>(detail::kMaskEstimateSlots);
  std::size_t const set = static_cast<std::size_t>(ll_mask_set_stride(world));
  std::size_t const words = (1 + 2 * slots) * w * set + 2 * (1 + slots) * set + (1 + slots) * w;
  return wire::align_up(words * sizeof(uint64_t), 256);
}

LlMaskArea ll_mask_area(std::size_t region_total, int world) {
  std::size_t const set = static_cast<std::size_t>(ll_mask_set_stride(world)) * sizeof(uint64_t);
  std::size_t const sets = static_cast<std::size_t>(world) * set;
  std::size_t const counters = static_cast<std::size_t>(world) * sizeof(uint64_t);
  std::size_t const slots = static_cast<std::size_t>(detail::kMaskEstimateSlots);
  LlMaskArea area{};
  area.arrive = region_total - ll_mask_area_bytes(world);
  area.estimates = area.arrive + sets;
  area.outbox = area.estimates + 2 * slots * sets;
  area.arrive_signals = area.outbox + 2 * (1 + slots) * set;
  area.estimate_signals = area.arrive_signals + counters;
  area.signals = area.arrive_signals;
  area.num_signals = static_cast<uint32_t>((1 + slots) * world);
  return area;
}

}  // namespace ferry::cuda_ep
