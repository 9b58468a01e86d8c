// Rank masking in low-latency mode (EpConfig::rank_masking; docs/internode.md "Rank masking"): the agreement that
// opens every call of a leg, a kernel of one warp launched on the leg's stream before the leg's kernel (its send half
// with the hook), so a captured graph replays it with the mask of the moment. Lane s speaks for rank s.
//  1. arrival: (epoch << 32 | this rank's request) into this rank's arrive word on every live rank (release);
//  2. wait for the live ranks' arrivals of this epoch, all lanes against one deadline, FERRY_TIMEOUT_S from the
//     kernel's start: the ranks seen are this rank's view. A word of a later epoch means that rank is past this
//     agreement without this rank: this rank is masked;
//  3. verdict: (epoch << 32 | view) into this rank's verdict word of the epoch's parity on every live rank (release;
//     a rank it did not see reads it when it comes);
//  4. wait for the verdicts of the ranks it saw (they arrived, so they answer; one that does not within
//     FERRY_TIMEOUT_S died inside the agreement: a timeout, recorded, which fails the communicator);
//  5. the ranks of the call are the intersection of those verdicts: the views are nested (each holds every rank that
//     arrived before its own deadline), so every rank computes the same set, the view of the first to arrive. The
//     requests of the ranks in it are applied too (their union). A rank left out, or asked for, is masked on every
//     rank; this rank, when it is one of them, records why (LlMaskWords::self, and the host's word) and its leg
//     kernels return at once from then on.
// Parities: a rank one epoch ahead writes the other verdict slot; two ahead only past an agreement that left this
// rank out (it would have waited for this rank's verdict), which step 2 or 4 then sees as a later epoch.
// Across nodes (Net: the network to the ranks of other nodes) a word to a rank of another node is a put of the value
// through the network, then +1 on that rank's counter of this source (arrive_signals / verdict_signals: the signal
// covers the put); a lane waits for its rank's counter to reach the epoch (one signal per agreement the source took
// part in; clear_mask sets the counters to the epoch every rank starts from), then reads the word the put brought.
// The words and the rules are the same, so the ranks of every node compute the same set.
#pragma once

#include <cstdint>

#include "comm/device/signal.cuh"
#include "comm/transport/lsa.cuh"
#include "ep/cuda/ll/params.cuh"
#include "ep/cuda/params.cuh"
#include "ep/ll_mask_words.hpp"
#include "ferry/device_view.hpp"

