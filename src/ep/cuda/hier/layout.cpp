// The hierarchical protocol's areas of the symmetric region (hier/layout.hpp).
#include "ep/cuda/hier/layout.hpp"

#include "ep/cuda/layout.hpp"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

void lay_out_hier(HierLayout& layout, NormalLayout& normal, AreaPacker& areas, EpConfig const& config,
                  Topology const& topology) {
  int const world = topology.world();
  std::size_t const w = static_cast<std::size_t>(world);
  std::size_t const n = static_cast<std::size_t>(topology.nodes);
  std::size_t const max_tokens = static_cast<std::size_t>(config.max_tokens_per_rank);
  std::size_t const row = wire_row_bytes(config.dispatch_format, config.hidden);
  std::size_t const combine_row = wire_row_bytes(config.combine_format, config.hidden);
  // NOTE: a count row is one put: 16-byte multiples (an even number of words), every row 16-byte aligned.
  normal.count_words = 1 + world + normal.expert_words + topology.nodes;
  normal.count_words += normal.count_words % 2;
  normal.counts = areas.take(2 * w * normal.count_words * sizeof(uint64_t));  // replaces the push's (wider rows)
  layout.count_send = areas.take(w * normal.count_words * sizeof(uint64_t));
  // the counters the network signals, adjacent (the GIN transport's signal range): per source of count rows, per
  // source node of forwarded rows, per sender of combine rows, per rail of combine rows
  std::size_t const counters = 3 * w + n;
  layout.signals = areas.take(counters * sizeof(uint64_t));
  layout.num_signals = static_cast<uint32_t>(counters);
  layout.count_signal = layout.signals;
  layout.fwd_signal = layout.count_signal + w * sizeof(uint64_t);
  layout.arrive = layout.fwd_signal + n * sizeof(uint64_t);
  layout.rail_signal = layout.arrive + w * sizeof(uint64_t);
  layout.meta_bytes = hier_record_bytes(topology.local, config.topk);
  layout.send_rows = areas.take(max_tokens * row);
  layout.send_meta = areas.take(n * max_tokens * layout.meta_bytes);
  layout.fwd_rows = areas.take(n * max_tokens * row);
  layout.fwd_meta = areas.take(n * max_tokens * layout.meta_bytes);
  layout.partials = areas.take(2 * n * static_cast<std::size_t>(topology.local) * max_tokens *
                               static_cast<std::size_t>(config.hidden) * 2);
  layout.combine_send = areas.take(n * max_tokens * combine_row);
  layout.abort = areas.take(2 * w * sizeof(uint64_t));
}

}  // namespace ferry::cuda_ep
