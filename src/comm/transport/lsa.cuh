// The lsa transport: NVLink load/store through LSA pointers (every rank of one NVLink domain maps every peer's
// window). A put is the group's 16-byte stores into the peer's memory; a signal is a release add at system scope
// after the group's barrier, so it orders the group's stores before it (the barrier, then cumulativity of the
// release). With kLoadStore it also hands out the peers' windows for kernels that store from registers.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "comm/transport/group.cuh"
#include "comm/transport/transport.hpp"
#include "ferry/device_view.hpp"
#include "ferry/error.hpp"

namespace ferry::transport {

template <class Group>
class LsaEndpoint;

struct Lsa {
  static constexpr Kind kKind = Kind::lsa;
  static constexpr bool kLoadStore = true;

  // every rank's window by world rank, as addressable from this rank (null outside its load/store team); or, from
  // make_node_lsa, the windows of this rank's node by local index (rank and world then index that node)
  char* windows[kMaxCudaWorld];
  int32_t rank;
  int32_t world;

  template <class Group>
  __device__ __forceinline__ LsaEndpoint<Group> open(Group group, int /*endpoint*/ = 0) const {
    return LsaEndpoint<Group>(*this, group);
  }

  // Load/store capability: the base of `peer`'s window, and of this rank's.
  __device__ __forceinline__ char* window(int peer) const { return windows[peer]; }
  __device__ __forceinline__ char* local() const { return windows[rank]; }
  // A release store of `value` into `peer`'s word at `offset` (a word one writer owns: no counting needed).
  __device__ __forceinline__ void store_signal(int peer, std::size_t offset, uint64_t value) const {
    device::signal_set(reinterpret_cast<uint64_t*>(windows[peer] + offset), value);
  }
  // A release add into `peer`'s counter at `offset`, by the calling thread alone.
  __device__ __forceinline__ void add_signal(int peer, std::size_t offset, uint64_t add) const {
    device::signal_add(reinterpret_cast<uint64_t*>(windows[peer] + offset), add);
  }
};

template <class Group>
class LsaEndpoint {
 public:
  __device__ __forceinline__ LsaEndpoint(Lsa const& net, Group group) : net_(net), group_(group) {}

  __device__ __forceinline__ void put(int peer, std::size_t dst_off, std::size_t src_off, std::size_t bytes) const {
    device::copy_16B<false>(net_.windows[peer] + dst_off, net_.windows[net_.rank] + src_off, bytes, group_.rank(),
                            group_.size());
  }
  __device__ __forceinline__ void put_value(int peer, std::size_t dst_off, uint64_t value) const {
    if (group_.leader()) *reinterpret_cast<uint64_t volatile*>(net_.windows[peer] + dst_off) = value;
  }
  // The group's barrier orders its stores before the leader's release add.
  __device__ __forceinline__ void signal(int peer, std::size_t signal_off, uint64_t add) const {
    group_.sync();
    if (group_.leader()) net_.add_signal(peer, signal_off, add);
  }
  __device__ __forceinline__ void put_signal(int peer, std::size_t dst_off, std::size_t src_off, std::size_t bytes,
                                             std::size_t signal_off, uint64_t add) const {
    put(peer, dst_off, src_off, bytes);
    signal(peer, signal_off, add);
  }
  // Stores read their registers when issued: once every thread of the group passed its puts, the sources are free.
  __device__ __forceinline__ void flush() const { group_.sync(); }
  __device__ __forceinline__ bool wait(DeviceView const& view, std::size_t signal_off, uint64_t least, int peer,
                                       WaitPhase phase) const {
    return group_wait(group_, view, reinterpret_cast<uint64_t const*>(net_.windows[net_.rank] + signal_off), least,
                      peer, phase);
  }
  __device__ __forceinline__ uint64_t read(std::size_t signal_off) const {
    return device::arch::load_acquire_sys_u64(reinterpret_cast<uint64_t const*>(net_.windows[net_.rank] + signal_off));
  }
  __device__ __forceinline__ void close() const {}

 private:
  Lsa const& net_;
  Group group_;
};

// The lsa transport over a communicator's region (its SymmetricView). A world past kMaxCudaWorld is refused before
// (check_cuda_world); here it is an invariant.
inline Lsa make_lsa(SymmetricView const& view, int rank, int world) {
  FERRY_CHECK(world <= kMaxCudaWorld, "make_lsa: world=", world, " is more than the ", kMaxCudaWorld,
              " ranks (kMaxCudaWorld) the cuda kernels address by world rank");
  Lsa net{};
  for (int r = 0; r < world; ++r) net.windows[r] = view.peer(r);
  net.rank = rank;
  net.world = world;
  return net;
}

// The lsa transport over the ranks of this rank's node only (`local` ranks a node, a part of its load/store team),
// by local index: window(l) is the node's l-th rank's, rank is this rank's local index. What low-latency mode's
// kernels across nodes hold (a world of up to kMaxWorld ranks; ll/params.cuh "Wider worlds").
inline Lsa make_node_lsa(SymmetricView const& view, int rank, int local) {
  FERRY_CHECK(local >= 1 && local <= kMaxCudaWorld, "make_node_lsa: local=", local, " is outside [1, ", kMaxCudaWorld,
              "]");
  int const first = rank / local * local;
  Lsa net{};
  for (int l = 0; l < local; ++l) {
    net.windows[l] = view.peer(first + l);
    FERRY_CHECK(net.windows[l] != nullptr, "make_node_lsa: rank ", first + l, " of rank ", rank,
                "'s node is outside its load/store team");
  }
  net.rank = rank - first;
  net.world = local;
  return net;
}

}  // namespace ferry::transport
