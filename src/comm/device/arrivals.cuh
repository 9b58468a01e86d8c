// Arrival counters: how the parties of one call (the CTAs of a grid, or its warps) tell a peer that they are all
// done, whatever their number. Each party adds its share to the peer's counter (a release add, after the writes it
// covers); the shares of one call sum to exactly kArrivalsPerCall: party 0 adds kArrivalsPerCall - (parties - 1), every
// other party 1. So the counter reads arrivals_for(seq) once every party of calls 1..seq arrived, a sender's grid
// may differ from the receiver's and from one call to the next, and counters only grow (a network has no remote
// "set"): a captured graph replays with no reset.
#pragma once

#include <cstdint>

namespace ferry::device {

// What one call adds to a counter: more than any grid has parties (CTAs or warps), so a partial call never reads as
// a whole one.
inline constexpr uint64_t kArrivalsPerCall = 1ull << 20;

// The share of party `party` of `parties` (0 <= party < parties <= kArrivalsPerCall).
__host__ __device__ __forceinline__ uint64_t arrival_share(int party, int parties) {
  return party == 0 ? kArrivalsPerCall - static_cast<uint64_t>(parties - 1) : 1ull;
}

// The counter's value once calls 1..seq have all arrived.
__host__ __device__ __forceinline__ uint64_t arrivals_for(uint64_t seq) {
  return seq * kArrivalsPerCall;
}

// The call a counter's value has passed: a value above arrivals_for(seq + 1) while this rank waits for call seq means
// the peer ran two calls more than this rank (out of step).
__host__ __device__ __forceinline__ uint64_t calls_of(uint64_t arrivals) {
  return arrivals / kArrivalsPerCall;
}

}  // namespace ferry::device
