// ferry p2p's measures through the transport seam (comm/transport/transport.hpp), one kernel template per measure
// over the transport type, so that lsa, emulated and gin run the same code: each CTA puts its piece of the message
// with a signal and the receiving CTA waits for it (put_signal_kernel); one thread per rank plays a signal ping-pong
// (signal_ping_pong_kernel). A launch may hold several ranks (virtual ranks on one GPU, --one-gpu): blockIdx.y picks
// the rank's Side, and the grids of the ranks wait for each other inside the kernel as they do across GPUs.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/transport/group.cuh"
#include "ferry/device_view.hpp"
#include "p2p_settings.hpp"

namespace ferry::cli::p2p {

// The ranks one launch holds: every virtual rank with --one-gpu, else this process's rank.
template <class Net>
inline constexpr int kSides = Net::kKind == transport::Kind::emulated ? kMaxVirtualRanks : 1;

// The endpoint and counter of the ping-pong: past those of the CTAs.
inline constexpr int kLatencySlot = kMaxSeamCtas;
inline constexpr int kSeamCounters = kMaxSeamCtas + 1;

// One rank of a launch.
template <class Net>
struct Side {
  Net net;
  DeviceView view;
  uint64_t* seen;  // device words [kSeamCounters]: signals this rank has waited for on each counter so far
  int32_t rank;
  int32_t sends;
  int32_t receives;
};

// The window of every rank: the source [0, max_bytes), the destination slices of the sources from dst_off (one per
// source rank, `bytes` apart), then the counters, 8 bytes apart from signals_off (one per CTA, and kLatencySlot).
struct SeamLayout {
  std::size_t dst_off;
  std::size_t signals_off;
  std::size_t bytes;  // of each message
  __host__ __device__ std::size_t counter(int slot) const {
    return signals_off + static_cast<std::size_t>(slot) * sizeof(uint64_t);
  }
};

template <class Net>
struct SeamParams {
  Side<Net> side[kSides<Net>];
  SeamLayout layout;
  int32_t world;
  int32_t alltoall;  // every rank to every other (CTAs dealt over the peers); else the pair 0 <-> 1
  int32_t warmup;    // ping-pong: untimed round trips, then `rounds` timed ones
  int32_t rounds;
  uint64_t* elapsed_ns;  // ping-pong: time of the timed rounds, written by rank 0
};

// [begin, end) of piece `j` of `n` of a message of `bytes`, in 16-byte vectors.
__device__ __forceinline__ void seam_piece(std::size_t bytes, int j, int n, std::size_t& begin, std::size_t& end) {
  std::size_t const vectors = bytes / 16;
  begin = vectors * j / n * 16;
  end = vectors * (j + 1) / n * 16;
}

// CTA c works for pair g = c % pairs: it puts piece c / pairs of the message to peer rank + 1 + g (the pair: the other
// rank), with a signal on counter c there, and waits on its own counter c for the piece of rank - 1 - g. Every CTA
// index has one sender and one receiver, so counter c counts one signal per launch.
template <class Net>
__global__ void put_signal_kernel(SeamParams<Net> const params) {
  Side<Net> const& side = params.side[blockIdx.y];
  if (!side.sends && !side.receives) return;
  int const c = static_cast<int>(blockIdx.x);
  int const pairs = params.alltoall ? params.world - 1 : 1;
  int const g = c % pairs;
  int const to = params.alltoall ? (side.rank + 1 + g) % params.world : 1 - side.rank;
  int const from = params.alltoall ? (side.rank + params.world - 1 - g) % params.world : 1 - side.rank;
  std::size_t const counter = params.layout.counter(c);
  auto endpoint = side.net.open(transport::Cta{}, c);

  // 1. this CTA's piece from the source to this rank's slice at the peer, then the signal that covers it
  if (side.sends) {
    int const ctas_of_pair = (static_cast<int>(gridDim.x) - g + pairs - 1) / pairs;
    std::size_t begin = 0, end = 0;
    seam_piece(params.layout.bytes, c / pairs, ctas_of_pair, begin, end);
    std::size_t const slice = params.layout.dst_off + static_cast<std::size_t>(side.rank) * params.layout.bytes;
    if (end > begin)
      endpoint.put_signal(to, slice + begin, begin, end - begin, counter, 1);
    else
      endpoint.signal(to, counter, 1);
    endpoint.flush();  // the next launch puts from the same source, as a protocol reuses its send buffer
  }
  // 2. the peer's piece is here once its signal is (acquire: the bytes it covers are visible after the wait)
  if (side.receives) {
    uint64_t const least = side.seen[c] + 1;
    if (endpoint.wait(side.view, counter, least, from, WaitPhase::test) && threadIdx.x == 0) side.seen[c] = least;
  }
  endpoint.close();
}

// Rank 0 signals rank 1 and waits for its answer; rank 1 waits, then answers: a round trip is two signals, each a
// delivery of the transport (a network write over gin, a seeded delay over emulated).
template <class Net>
__global__ void signal_ping_pong_kernel(SeamParams<Net> const params) {
  Side<Net> const& side = params.side[blockIdx.y];
  if (side.rank > 1) return;
  bool const initiator = side.rank == 0;
  int const peer = 1 - side.rank;
  std::size_t const counter = params.layout.counter(kLatencySlot);
  auto endpoint = side.net.open(transport::Thread{}, kLatencySlot);
  uint64_t seen = side.seen[kLatencySlot];
  uint64_t start = device::arch::global_timer_ns();
  bool ok = true;
  for (int i = 0; ok && i < params.warmup + params.rounds; ++i) {
    if (i == params.warmup) start = device::arch::global_timer_ns();
    if (initiator) endpoint.signal(peer, counter, 1);
    ok = endpoint.wait(side.view, counter, seen + 1, peer, WaitPhase::test);
    seen += ok;
    if (ok && !initiator) endpoint.signal(peer, counter, 1);
  }
  side.seen[kLatencySlot] = seen;
  if (initiator && ok) *params.elapsed_ns = device::arch::global_timer_ns() - start;
  endpoint.close();
}

}  // namespace ferry::cli::p2p
