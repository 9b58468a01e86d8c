// The emulated transport: the network's semantics (transport.hpp) between ranks that share memory (virtual ranks on
// one GPU, GPUs of one host), so that a protocol meant for the network is tested where one runs. It keeps exactly
// what the contract promises and nothing more:
//  - a put only queues (destination, source, bytes) in its endpoint; nothing arrives at the call;
//  - a signal to a peer first delivers every put queued for that peer, after a seeded delay, in a seeded order, each
//    put in 16-byte pieces in a seeded order, then adds to the counter (release); puts to other peers stay queued;
//  - a flush copies the sources of the queued puts into the endpoint's snapshot, so the caller may overwrite them,
//    and delivers nothing;
//  - close delivers what is left, later than any signal: data that no signal covered arrives late.
// A kernel that reads a put's bytes without waiting for its signal, signals before its puts, or reuses a source
// before a flush, reads or sends wrong bytes here instead of racing and passing. A full queue or snapshot delivers
// early, which the contract allows. The leader thread of the group does the queueing and the copies (slowly: this is
// for tests). Load/store capability: none (kLoadStore is false).
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/signal.cuh"
#include "comm/transport/group.cuh"
#include "comm/transport/transport.hpp"
#include "ferry/device_view.hpp"

namespace ferry::transport {

// Most ranks the emulated network connects: one host's (its GPUs, or the virtual ranks of one GPU, one SM at least
// each). Past it a world is a cluster's, over GIN.
inline constexpr int kMaxEmulatedWorld = 256;
inline constexpr int kEmulatedOps = 64;                  // puts one endpoint holds before it delivers early
inline constexpr std::size_t kEmulatedSnapshot = 32768;  // bytes of flushed sources one endpoint keeps

struct EmulatedOp {
  char* dst;
  char const* src;  // this rank's window; the endpoint's snapshot once flushed; null for a value
  uint64_t bytes;   // 8 for a value
  uint64_t value;
  int32_t peer;
  int32_t reserved;
};

// One endpoint's state (device memory of the rank that opens it).
struct EmulatedArea {
  uint32_t pending;        // queued puts
  uint32_t snapshot_used;  // bytes of `snapshot` taken by flushed sources
  uint64_t draws;          // position in the endpoint's seeded stream (persists across kernels: fresh choices)
  uint32_t left_open;      // opens that found puts queued (an endpoint a kernel did not close); tests assert 0
  uint32_t reserved;
  EmulatedOp ops[kEmulatedOps];
  alignas(16) char snapshot[kEmulatedSnapshot];
};

template <class Group>
class EmulatedEndpoint;

struct Emulated {
  static constexpr Kind kKind = Kind::emulated;
  static constexpr bool kLoadStore = false;

  char* windows[kMaxEmulatedWorld];  // every rank's window, by world rank (shared memory; only the leader copies)
  int32_t rank;
  int32_t world;
  EmulatedArea* areas;  // this rank's endpoints
  int32_t num_areas;
  uint32_t max_delay_ns;
  uint64_t seed;
  uint32_t reorder;

  // `endpoint` in [0, num_areas): an endpoint is used by one group at a time (e.g. the global warp index).
  template <class Group>
  __device__ __forceinline__ EmulatedEndpoint<Group> open(Group group, int endpoint) const {
    return EmulatedEndpoint<Group>(*this, group, areas + endpoint);
  }
};

template <class Group>
class EmulatedEndpoint {
 public:
  __device__ EmulatedEndpoint(Emulated const& net, Group group, EmulatedArea* area)
      : net_(net), group_(group), area_(area) {
    if (group_.leader() && area_->pending != 0) {
      ++area_->left_open;
      deliver(-1);
    }
    group_.sync();
  }

