// Rank masking in low-latency mode (EpConfig::rank_masking; docs/internode.md "Rank masking"): the agreement that
// opens every call of a leg, a kernel of one warp launched on the leg's stream before the leg's kernel (its send half
// with the hook), so a captured graph replays it with the mask of the moment. Lane s speaks for rank s. The protocol
// is the cpu backend's (src/ep/cpu/cpu_ep.cpp, agree()), word for word:
//  1. arrival: (epoch << 32 | this rank's request) into this rank's arrive word on every live rank (release);
//  2. wait for the live ranks' arrivals of this epoch, all lanes against one deadline, FERRY_TIMEOUT_S from the
//     kernel's start: the ranks seen are this rank's view, its first estimate of the ranks of the call. A word of a
//     later epoch means that rank is past this agreement without this rank: this rank is masked;
//  3. rounds of estimates (2, 3, ...): this rank's estimate (tag: epoch << 1 | decided) into its word of the round
//     and the epoch's parity on every live rank; then the estimates of the round from the ranks it still hears from,
//     or a decision (a word of this round or the next marked decided), until the round's deadline (absolute, from
//     the kernel's start: round x FERRY_TIMEOUT_S plus half a timeout per round before it, so that a rank that
//     arrived up to a timeout later is never taken for a dead one). A decision is adopted at once; else the estimate
//     becomes the intersection of those heard, less the ranks not heard (they died), and a round in which every rank
//     waited for was heard decides (the next round's word says so, and the rank goes on). A rank that died while
//     writing a round (its words reached some ranks and not others) costs one more round; past kMaskEstimateRounds the
//     ranks could disagree: a timeout, recorded, which fails the communicator;
//  4. the ranks of the call are the decision, the same on every rank that stays. The requests of the ranks in it are
//     applied too (their union). A rank left out, or asked for, is masked on every rank; this rank, when it is one of
//     them, records why (LlMaskWords::self, and the host's word) and its leg kernels return at once from then on.
// Parities: a rank one epoch ahead writes the other slots; two ahead only past an agreement that left this rank out,
// which step 2 or 3 then sees as a later epoch. Epochs in words are compared modulo 2^32 (arrivals) and 2^31
// (estimates), so they wrap around safely: ranks in step are at most two agreements apart.
// Across nodes (Net: the network to the ranks of other nodes) a word to a rank of another node is a put of the value
// through the network, then a signal on that rank's counter of this source that covers the put: the arrivals' +1
// (one per agreement the source took part in), an estimate's the difference to the epoch (LlMaskWords::signaled),
// so a round's counter holds the agreement of its last word; clear_mask sets every counter to the epoch every rank
// starts from. A lane waits for its rank's counter to reach the epoch, then reads the word the put brought. The words
// and the rules are the same, so the ranks of every node compute the same set.
#pragma once

#include <cstdint>

#include "comm/device/signal.cuh"
#include "comm/transport/lsa.cuh"
#include "ep/cuda/ll/params.cuh"
#include "ep/cuda/params.cuh"
#include "ep/ll_mask_words.hpp"
#include "ferry/device_view.hpp"

