// The groups of threads that call a transport endpoint together: one thread, a warp, or a whole CTA. Each says who
// it is (rank in the group, size), which thread leads (issues the signals), and how it synchronises; the endpoint
// calls are collective over the group.
#pragma once

#include <cstdint>

#include "comm/device/signal.cuh"
#include "ferry/device_view.hpp"

namespace ferry::transport {

// One thread alone.
struct Thread {
  __device__ __forceinline__ int rank() const { return 0; }
  __device__ __forceinline__ int size() const { return 1; }
  __device__ __forceinline__ bool leader() const { return true; }
  __device__ __forceinline__ void sync() const {}
  // the AND of every thread's value, on every thread (a leader's result is broadcast by the others passing true)
  __device__ __forceinline__ bool all(bool value) const { return value; }
};

// The 32 lanes of the calling thread's warp (every lane must call).
struct Warp {
  __device__ __forceinline__ int rank() const { return static_cast<int>(threadIdx.x % 32); }
  __device__ __forceinline__ int size() const { return 32; }
  __device__ __forceinline__ bool leader() const { return rank() == 0; }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
  __device__ __forceinline__ bool all(bool value) const {
    bool const result = __all_sync(0xffffffffu, value) != 0;
    __syncwarp();  // a vote does not order memory; the warp barrier does (the leader's acquire reaches every lane)
    return result;
  }
};

// Every thread of the CTA (every thread must call).
struct Cta {
  __device__ __forceinline__ int rank() const { return static_cast<int>(threadIdx.x); }
  __device__ __forceinline__ int size() const { return static_cast<int>(blockDim.x); }
  __device__ __forceinline__ bool leader() const { return threadIdx.x == 0; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ bool all(bool value) const { return __syncthreads_and(value) != 0; }
};

// The wait of every transport's endpoint: the group's leader waits (bounded, acquire) until the counter reaches
// `least`; the group's barrier then extends the leader's acquire to every thread and carries its outcome.
template <class Group>
__device__ __forceinline__ bool group_wait(Group group, DeviceView const& view, uint64_t const* counter, uint64_t least,
                                           int peer, WaitPhase phase) {
  bool ok = true;
  if (group.leader()) ok = device::wait_signal_geq(view, counter, least, peer, phase);
  return group.all(ok);
}

}  // namespace ferry::transport
