#include "trace/synthetic.hpp"

#include <vector>

#include "trace/trace_format.hpp"

namespace ferry::trace {

TraceBuffer synthetic_trace(int rank, TraceKernel kernel, int ctas, int warps_per_cta, int capacity, int64_t start_ns,
                            int64_t span_ns, int64_t gap_ns, int64_t skew_ns) {
  std::vector<uint32_t> slots;
  for (int s = 0; s < kNumSlots; ++s)
    if (kSlotKernel[s] == kernel) slots.push_back(static_cast<uint32_t>(s));
  TraceBuffer b;
  b.rank = rank;
  b.kernel = kernel;
  b.ctas = ctas;
  b.warps_per_cta = warps_per_cta;
  b.capacity = capacity;
  std::size_t const warps = static_cast<std::size_t>(ctas) * warps_per_cta;
  b.counts.assign(warps, static_cast<uint32_t>(capacity));
  b.events.resize(warps * capacity);
  for (std::size_t w = 0; w < warps; ++w) {
    uint32_t const cta = static_cast<uint32_t>(w / warps_per_cta);
    uint32_t const warp = static_cast<uint32_t>(w % warps_per_cta);
    TraceEvent* ev = b.events.data() + w * capacity;
    int64_t t = start_ns + static_cast<int64_t>(w) * skew_ns;
    for (int i = 0; i < capacity; ++i) {
      uint32_t const slot = slots[(i / 2) % slots.size()];
      bool const begin = i % 2 == 0;
      ev[i].time_ns = static_cast<uint64_t>(t);
      ev[i].meta =
          event_meta(slot, static_cast<uint32_t>(begin ? TraceEventKind::begin : TraceEventKind::end), cta, warp, 0);
      t += begin ? span_ns : gap_ns;
    }
  }
  return b;
}

}  // namespace ferry::trace