namespace ferry::cuda_ll {

using detail::kMaskEstimateRounds;
using detail::kMaskEstimateSlots;
using detail::LlMaskLeg;
using detail::LlMaskSelf;

struct LlAgreementParams {
  DeviceView view;
  transport::Lsa net;  // the ranks of this node (load/store)
  std::size_t arrive;  // the area's offsets in every rank's region (cuda_ep::ll_mask_area)
  std::size_t estimates;
  std::size_t arrive_signals;  // across nodes: counters of the words put by the ranks of other nodes
  std::size_t estimate_signals;
  int local;  // ranks per node (world on one node)
  cuda_ep::DeviceState* state;
  detail::LlMaskHost* host;  // mapped: the request (host), this rank's LlMaskSelf (written here when it is masked)
  LlMaskLeg leg;
  uint64_t const* send_seq;  // the leg's per-CTA sequence words (CTA 0's): the call this agreement opens is +1
};

inline constexpr int kAgreementThreads = 32;

// How far the epoch of a word is from `epoch`: > 0 a later agreement, 0 this one, < 0 an earlier one (or none yet).
__device__ __forceinline__ int32_t arrival_ahead(uint64_t word, uint64_t epoch) {
  return static_cast<int32_t>(static_cast<uint32_t>(word >> 32) - static_cast<uint32_t>(epoch));
}
__device__ __forceinline__ int32_t estimate_ahead(uint64_t word, uint64_t epoch) {
  // the tag is epoch << 1 | decided in 32 bits: compare the 31-bit epochs, sign-extended from bit 30
  uint32_t const seen = static_cast<uint32_t>(word >> 33);
  return static_cast<int32_t>((seen - static_cast<uint32_t>(epoch)) << 1) >> 1;
}
__device__ __forceinline__ uint64_t estimate_word(uint64_t epoch, bool decided, uint32_t ranks) {
  uint32_t const tag = static_cast<uint32_t>(epoch) << 1 | (decided ? 1u : 0u);
  return static_cast<uint64_t>(tag) << 32 | ranks;
}
__device__ __forceinline__ bool estimate_decided(uint64_t word) {
  return ((word >> 32) & 1u) != 0;
}

// Offsets of this round's words and counters (round 2.. : slot round - 2) in every rank's region.
__device__ __forceinline__ std::size_t estimate_words(LlAgreementParams const& p, int round, uint64_t epoch) {
  std::size_t const slot = static_cast<std::size_t>(round - 2) * 2 + static_cast<std::size_t>(epoch & 1);
  return p.estimates + slot * static_cast<std::size_t>(p.view.world) * sizeof(uint64_t);
}
__device__ __forceinline__ std::size_t estimate_counters(LlAgreementParams const& p, int round) {
  return p.estimate_signals + static_cast<std::size_t>(round - 2) * p.view.world * sizeof(uint64_t);
}

// This rank's word for rank s (lane s): into s's `words` at this rank's index. On this node a release store; across
// nodes a put of the value, then `add` on s's counter of this rank (at `signals`), which covers the put.
template <class Net>
__device__ __forceinline__ void send_word(LlAgreementParams const& p, Net const& network, int s, std::size_t words,
                                          std::size_t signals, uint64_t word, uint64_t add) {
  int const rank = p.view.rank;
  if constexpr (kAcrossNodes<Net>) {
    if (s / p.local != rank / p.local) {
      auto ep = network.open(transport::Thread{}, s);
      ep.put_value(s, words + static_cast<std::size_t>(rank) * sizeof(uint64_t), word);
      ep.signal(s, signals + static_cast<std::size_t>(rank) * sizeof(uint64_t), add);
      ep.close();
      return;
    }
  }
  device::signal_set(reinterpret_cast<uint64_t*>(p.net.window(s) + words) + rank, word);
}

// Whether rank s's word in this rank's `words` may be read: on this node always (the word carries its epoch); across
// nodes once s's counter of this rank reaches `epoch` (the put of this epoch's word, or of a later one, has landed).
template <class Net>
__device__ __forceinline__ bool word_landed(LlAgreementParams const& p, Net const& network, int s, std::size_t signals,
                                            uint64_t epoch) {
  if constexpr (kAcrossNodes<Net>) {
    if (s / p.local != p.view.rank / p.local) {
      auto ep = network.open(transport::Thread{}, s);
      return ep.read(signals + static_cast<std::size_t>(s) * sizeof(uint64_t)) >= epoch;
    }
  }
  return true;
}

__device__ __forceinline__ uint64_t read_word(LlAgreementParams const& p, std::size_t words, int s) {
  return device::arch::load_acquire_sys_u64(reinterpret_cast<uint64_t const*>(p.net.local() + words) + s);
}

// Lane s waits until rank s's arrival word in this rank holds `epoch` or a later one, until start_ns + the bound.
// Returns whether it did, with the word in *word.
template <class Net>
__device__ __forceinline__ bool wait_arrival(LlAgreementParams const& p, Net const& network, int s, uint64_t epoch,
                                             uint64_t start_ns, uint64_t bound_ns, uint64_t* word) {
  while (true) {
    if (word_landed(p, network, s, p.arrive_signals, epoch)) {
      *word = read_word(p, p.arrive, s);
      if (arrival_ahead(*word, epoch) >= 0) return true;
    }
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

// What one round of estimates brought (step 3): the ranks heard and the intersection of their estimates, or a
// decision to adopt, or the rank that is past this agreement (ahead >= 0: this rank is masked).
struct RoundRead {
  uint32_t heard = 0;
  uint32_t meet = 0xffffffffu;
  bool adopted = false;
  uint32_t decision = 0;
  int ahead = -1;
};

// 3b. Lane s reads rank s's estimate of `round` (and its word of the next round, where a decision shows first) until
//     every rank in `alive` was heard, a decision or a later epoch is seen, or the deadline.
template <class Net>
__device__ RoundRead read_round(LlAgreementParams const& p, Net const& network, int round, uint64_t epoch,
                                uint32_t alive, uint64_t deadline_ns) {
  int const lane = static_cast<int>(threadIdx.x);
  bool const mine = ((alive >> lane) & 1u) != 0;
  bool heard = false;
  uint32_t view = 0xffffffffu;
  while (true) {
    bool ahead = false;
    bool adopt = false;
    uint32_t decision = 0;
    for (int r = round; mine && r <= round + 1 && r <= kMaskEstimateSlots + 1; ++r) {
      if ((r == round && heard) || !word_landed(p, network, lane, estimate_counters(p, r), epoch)) continue;
      uint64_t const word = read_word(p, estimate_words(p, r, epoch), lane);
      int32_t const ahead_by = estimate_ahead(word, epoch);
      ahead = ahead || ahead_by > 0;
      if (ahead_by != 0) continue;
      if (r == round) {
        heard = true;
        view = static_cast<uint32_t>(word);
      }
      if (estimate_decided(word)) {  // every decision of one agreement is the same set
        adopt = true;
        decision = static_cast<uint32_t>(word);
      }
    }
    RoundRead out;
    uint32_t const aheads = __ballot_sync(0xffffffffu, ahead);
    uint32_t const adopters = __ballot_sync(0xffffffffu, adopt);
    out.heard = __ballot_sync(0xffffffffu, heard) & alive;
    if (aheads != 0) {
      out.ahead = __ffs(aheads) - 1;
      return out;
    }
    if (adopters != 0) {
      out.adopted = true;
      out.decision = __shfl_sync(0xffffffffu, decision, __ffs(adopters) - 1);
      return out;
    }
    if (out.heard == alive || device::arch::global_timer_ns() > deadline_ns) {
      out.meet = __reduce_and_sync(0xffffffffu, heard ? view : 0xffffffffu);
      return out;
    }
  }
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
  uint64_t const timeout = p.view.timeout_ns;
  uint64_t const epoch = m.epoch + 1;
  uint32_t const all = world >= 32 ? 0xffffffffu : (1u << world) - 1u;
  uint32_t const live = all & ~m.masked;
  uint32_t const mine = 1u << rank;
  uint32_t const request = __shfl_sync(0xffffffffu, *reinterpret_cast<uint32_t const volatile*>(&p.host->request), 0);
  bool const peer = lane < world && ((live >> lane) & 1u) != 0;

  // 1. arrival (release: the leg's rows come after the agreement, which orders them)
  if (peer) send_word(p, network, lane, p.arrive, p.arrive_signals, epoch << 32 | request, 1);
  // 2. the live ranks' arrivals, one deadline for all: this rank's view, its first estimate
  uint64_t arrival = 0;
  bool const seen = peer && wait_arrival(p, network, lane, epoch, start, timeout, &arrival);
  uint32_t const present = __ballot_sync(0xffffffffu, seen);
  uint32_t const ahead = __ballot_sync(0xffffffffu, seen && arrival_ahead(arrival, epoch) > 0);
  if (ahead != 0) {
    if (lane == 0) mask_self(p, LlMaskSelf::ahead, epoch, (all & ~live) | mine, 0, __ffs(ahead) - 1);
    return;
  }
  // 3. rounds of estimates, until this rank decides or adopts a decision
  uint32_t estimate = present;
  uint32_t alive = present & ~mine;  // the ranks it still hears from
  bool decided = false;
  for (int round = 2;; ++round) {
    // a. this rank's estimate into every live rank; a rank that decided writes it once more, marked, and goes on
    if (peer && lane != rank) {
      uint64_t add = 0;
      if constexpr (kAcrossNodes<Net>) {
        add = epoch - m.signaled[round - 2][lane];
        m.signaled[round - 2][lane] = epoch;
      }
      send_word(p, network, lane, estimate_words(p, round, epoch), estimate_counters(p, round),
                estimate_word(epoch, decided, estimate), add);
    }
    if (decided) break;
    // NOTE: one round more than the slots hold: more ranks died inside this agreement than it takes, and the ranks
    // may now disagree, so nothing after it can be trusted
    if (round > kMaskEstimateSlots) {
      uint32_t const lost = present & ~alive & ~mine;
      if (((lost >> lane) & 1u) != 0)
        device::record_timeout(p.view, lane,
                               p.leg == LlMaskLeg::dispatch ? WaitPhase::ll_dispatch : WaitPhase::ll_combine,
                               epoch << 32, 0);
      if (lane == 0) m.epoch = epoch;
      return;
    }
    // b. the estimates of this round, or a decision (the deadline leaves a rank that arrived up to a timeout later,
    //    and each round before, half a timeout of margin)
    uint64_t const deadline = start + static_cast<uint64_t>(round) * timeout + (round - 1) * (timeout / 2);
    RoundRead const read = read_round(p, network, round, epoch, alive, deadline);
    if (read.ahead >= 0) {
      if (lane == 0) mask_self(p, LlMaskSelf::ahead, epoch, (all & ~live) | mine, 0, read.ahead);
      return;
    }
    // c. adopt a decision, or decide when every rank waited for was heard (else those not heard died, and leave the
    //    estimate: go round again)
    if (read.adopted) {
      estimate = read.decision;
      decided = true;
      continue;
    }
    estimate &= read.meet & ~(alive & ~read.heard);
    decided = read.heard == alive;
    alive = read.heard;
  }
  // 4. the ranks of the call, and the requests of those ranks
  uint32_t const agreed = estimate;
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
    // the network's counters of the estimates now hold to.epoch (realign_network_counters): the next word adds 1
    for (auto& round : s.ll.mask.signaled)
      for (uint64_t& sent : round) sent = p.to.epoch;
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
// dispatch arrivals, combine arrivals, the agreement's arrivals, its estimates of each round
inline constexpr int kNetworkCounters = 3 + kMaskEstimateSlots;

struct LlCounterParams {
  DeviceView view;
  int local;                                      // ranks per node
  std::size_t counters[kNetworkCounters];         // offsets of the [world] arrays (by source)
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