  __device__ void put(int peer, std::size_t dst_off, std::size_t src_off, std::size_t bytes) {
    group_.sync();  // the group wrote the source before the call
    if (group_.leader()) enqueue(peer, net_.windows[peer] + dst_off, net_.windows[net_.rank] + src_off, bytes, 0);
  }
  __device__ void put_value(int peer, std::size_t dst_off, uint64_t value) {
    if (group_.leader()) enqueue(peer, net_.windows[peer] + dst_off, nullptr, 8, value);
  }
  __device__ void signal(int peer, std::size_t signal_off, uint64_t add) {
    group_.sync();
    if (group_.leader()) {
      deliver(peer);
      device::signal_add(reinterpret_cast<uint64_t*>(net_.windows[peer] + signal_off), add);
    }
  }
  __device__ void put_signal(int peer, std::size_t dst_off, std::size_t src_off, std::size_t bytes,
                             std::size_t signal_off, uint64_t add) {
    put(peer, dst_off, src_off, bytes);
    signal(peer, signal_off, add);
  }
  __device__ void flush() {
    group_.sync();
    if (group_.leader()) {
      for (uint32_t i = 0; i < area_->pending; ++i) {
        EmulatedOp& op = area_->ops[i];
        if (op.src == nullptr || (op.src >= area_->snapshot && op.src < area_->snapshot + kEmulatedSnapshot)) continue;
        if (area_->snapshot_used + op.bytes > kEmulatedSnapshot) {
          deliver_one(i--);  // no room: delivered early (allowed), the slot now holds another op
          continue;
        }
        char* const copy = area_->snapshot + area_->snapshot_used;
        copy_bytes(copy, op.src, op.bytes, /*order=*/0);
        area_->snapshot_used += static_cast<uint32_t>(op.bytes);
        op.src = copy;
      }
    }
    group_.sync();
  }
  __device__ bool wait(DeviceView const& view, std::size_t signal_off, uint64_t least, int peer, WaitPhase phase) {
    return group_wait(group_, view, reinterpret_cast<uint64_t const*>(net_.windows[net_.rank] + signal_off), least,
                      peer, phase);
  }
  __device__ uint64_t read(std::size_t signal_off) const {
    return device::arch::load_acquire_sys_u64(reinterpret_cast<uint64_t const*>(net_.windows[net_.rank] + signal_off));
  }
  __device__ void close() {
    group_.sync();
    if (group_.leader()) deliver(-1);
    group_.sync();
  }

 private:
  __device__ uint32_t draw(uint32_t n) {
    uint64_t const stream = (static_cast<uint64_t>(net_.rank) << 32) ^ static_cast<uint64_t>(area_ - net_.areas);
    return transport::draw(net_.seed, stream, area_->draws++, n);
  }

  __device__ void enqueue(int peer, char* dst, char const* src, std::size_t bytes, uint64_t value) {
    if (area_->pending == kEmulatedOps) deliver_one(draw(kEmulatedOps));  // full: one arrives early (allowed)
    area_->ops[area_->pending++] = EmulatedOp{dst, src, bytes, value, peer, 0};
  }

  // Copies `bytes` in 16-byte pieces (8 for a value), starting at piece `order` and wrapping around, backwards when
  // order is odd: the pieces of a put arrive out of order.
  __device__ static void copy_bytes(char* dst, char const* src, std::size_t bytes, uint32_t order) {
    std::size_t const n = bytes / 16;
    for (std::size_t i = 0; i < n; ++i) {
      std::size_t const j = (order & 1u) ? (n - 1 - (i + order) % n) : (i + order) % n;
      reinterpret_cast<int4*>(dst)[j] = reinterpret_cast<int4 const*>(src)[j];
    }
  }

  // Delivers queued op i (removed from the queue; the last op takes its slot).
  __device__ void deliver_one(uint32_t i) {
    EmulatedOp const op = area_->ops[i];
    if (op.src == nullptr)
      *reinterpret_cast<uint64_t volatile*>(op.dst) = op.value;
    else
      copy_bytes(op.dst, op.src, op.bytes, net_.reorder ? draw(0x7fffffffu) : 0u);
    area_->ops[i] = area_->ops[--area_->pending];
  }

  // Delivers every queued put to `peer` (-1: every peer) after a seeded delay, in a seeded order, then makes them
  // visible at system scope before anything the caller does next (its signal).
  __device__ void deliver(int peer) {
    if (net_.max_delay_ns != 0) {
      uint64_t const until = device::arch::global_timer_ns() + draw(net_.max_delay_ns);
      while (device::arch::global_timer_ns() < until) __nanosleep(500);
    }
    while (true) {
      uint32_t matching = 0;
      for (uint32_t i = 0; i < area_->pending; ++i) matching += peer < 0 || area_->ops[i].peer == peer;
      if (matching == 0) break;
      uint32_t pick = net_.reorder ? draw(matching) : 0u;
      for (uint32_t i = 0; i < area_->pending; ++i) {
        if (peer >= 0 && area_->ops[i].peer != peer) continue;
        if (pick-- == 0) {
          deliver_one(i);
          break;
        }
      }
    }
    if (area_->pending == 0) area_->snapshot_used = 0;
    __threadfence_system();
  }

  Emulated const& net_;
  Group group_;
  EmulatedArea* area_;
};

}  // namespace ferry::transport