namespace ferry::cuda_ll {

using detail::LlMaskLeg;
using detail::LlMaskSelf;

struct LlAgreementParams {
  DeviceView view;
  transport::Lsa net;  // the ranks of this node (load/store)
  std::size_t arrive;  // the area's offsets in every rank's region (cuda_ep::ll_mask_area)
  std::size_t verdict;
  std::size_t arrive_signals;  // across nodes: [world] counters of the words put by the ranks of other nodes
  std::size_t verdict_signals;
  int local;  // ranks per node (world on one node)
  cuda_ep::DeviceState* state;
  detail::LlMaskHost* host;  // mapped: the request (host), this rank's LlMaskSelf (written here when it is masked)
  LlMaskLeg leg;
  uint64_t const* send_seq;  // the leg's per-CTA sequence words (CTA 0's): the call this agreement opens is +1
};

inline constexpr int kAgreementThreads = 32;

// This rank's word for rank s (lane s): into s's `words` at this rank's index (plus `at`, the verdict's parity
// offset). On this node a release store; across nodes a put of the value, then +1 on s's counter of this rank.
template <class Net>
__device__ __forceinline__ void send_word(LlAgreementParams const& p, Net const& network, int s, std::size_t words,
                                          std::size_t signals, uint64_t word) {
  int const rank = p.view.rank;
  if constexpr (kAcrossNodes<Net>) {
    if (s / p.local != rank / p.local) {
      auto ep = network.open(transport::Thread{}, s);
      ep.put_value(s, words + static_cast<std::size_t>(rank) * sizeof(uint64_t), word);
      ep.signal(s, signals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
      ep.close();
      return;
    }
  }
  device::signal_set(reinterpret_cast<uint64_t*>(p.net.window(s) + words) + rank, word);
}

// Lane s waits until rank s's word in this rank's `words` holds `epoch` or a later one, until start_ns + the bound.
// On this node the word itself tells (its epoch); across nodes s's counter of this rank reaching `epoch` says that
// the put of this epoch's word has arrived, then the word is read. Returns whether it did, with the word in *word.
template <class Net>
__device__ __forceinline__ bool wait_word(LlAgreementParams const& p, Net const& network, int s, std::size_t words,
                                          std::size_t signals, uint64_t epoch, uint64_t start_ns, uint64_t bound_ns,
                                          uint64_t* word) {
  auto const* at = reinterpret_cast<uint64_t const*>(p.net.local() + words) + s;
  if constexpr (kAcrossNodes<Net>) {
    if (s / p.local != p.view.rank / p.local) {
      auto ep = network.open(transport::Thread{}, s);
      while (true) {
        if (ep.read(signals + static_cast<std::size_t>(s) * sizeof(uint64_t)) >= epoch) {
          *word = device::arch::load_acquire_sys_u64(at);
          return true;
        }
        if (device::arch::global_timer_ns() - start_ns > bound_ns) return false;
      }
    }
  }
  while (true) {
    *word = device::arch::load_acquire_sys_u64(at);
    if ((*word >> 32) >= epoch) return true;
    if (device::arch::global_timer_ns() - start_ns > bound_ns) return false;
  }
}

// This rank learned that it is masked: why, at which call, what it saw; the host's word last (after a system fence,
// so a host that sees it reads the rest after a sync).
__device__ __forceinline__ void mask_self(LlAgreementParams const& p, LlMaskSelf why, uint64_t epoch, uint32_t view,
                                          uint32_t lost, int by) {
  detail::LlMaskWords& m = p.state->ll.mask;
  m.epoch = epoch;
  m.self = static_cast<uint32_t>(why);
  m.self_epoch = epoch;
  m.self_call = p.send_seq[0] + 1;
  m.self_leg = static_cast<uint32_t>(p.leg);
  m.self_view = view;
  m.self_lost = lost;
  m.self_by = by;
  __threadfence_system();
  *reinterpret_cast<uint32_t volatile*>(&p.host->self) = static_cast<uint32_t>(why);
}

// Net: OneNode (every rank on this node), or the network to the ranks of other nodes (NetParams: Emulated, Gin).
template <class Net = OneNode>
__global__ void __launch_bounds__(kAgreementThreads, 1) ll_agreement_kernel(NetParams<LlAgreementParams, Net> const p) {
  int const lane = static_cast<int>(threadIdx.x);
  int const world = p.view.world;
  int const rank = p.view.rank;
  decltype(auto) network = network_in<Net>(p);
  detail::LlMaskWords& m = p.state->ll.mask;
  if (m.self != 0) return;  // masked already: nothing to agree on (the leg's kernel returns too)
  uint64_t const start = device::arch::global_timer_ns();
  uint64_t const epoch = m.epoch + 1;
  uint32_t const all = world >= 32 ? 0xffffffffu : (1u << world) - 1u;
  uint32_t const live = all & ~m.masked;
  uint32_t const mine = 1u << rank;
  uint32_t const request = __shfl_sync(0xffffffffu, *reinterpret_cast<uint32_t const volatile*>(&p.host->request), 0);
  bool const peer = lane < world && ((live >> lane) & 1u) != 0;
  std::size_t const parity = static_cast<std::size_t>(epoch & 1) * world * sizeof(uint64_t);

  // 1. arrival (release: the leg's rows come after the verdicts, which order them)
  if (peer) send_word(p, network, lane, p.arrive, p.arrive_signals, epoch << 32 | request);
  // 2. the live ranks' arrivals, one deadline for all
  uint64_t arrival = 0;
  bool const seen =
      peer && wait_word(p, network, lane, p.arrive, p.arrive_signals, epoch, start, p.view.timeout_ns, &arrival);
  uint32_t const present = __ballot_sync(0xffffffffu, seen);
  uint32_t const ahead = __ballot_sync(0xffffffffu, seen && (arrival >> 32) > epoch);
  if (ahead != 0) {
    if (lane == 0) mask_self(p, LlMaskSelf::ahead, epoch, (all & ~live) | mine, 0, __ffs(ahead) - 1);
    return;
  }
  // 3. verdict
  if (peer) send_word(p, network, lane, p.verdict + parity, p.verdict_signals, epoch << 32 | present);
  // 4. the verdicts of the ranks seen (bounded; a rank silent here died inside the agreement)
  uint64_t verdict = 0;
  bool const heard =
      ((present >> lane) & 1u) != 0 && wait_word(p, network, lane, p.verdict + parity, p.verdict_signals, epoch,
                                                 device::arch::global_timer_ns(), p.view.timeout_ns, &verdict);
  uint32_t const silent = present & ~__ballot_sync(0xffffffffu, heard);
  if (silent != 0) {
    if (((silent >> lane) & 1u) != 0)
      device::record_timeout(p.view, lane,
                             p.leg == LlMaskLeg::dispatch ? WaitPhase::ll_dispatch : WaitPhase::ll_combine, epoch << 32,
                             verdict);
    if (lane == 0) m.epoch = epoch;
    return;
  }
  uint32_t const later = __ballot_sync(0xffffffffu, heard && (verdict >> 32) > epoch);
  if (later != 0) {
    if (lane == 0) mask_self(p, LlMaskSelf::ahead, epoch, (all & ~live) | mine, 0, __ffs(later) - 1);
    return;
  }
  // 5. the ranks of the call, and the requests of those ranks
  uint32_t const agreed = present & __reduce_and_sync(0xffffffffu, heard ? static_cast<uint32_t>(verdict) : all);
  uint32_t const asked =
      __reduce_or_sync(0xffffffffu, ((agreed >> lane) & 1u) != 0 ? static_cast<uint32_t>(arrival) : 0u) & agreed;
  uint32_t const lost = live & ~agreed;
  if (lane != 0) return;
  if ((lost & mine) != 0) {
    mask_self(p, LlMaskSelf::timeout, epoch, (all & ~agreed) | mine, lost, -1);
  } else if ((asked & mine) != 0) {
    mask_self(p, LlMaskSelf::asked, epoch, (all & ~live) | lost | asked, asked, -1);
  } else {
    m.epoch = epoch;
    m.masked |= lost | asked;
    if (p.leg == LlMaskLeg::dispatch)
      m.last_dispatch_entries = 0;
    else
      m.last_combine_entries = 0;
  }
}

// clear_mask (every rank, its stream idle, before a barrier of the whole world): the counters of both legs and the
// agreements put where every rank now starts (the largest of everyone's), the arrival counters of this rank's region
// with them (a counter holds num_ctas per call of its source) for the sources of this node (the other nodes'
// counters are the network's: realign_network_counters puts them in step before this), and the mask and its counts
// gone.
struct LlMaskResetParams {
  cuda_ep::DeviceState* state;
  uint64_t* dispatch_arrivals;  // this rank's region: [world]
  uint64_t* combine_arrivals;
  detail::LlMaskHost* host;
  int world;
  int rank;
  int local;  // ranks per node (world on one node)
  int num_ctas;
  detail::LlCallCounters to;
};

__global__ void __launch_bounds__(cuda_ep::kMaxLlCtas, 1) ll_mask_reset_kernel(LlMaskResetParams const p) {
  int const tid = static_cast<int>(threadIdx.x);
  cuda_ep::DeviceState& s = *p.state;
  s.ll.dispatch_send_seq[tid] = p.to.dispatch_seq;
  s.ll.dispatch_recv_seq[tid] = p.to.dispatch_seq;
  s.ll.combine_send_seq[tid] = p.to.combine_seq;
  s.ll.combine_recv_seq[tid] = p.to.combine_seq;
  uint64_t const per_call = static_cast<uint64_t>(p.num_ctas);
  if (tid < p.world && tid / p.local == p.rank / p.local) {
    p.dispatch_arrivals[tid] = p.to.dispatch_seq * per_call;
    p.combine_arrivals[tid] = p.to.combine_seq * per_call;
  }
  if (tid == 0) {
    int8_t* const entry_rank = s.ll.mask.entry_rank;
    s.ll.mask = detail::LlMaskWords{};
    s.ll.mask.entry_rank = entry_rank;
    s.ll.mask.epoch = p.to.epoch;
    s.num_tokens = 0;  // the dispatch before the clear is forgotten (dispatch again before a combine)
    p.host->request = 0;
    p.host->self = 0;
  }
}

// clear_mask across nodes: the counters that the ranks of other nodes add to (the legs' arrivals, the agreement's
// counters) belong to the network, which has no remote "set" (GIN's signals only add), so they are put back in step
// through it, in three steps with the host's allgather between the first two:
//  1. read: every rank reads its counters of each source of another node (the seam's read);
//  2. add: every source adds to each rank of another node what that rank's counters of it lack of the targets (the
//     largest call counters of everyone, as the reset kernel sets the local ones) with one signal each;
//  3. wait: every rank waits, bounded, until its counters of the other nodes' sources reach the targets.
// Thread s (of one warp) speaks for rank s; the ranks of this node are the reset kernel's (load/store).
inline constexpr int kNetworkCounters = 4;  // dispatch arrivals, combine arrivals, agreement arrivals, verdicts

struct LlCounterParams {
  DeviceView view;
  int local;                                      // ranks per node
  std::size_t counters[kNetworkCounters];         // offsets of the four [world] arrays (by source)
  uint64_t target[kNetworkCounters];              // what every counter must hold
  uint64_t* read;                                 // step 1: [kNetworkCounters][world] this rank's counters
  uint64_t add[kNetworkCounters][kMaxCudaWorld];  // step 2: what to add to each rank's counters of this one
};
// legs: the network of the legs' counters (a Gin's range is the layout's), agreement: the agreement's (LlMaskArea).
template <class Net>
struct LlCounterNets : LlCounterParams {
  Net legs;
  Net agreement;
};

enum class LlCounterStep { read, add, wait };

template <class Net, LlCounterStep kStep>
__global__ void __launch_bounds__(kAgreementThreads, 1) ll_counters_kernel(LlCounterNets<Net> const p) {
  int const s = static_cast<int>(threadIdx.x);
  int const rank = p.view.rank;
  if (s >= p.view.world || s / p.local == rank / p.local) return;
  for (int k = 0; k < kNetworkCounters; ++k) {
    auto ep = (k < 2 ? p.legs : p.agreement).open(transport::Thread{}, s);
    if constexpr (kStep == LlCounterStep::read) {
      p.read[static_cast<std::size_t>(k) * p.view.world + s] =
          ep.read(p.counters[k] + static_cast<std::size_t>(s) * sizeof(uint64_t));
    } else if constexpr (kStep == LlCounterStep::add) {
      if (p.add[k][s] != 0)
        ep.signal(s, p.counters[k] + static_cast<std::size_t>(rank) * sizeof(uint64_t), p.add[k][s]);
      ep.close();
    } else {
      if (!ep.wait(p.view, p.counters[k] + static_cast<std::size_t>(s) * sizeof(uint64_t), p.target[k], s,
                   WaitPhase::clear_mask))
        return;
    }
  }
}

}  // namespace ferry::cuda_ll
