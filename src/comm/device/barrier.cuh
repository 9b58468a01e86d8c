// Cross-rank device barrier over the communicator's signal area. Bounded like every device wait: a rank that does
// not arrive within FERRY_TIMEOUT_S is recorded (rank, peer, phase, expected, observed) and the barrier returns false.
//
// Why not ncclLsaBarrierSession: NCCL's LSA barrier wait is unbounded (it spins until every peer arrives), and Ferry
// requires every device wait to end and to name the rank that is missing. These signals are plain words in a
// symmetric window, so the wait can carry Ferry's deadline and report the peer.
#pragma once

#include <cstdint>

#include "comm/device/signal.cuh"
#include "ferry/device_view.hpp"

namespace ferry::device {

// Every rank enters, then every rank leaves: returns true once every rank has reached the same barrier (the same
// epoch); false on timeout (recorded in view.error) or when this rank already failed.
//
// Called by ONE thread of the whole grid (the barrier epoch is a plain device word of this rank); the caller
// brackets it with __syncthreads() so the CTA's writes before it are published and its reads after it see the
// peers' writes. Barriers of one communicator must not run concurrently (two streams): they share the epoch word.
//
// Memory order:
//  - Publish: slot `view.rank` of each peer gets `epoch` with a release store at system scope. Release orders every
//    write this thread made (and, being cumulative, every write of the CTA that it observed through the caller's
//    __syncthreads, and of earlier kernels on the stream) before the signal, for any GPU that acquires it. System
//    scope because the reader is another GPU.
//  - Wait: own slot `p` is read with acquire loads at system scope until it reaches `epoch`, so every write rank p
//    made before its barrier (to our memory or its own) is visible to this thread afterwards; the caller's
//    __syncthreads extends that to the CTA, the kernel boundary to later kernels.
//  - Epochs instead of resets: slot values only grow (epoch n is written by barrier n), so there is no window in
//    which a fast peer's next barrier could be lost to a reset, and `>=` tolerates a peer that is already one
//    barrier ahead. The epoch lives on the device and is incremented here, so a captured CUDA graph replays
//    correctly with no host involvement.
//  - Every rank of the world is in the load/store team (the communicator's barrier runs this only then), so the
//    team's first rank is 0 and signals.ptr[peer] is world rank peer's area.
__device__ __forceinline__ bool barrier_ranks(DeviceView const& view, WaitPhase phase) {
  // 1. next epoch (device-local word; only this thread touches it during the kernel, stream order between kernels)
  uint64_t const epoch = ++(*view.barrier_epoch);
  // 2. arrive: publish the epoch in every peer's slot [rank] (release: our earlier writes first)
  for (int peer = 0; peer < view.world; ++peer) {
    if (peer == view.rank) continue;
    auto* slot = reinterpret_cast<uint64_t*>(view.signals.ptr[peer]) + view.rank;
    signal_set(slot, epoch);
  }
  // 3. wait for every peer's arrival in our own slots (acquire), under one deadline for the whole barrier
  auto const* own = reinterpret_cast<uint64_t const*>(view.signals.ptr[view.rank]);
  uint64_t const start = arch::global_timer_ns();
  for (int peer = 0; peer < view.world; ++peer) {
    if (peer == view.rank) continue;
    if (!wait_signal_geq_since(view, own + peer, epoch, peer, phase, start)) return false;
  }
  return true;
}

}  // namespace ferry::device
