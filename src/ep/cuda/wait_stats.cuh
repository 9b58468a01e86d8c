// Per-source wait statistics of the low-latency receive halves (EpConfig::wait_stats, EpBuffer::wait_stats): how
// often, and how long in ns (%globaltimer), the thread that waits for a source's arrivals waited, per leg and source.
//
// The kernels see one POD pointer (LlParams::wait_stats): null when the statistics are off, so a wait site pays one
// predictable branch and nothing else. On, a [kLegs][world] array of Slot in device memory (CudaEp owns it, zeroed at
// construction and by reset_wait_stats). Only CTA 0 records: every CTA waits for the same cumulative counters, so one
// CTA's waits are the call's, and the count is one per source and call. Each record is three relaxed atomics on
// device memory, off the data path (after the wait, before the barrier that follows it).
//
// A wait site wraps its wait, one call: ok = wait_stats::timed(row, source, [&] { return wait...(); });
#pragma once

#include <cstdint>

#include "comm/device/arch_sm90.cuh"

namespace ferry::wait_stats {

// One source's waits in one leg (layout-compatible with ferry::PeerWaitStats: the host copies the array as is).
struct Slot {
  unsigned long long waits;
  unsigned long long total_ns;
  unsigned long long max_ns;
};
static_assert(sizeof(Slot) == 24, "Slot mirrors PeerWaitStats (three uint64)");

enum Leg : int { kDispatch = 0, kCombine = 1 };
inline constexpr int kLegs = 2;

// The row of `leg` of a [kLegs][world] array (null stays null: statistics off).
__host__ __device__ __forceinline__ Slot* row(Slot* stats, int leg, int world) {
  return stats == nullptr ? nullptr : stats + static_cast<std::ptrdiff_t>(leg) * world;
}

// Runs wait() (a bounded wait that returns whether it saw its signal) and, when `row` is set and this is CTA 0, adds
// its duration to row[source]. Returns what wait() returned; a wait that failed counts too (its time is the bound).
// One call site of wait(), whether or not it is timed: an early return for the untimed case would make the compiler
// inline the wait twice, and the hot kernels carry the second copy (the timed one, taken only with the statistics on)
// on every call.
template <typename Wait>
__device__ __forceinline__ bool timed(Slot* row, int source, Wait&& wait) {
  bool const record = row != nullptr && blockIdx.x == 0;
  uint64_t const start = record ? device::arch::global_timer_ns() : 0;
  bool const ok = wait();
  if (record) {
    unsigned long long const ns = device::arch::global_timer_ns() - start;
    Slot* const slot = row + source;
    atomicAdd(&slot->waits, 1ull);
    atomicAdd(&slot->total_ns, ns);
    atomicMax(&slot->max_ns, ns);
  }
  return ok;
}

}  // namespace ferry::wait_stats
