// The in-kernel trace format, shared by the device recorder (device_trace.cuh), the host recorder that allocates the
// buffers (cuda/recorder.hpp) and the decoder (decode.hpp). Plain C++: usable from host and device code.
//
// Per traced launch, every warp owns `capacity` 16-byte events (TraceEvent) and one 32-bit count. Lane 0 of the warp
// writes them in order; events past the capacity are not written, only counted (count > capacity: dropped).
// meta, low bit first:
//   [0, 8)   slot (TraceSlot)
//   [8, 10)  kind (TraceEventKind)
//   [10, 16) warp within the CTA
//   [16, 32) CTA
//   [32, 64) payload (an instant's value; 0 for spans)
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/trace.hpp"
#include "trace/trace_slots.hpp"

#if defined(__CUDACC__)
#define FERRY_TRACE_HD __host__ __device__
#else
#define FERRY_TRACE_HD
#endif

namespace ferry::trace {

enum class TraceSlot : uint8_t {
#define FERRY_TRACE_SLOT_ENUM(kernel, name) kernel##_##name,
  FERRY_TRACE_SLOTS(FERRY_TRACE_SLOT_ENUM)
#undef FERRY_TRACE_SLOT_ENUM
};

inline constexpr int kNumSlots = 0
#define FERRY_TRACE_SLOT_COUNT(kernel, name) +1
    FERRY_TRACE_SLOTS(FERRY_TRACE_SLOT_COUNT)
#undef FERRY_TRACE_SLOT_COUNT
    ;
static_assert(kNumSlots <= 256, "TraceSlot is stored in 8 bits of the event meta");

// The kernel family each slot belongs to, indexed by slot.
inline constexpr TraceKernel kSlotKernel[] = {
#define FERRY_TRACE_SLOT_KERNEL(kernel, name) TraceKernel::kernel,
    FERRY_TRACE_SLOTS(FERRY_TRACE_SLOT_KERNEL)
#undef FERRY_TRACE_SLOT_KERNEL
};

// "kernel.name" of each slot, indexed by slot (the names of the Chrome trace and the phase table).
inline constexpr char const* kSlotNames[] = {
#define FERRY_TRACE_SLOT_NAME(kernel, name) #kernel "." #name,
    FERRY_TRACE_SLOTS(FERRY_TRACE_SLOT_NAME)
#undef FERRY_TRACE_SLOT_NAME
};
static_assert(sizeof(kSlotKernel) / sizeof(kSlotKernel[0]) == kNumSlots, "one kernel per slot");
static_assert(sizeof(kSlotNames) / sizeof(kSlotNames[0]) == kNumSlots, "one name per slot");

enum class TraceEventKind : uint8_t { begin = 0, end = 1, instant = 2 };

inline constexpr int kMaxCtas = 1 << 16;
inline constexpr int kMaxWarpsPerCta = 1 << 6;

FERRY_TRACE_HD constexpr uint64_t event_meta(uint32_t slot, uint32_t kind, uint32_t cta, uint32_t warp,
                                             uint32_t payload) {
  return static_cast<uint64_t>(slot & 0xffu) | static_cast<uint64_t>(kind & 0x3u) << 8 |
         static_cast<uint64_t>(warp & 0x3fu) << 10 | static_cast<uint64_t>(cta & 0xffffu) << 16 |
         static_cast<uint64_t>(payload) << 32;
}
FERRY_TRACE_HD constexpr uint32_t meta_slot(uint64_t meta) {
  return static_cast<uint32_t>(meta & 0xffu);
}
FERRY_TRACE_HD constexpr uint32_t meta_kind(uint64_t meta) {
  return static_cast<uint32_t>(meta >> 8 & 0x3u);
}
FERRY_TRACE_HD constexpr uint32_t meta_warp(uint64_t meta) {
  return static_cast<uint32_t>(meta >> 10 & 0x3fu);
}
FERRY_TRACE_HD constexpr uint32_t meta_cta(uint64_t meta) {
  return static_cast<uint32_t>(meta >> 16 & 0xffffu);
}
FERRY_TRACE_HD constexpr uint32_t meta_payload(uint64_t meta) {
  return static_cast<uint32_t>(meta >> 32);
}

// What a kernel receives in its Params. With FERRY_TRACE off it is empty and the FERRY_TRACE_* macros vanish, so the
// kernels compile to the same instructions as without the feature.
#if FERRY_TRACE
struct TraceView {
  TraceEvent* events;  // [num_warps, capacity]; null: not recording this launch
  uint32_t* counts;    // [num_warps] events each warp recorded, dropped ones included
  uint32_t capacity;   // events per warp
  uint32_t num_warps;  // warps the buffers hold (warps of CTAs past it record nothing)
};
#else
struct TraceView {};
#endif

}  // namespace ferry::trace
