// In-kernel traces of dispatch and combine: what a traced call recorded, per rank and per kernel family.
//
// Tracing is compiled in with the CMake option FERRY_TRACE=ON (trace_compiled_in()); without it the kernels carry no
// trace code at all. With it, EpBuffer::enable_trace(max_events_per_warp) (or FERRY_TRACE_EVENTS at construction)
// makes every later call record, per warp, the begin and end of each phase (src/trace/trace_slots.hpp lists them)
// with the GPU's global timer, and EpBuffer::read_trace copies the last traced call of a kernel family out.
// `ferry bench --trace DIR` writes these buffers per rank and `ferry trace --dir DIR` turns them into a Chrome /
// Perfetto trace and a per-phase table (src/trace/decode.hpp).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ferry {

// The traced kernel families.
// dispatch / combine: normal mode; ll_dispatch / ll_combine: low-latency mode (with the receive hook, the send and
// receive halves are two launches and the trace holds the last of them).
enum class TraceKernel : uint8_t { dispatch = 0, combine = 1, ll_dispatch = 2, ll_combine = 3 };
inline constexpr int kNumTraceKernels = 4;

char const* trace_kernel_name(TraceKernel kernel);  // "dispatch" | "combine" | "ll_dispatch" | "ll_combine"
// Throws ConfigError naming the allowed names.
TraceKernel parse_trace_kernel(std::string const& name);

// True when this build records traces (CMake FERRY_TRACE=ON).
bool trace_compiled_in();

// One recorded event, as the kernel wrote it: global timer nanoseconds and a packed meta word (slot, kind, CTA,
// warp, payload; layout in src/trace/trace_format.hpp).
struct TraceEvent {
  uint64_t time_ns;
  uint64_t meta;
};
static_assert(sizeof(TraceEvent) == 16, "trace events are 16 bytes");

// The raw trace of one launch of one kernel family on one rank. Warp w (= cta * warps_per_cta + warp in the CTA)
// owns events[w * capacity, w * capacity + min(counts[w], capacity)); counts[w] > capacity means the warp recorded
// more than its buffer held and the rest were dropped (counted, never written).
struct TraceBuffer {
  int rank = 0;
  TraceKernel kernel = TraceKernel::dispatch;
  int ctas = 0;                    // CTAs of the launch
  int warps_per_cta = 0;           // warps per CTA of the launch
  int capacity = 0;                // events per warp
  std::vector<uint32_t> counts;    // [ctas * warps_per_cta]
  std::vector<TraceEvent> events;  // [ctas * warps_per_cta * capacity]

  int num_warps() const { return ctas * warps_per_cta; }
};

}  // namespace ferry
