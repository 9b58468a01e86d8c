// The gin transport: the seam's calls (transport.hpp) over NCCL's GPU-initiated networking (nccl_device/gin.h), the
// transport for peers that are not load/store reachable (other nodes). Every call is one GIN operation on the
// endpoint's GIN context, issued by the group's leader after the group's barrier (NCCL's Coop does both):
//  - put / put_value: ncclGin::put / putValue from this rank's window into the peer's (the same window: symmetric);
//  - signal: ncclGin::signal with a strong signal add (put_signal: the put carries it). A strong signal becomes
//    visible at the peer only after every earlier put of the same context to that peer has settled there, which is
//    the seam's promise because an endpoint issues everything on one context;
//  - flush: ncclGin::flush, the group's puts have read their sources (nothing about arrival);
//  - wait: the leader polls ncclGin::readSignal (acquire), bounded like every device wait; the group's barrier then
//    extends the acquire to the group.
// Counters are GIN signals, not window words: the Gin maps the 8-byte words of its signal range onto GIN signal
// ids (offset signals_off + 8 i is signal first_signal + i), a range of the device communicator's signals that the
// communicator handed to this region's owner (SignalRanges) and reset.
// docs/gin.md lists each GIN call and guarantee relied on, with NCCL's documentation section, for a cluster run.
// Load/store capability: none (kLoadStore is false); local() is this rank's own window, for writing sources and
// reading what arrived.
#pragma once

#include <nccl.h>
#include <nccl_device.h>

#include <cstddef>
#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/device/signal.cuh"
#include "comm/transport/group.cuh"
#include "comm/transport/transport.hpp"
#include "ferry/device_view.hpp"

#if !defined(NCCL_VERSION_CODE) || NCCL_VERSION_CODE < 22807
#error "the gin transport needs NCCL's device API with GIN: NCCL 2.28.7 or newer headers (FERRY_NCCL_ROOT)"
#endif
// scripts/check-gin-headers.sh names the headers it means: a compile that picked up others (nvcc's own include folder
// holds an nccl.h too) must fail, not pass against the wrong version.
#if defined(FERRY_EXPECT_NCCL_VERSION_CODE)
static_assert(NCCL_VERSION_CODE == FERRY_EXPECT_NCCL_VERSION_CODE,
              "compiled against other NCCL headers than asked for");
#endif

namespace ferry::transport {

// NOTE: NCCL 2.30.5 split signals into strong (visibility implies every earlier put of the context to the peer) and
// weak (only the put it rides on); the older SignalAdd took its strength from the device communicator since then.
// Before 2.30.5 every signal was strong.
#if NCCL_VERSION_CODE >= 23005
using GinSignalAdd = ncclGin_StrongSignalAdd;
#else
using GinSignalAdd = ncclGin_SignalAdd;
#endif

// The NCCL cooperative group of each of the seam's groups (the threads that call a GIN operation together).
template <class Group>
struct GinCoop;
template <>
struct GinCoop<Thread> {
  using type = ncclCoopThread;
};
template <>
struct GinCoop<Warp> {
  using type = ncclCoopWarp;
};
template <>
struct GinCoop<Cta> {
  using type = ncclCoopCta;
};

template <class Group>
class GinEndpoint;

struct Gin {
  static constexpr Kind kKind = Kind::gin;
  static constexpr bool kLoadStore = false;

  // NOTE: by value: ncclGin keeps a reference to its device communicator, so the copy in the kernel's Params (alive
  // for the whole kernel) is the one the endpoints refer to.
  ncclDevComm comm;
  ncclWindow_t window;      // the region's window, on every rank (the source and destination of every put)
  char* local_window;       // this rank's window, as addressable from this rank
  std::size_t signals_off;  // the signal range: offset signals_off + 8 i names GIN signal first_signal + i
  uint32_t first_signal;
  uint32_t num_signals;  // ... i < num_signals
  int32_t num_contexts;  // GIN contexts of `comm` (>= 1)
  int32_t rank;
  int32_t world;

  // `endpoint` picks the GIN context (endpoint % num_contexts): groups that run at once should use different
  // endpoints (e.g. the global warp index) so that their traffic spreads over the contexts.
  template <class Group>
  __device__ __forceinline__ GinEndpoint<Group> open(Group group, int endpoint = 0) const {
    return GinEndpoint<Group>(*this, group, endpoint % num_contexts);
  }

