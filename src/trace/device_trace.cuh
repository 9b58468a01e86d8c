// The device side of in-kernel tracing. A kernel declares its warp's recorder once with FERRY_TRACE_WARP(trace,
// p.trace) and marks its phases with FERRY_TRACE_BEGIN / FERRY_TRACE_END (spans, nestable) and FERRY_TRACE_INSTANT
// (a point with a 32-bit value). Every thread may execute the macros; only lane 0 of the warp records, so a call site
// must be reached by lane 0 (all of the warp, or a branch such as `tid == 0` / `tid < world`).
//
// With FERRY_TRACE off the macros expand to nothing and TraceView is an empty struct: the kernels compile to the
// instructions they have without the feature. With it on and a null TraceView (tracing not enabled at run time) each
// macro is one predicated branch on a register.
#pragma once

#include <cstdint>

#include "trace/trace_format.hpp"

#if FERRY_TRACE
#include "comm/device/arch_sm90.cuh"

namespace ferry::trace {

// One warp's recorder. Keeps the event count in a register (lane 0's copy is the real one) and stores it after every
// event, so a kernel that leaves early (a timeout) still publishes what it recorded.
class WarpTrace {
 public:
  __device__ __forceinline__ explicit WarpTrace(TraceView const& view) {
    uint32_t const warp = threadIdx.x / 32;
    uint32_t const warps_per_cta = blockDim.x / 32;
    uint32_t const index = blockIdx.x * warps_per_cta + warp;
    if (view.events == nullptr || index >= view.num_warps) return;
    events_ = view.events + static_cast<std::size_t>(index) * view.capacity;
    count_ = view.counts + index;
    capacity_ = view.capacity;
    meta_ = event_meta(0, 0, blockIdx.x, warp, 0);
    if ((threadIdx.x & 31) == 0) *count_ = 0;
  }

  __device__ __forceinline__ void record(TraceSlot slot, TraceEventKind kind, uint32_t payload) {
    if (events_ == nullptr || (threadIdx.x & 31) != 0) return;
    if (recorded_ < capacity_) {
      uint64_t const time = device::arch::global_timer_ns();
      uint64_t const meta = meta_ | event_meta(static_cast<uint32_t>(slot), static_cast<uint32_t>(kind), 0, 0, payload);
      // one 16-byte store per event (the buffer is 256-byte aligned, events are 16 bytes)
      device::arch::store_na_v4(reinterpret_cast<int4*>(events_ + recorded_),
                                make_int4(static_cast<int>(time), static_cast<int>(time >> 32), static_cast<int>(meta),
                                          static_cast<int>(meta >> 32)));
    }
    ++recorded_;  // past the capacity: counted as dropped, never written
    *count_ = recorded_;
  }

 private:
  TraceEvent* events_ = nullptr;
  uint32_t* count_ = nullptr;
  uint32_t capacity_ = 0;
  uint32_t recorded_ = 0;
  uint64_t meta_ = 0;
};

}  // namespace ferry::trace

#define FERRY_TRACE_WARP(trace, view) ::ferry::trace::WarpTrace trace(view)
// A device function that records into its caller's warp recorder: FERRY_TRACE_PARAM(trace) last in its parameter
// list (no comma before it), FERRY_TRACE_ARG(trace) last in the call's arguments.
#define FERRY_TRACE_PARAM(trace) , ::ferry::trace::WarpTrace& trace
#define FERRY_TRACE_ARG(trace) , trace
#define FERRY_TRACE_BEGIN(trace, slot) \
  (trace).record(::ferry::trace::TraceSlot::slot, ::ferry::trace::TraceEventKind::begin, 0u)
#define FERRY_TRACE_END(trace, slot) \
  (trace).record(::ferry::trace::TraceSlot::slot, ::ferry::trace::TraceEventKind::end, 0u)
#define FERRY_TRACE_INSTANT(trace, slot, value) \
  (trace).record(::ferry::trace::TraceSlot::slot, ::ferry::trace::TraceEventKind::instant, static_cast<uint32_t>(value))
#else
#define FERRY_TRACE_WARP(trace, view)
#define FERRY_TRACE_PARAM(trace)
#define FERRY_TRACE_ARG(trace)
#define FERRY_TRACE_BEGIN(trace, slot)
#define FERRY_TRACE_END(trace, slot)
#define FERRY_TRACE_INSTANT(trace, slot, value)
#endif