  __device__ __forceinline__ char* local() const { return local_window; }
  // The GIN signal that the counter offset `signal_off` names. The offset must be in the signal range: one outside
  // it is a protocol bug and names a signal that is not this Gin's.
  __device__ __forceinline__ ncclGinSignal_t signal_index(std::size_t signal_off) const {
    return static_cast<ncclGinSignal_t>(first_signal + (signal_off - signals_off) / sizeof(uint64_t));
  }
};

template <class Group>
class GinEndpoint {
  using Coop = typename GinCoop<Group>::type;

 public:
  __device__ __forceinline__ GinEndpoint(Gin const& net, Group group, int context)
      : net_(net), gin_(net.comm, context), group_(group) {}

  // NCCL's Coop barrier, then the leader issues with a release at device scope (the put's default), so the group's
  // stores into the source reach the network card's read.
  __device__ __forceinline__ void put(int peer, std::size_t dst_off, std::size_t src_off, std::size_t bytes) const {
    gin_.put(ncclTeamWorld(net_.comm), peer, net_.window, dst_off, net_.window, src_off, bytes, ncclGin_None{},
             ncclGin_None{}, Coop{});
  }
  __device__ __forceinline__ void put_value(int peer, std::size_t dst_off, uint64_t value) const {
    gin_.putValue(ncclTeamWorld(net_.comm), peer, net_.window, dst_off, value, ncclGin_None{}, Coop{});
  }
  // A zero-byte put that carries the signal: ordered after this context's earlier puts to `peer` (strong).
  __device__ __forceinline__ void signal(int peer, std::size_t signal_off, uint64_t add) const {
    gin_.signal(ncclTeamWorld(net_.comm), peer, GinSignalAdd{net_.signal_index(signal_off), add}, Coop{});
  }
  __device__ __forceinline__ void put_signal(int peer, std::size_t dst_off, std::size_t src_off, std::size_t bytes,
                                             std::size_t signal_off, uint64_t add) const {
    gin_.put(ncclTeamWorld(net_.comm), peer, net_.window, dst_off, net_.window, src_off, bytes,
             GinSignalAdd{net_.signal_index(signal_off), add}, ncclGin_None{}, Coop{});
  }
  __device__ __forceinline__ void flush() const { gin_.flush(Coop{}); }
  __device__ __forceinline__ bool wait(DeviceView const& view, std::size_t signal_off, uint64_t least, int peer,
                                       WaitPhase phase) const {
    bool ok = true;
    if (group_.leader()) ok = wait_leader(view, net_.signal_index(signal_off), least, peer, phase);
    return group_.all(ok);
  }
  // ncclGin::readSignal: acquire at system scope, as wait_leader's polls.
  __device__ __forceinline__ uint64_t read(std::size_t signal_off) const {
    return gin_.readSignal(net_.signal_index(signal_off));
  }
  // Nothing is held by the endpoint: GIN owns the queues, and puts nobody signalled arrive when the network delivers.
  __device__ __forceinline__ void close() const {}

 private:
  // ncclGin::waitSignal has no bound; this is its loop with FERRY_TIMEOUT_S and the error block (signal.cuh).
  __device__ bool wait_leader(DeviceView const& view, ncclGinSignal_t signal, uint64_t least, int peer,
                              WaitPhase phase) const {
    uint64_t value = gin_.readSignal(signal);  // acquire (system scope): what the signal covers is visible after it
    if (value >= least) return true;
    uint64_t const start = device::arch::global_timer_ns();
    for (uint32_t spins = 1;; ++spins) {
      value = gin_.readSignal(signal);
      if (value >= least) return true;
      if ((spins & 255u) == 0u) {
        if (device::device_failed(view)) return device::stop_waiting(view, peer, value, least);
        if (device::arch::global_timer_ns() - start > view.timeout_ns) {
          device::record_timeout(view, peer, phase, least, value);
          return false;
        }
      }
    }
  }

  Gin const& net_;
  ncclGin gin_;
  Group group_;
};

}  // namespace ferry::transport
