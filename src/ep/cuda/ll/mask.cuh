// Rank masking in low-latency mode (EpConfig::rank_masking; docs/internode.md "Rank masking"): the agreement that
// opens every call of a leg, a kernel of one CTA launched on the leg's stream before the leg's kernel (its send half
// with the hook), so a captured graph replays it with the mask of the moment. Thread s speaks for rank s (a thread
// per rank, up to kMaxWorld); a set of ranks is rank_words(world) words, each word of the area tagged with the
// agreement it belongs to (LlMaskArea). The protocol is the cpu backend's (src/ep/cpu/cpu_ep.cpp, agree()), step for
// step:
//  1. arrival: this rank's request, tagged with the epoch, into this rank's arrive words on every live rank (release);
//  2. wait for the live ranks' arrivals of this epoch, all threads against one deadline, FERRY_TIMEOUT_S from the
//     kernel's start: the ranks seen are this rank's view, its first estimate of the ranks of the call. A word of a
//     later epoch means that rank is past this agreement without this rank: this rank is masked;
//  3. rounds of estimates (2, 3, ...): this rank's estimate (tag: epoch << 1 | decided) into its words of the round
//     and the epoch's parity on every live rank; then the estimates of the round from the ranks it still hears from,
//     or a decision (words of this round or the next marked decided), until the round's deadline (absolute, from
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
// Across nodes (Net: the network to the ranks of other nodes) a set to a rank of another node is one put of the set,
// staged in this rank's outbox, with a signal on that rank's counter of this source that covers it: the arrivals' +1
// (one per agreement the source took part in), an estimate's the difference to the epoch (LlMaskWords::signaled),
// so a round's counter holds the agreement of its last set; clear_mask sets every counter to the epoch every rank
// starts from. A thread waits for its rank's counter to reach the epoch, then reads the words the put brought. The
// words and the rules are the same, so the ranks of every node compute the same set.
// Cost: one message (a put with its signal) to each live rank of another node per set: the arrival, the estimate of
// round 2 and, marked decided, of round 3 when nobody dies inside the agreement; docs/internode.md "Rank masking".
#pragma once

#include <cstdint>

#include "comm/device/signal.cuh"
#include "comm/transport/lsa.cuh"
#include "ep/cuda/ll/layout.hpp"
#include "ep/cuda/ll/params.cuh"
#include "ep/cuda/params.cuh"
#include "ep/ll_mask_words.hpp"
#include "ferry/device_view.hpp"

namespace ferry::cuda_ll {

using detail::kMaskEstimateRounds;
using detail::kMaskEstimateSlots;
using detail::kMaskWords;
using detail::LlMaskLeg;
using detail::LlMaskSelf;

struct LlAgreementParams {
  DeviceView view;
  transport::Lsa net;  // the ranks of this node (load/store), by local index: rank s is window(s - first rank)
  std::size_t arrive;  // the area's offsets in every rank's region (cuda_ep::ll_mask_area)
  std::size_t estimates;
  std::size_t outbox;
  std::size_t arrive_signals;  // across nodes: counters of the words put by the ranks of other nodes
  std::size_t estimate_signals;
  int local;   // ranks per node (world on one node)
  int words;   // words of a set of ranks: detail::rank_words(world)
  int stride;  // words between two sets: cuda_ep::ll_mask_set_stride(world)
  cuda_ep::DeviceState* state;
  detail::LlMaskHost* host;  // mapped: the request (host), this rank's LlMaskSelf (written here when it is masked)
  LlMaskLeg leg;
  uint64_t const* send_seq;  // the leg's per-CTA sequence words (CTA 0's): the call this agreement opens is +1
};

// The agreement's kernels run a thread per rank of the world (thread s speaks for rank s), in whole warps.
inline constexpr int kMaxAgreementThreads = kMaxWorld;
__host__ __device__ constexpr int agreement_threads(int world) {
  return (world + 31) / 32 * 32;
}

// How far the epoch of a word is from `epoch`: > 0 a later agreement, 0 this one, < 0 an earlier one (or none yet).
__device__ __forceinline__ int32_t arrival_ahead(uint64_t word, uint64_t epoch) {
  return static_cast<int32_t>(static_cast<uint32_t>(word >> 32) - static_cast<uint32_t>(epoch));
}
__device__ __forceinline__ int32_t estimate_ahead(uint64_t word, uint64_t epoch) {
  // the tag is epoch << 1 | decided in 32 bits: compare the 31-bit epochs, sign-extended from bit 30
  uint32_t const seen = static_cast<uint32_t>(word >> 33);
  return static_cast<int32_t>((seen - static_cast<uint32_t>(epoch)) << 1) >> 1;
}
__device__ __forceinline__ uint32_t estimate_tag(uint64_t epoch, bool decided) {
  return static_cast<uint32_t>(epoch) << 1 | (decided ? 1u : 0u);
}
__device__ __forceinline__ bool estimate_decided(uint64_t word) {
  return ((word >> 32) & 1u) != 0;
}

// Sets of ranks in shared memory: bit s % 32 of word s / 32, the block's threads together.
__device__ __forceinline__ bool has(uint32_t const* set, int s) {
  return ((set[s >> 5] >> (s & 31)) & 1u) != 0;
}
// Word k of the ranks [0, world).
__device__ __forceinline__ uint32_t world_word(int world, int k) {
  int const bits = world - 32 * k;
  return bits >= 32 ? 0xffffffffu : bits <= 0 ? 0u : (1u << bits) - 1u;
}
// Every thread's `pred` into `set` (a word per warp), seen by every thread after (block barriers before and after:
// the previous value's readers are done first).
__device__ __forceinline__ void gather(uint32_t* set, bool pred) {
  uint32_t const bits = __ballot_sync(0xffffffffu, pred);
  __syncthreads();
  if ((threadIdx.x & 31) == 0) set[threadIdx.x >> 5] = bits;
  __syncthreads();
}

// Offsets of this round's words and counters (round 2.. : slot round - 2) in every rank's region.
__device__ __forceinline__ std::size_t estimate_words(LlAgreementParams const& p, int round, uint64_t epoch) {
  std::size_t const slot = static_cast<std::size_t>(round - 2) * 2 + static_cast<std::size_t>(epoch & 1);
  return p.estimates + slot * static_cast<std::size_t>(p.view.world) * p.stride * sizeof(uint64_t);
}
__device__ __forceinline__ std::size_t estimate_counters(LlAgreementParams const& p, int round) {
  return p.estimate_signals + static_cast<std::size_t>(round - 2) * p.view.world * sizeof(uint64_t);
}
// Word i of source s's set in an area of [world][stride] sets.
__device__ __forceinline__ std::size_t set_word(LlAgreementParams const& p, std::size_t area, int s, int i) {
  return area + (static_cast<std::size_t>(s) * p.stride + static_cast<std::size_t>(i)) * sizeof(uint64_t);
}
// This rank's outbox slot of its arrival (slot 0) or of a round's estimate (round - 1), of the epoch's parity.
__device__ __forceinline__ std::size_t outbox_set(LlAgreementParams const& p, int slot, uint64_t epoch) {
  std::size_t const at = (static_cast<std::size_t>(epoch & 1) * (1 + kMaskEstimateSlots) + slot) * p.stride;
  return p.outbox + at * sizeof(uint64_t);
}

// This rank's next set (every thread calls it): its words, tag << 32 | ranks, into its outbox slot (across nodes the
// source of the puts), then a block barrier.
template <class Net>
__device__ __forceinline__ void stage_set(LlAgreementParams const& p, std::size_t outbox, uint32_t tag,
                                          uint32_t const* ranks) {
  int const k = static_cast<int>(threadIdx.x);
  if (kAcrossNodes<Net> && k < p.stride)
    reinterpret_cast<uint64_t*>(p.net.local() + outbox)[k] =
        static_cast<uint64_t>(tag) << 32 | (k < p.words ? ranks[k] : 0u);
  __syncthreads();
}

// This rank's set for rank s (thread s): into s's `area` at this rank's index, each word tag << 32 | its ranks. On
// this node release stores; across nodes one put of the staged set (stage_set's `outbox`) with `add` on s's counter
// of this rank (at `signals`), which covers it, and a flush (the outbox is written again two agreements later).
template <class Net>
__device__ __forceinline__ void send_set(LlAgreementParams const& p, Net const& network, int s, std::size_t area,
                                         std::size_t signals, std::size_t outbox, uint32_t tag, uint32_t const* ranks,
                                         uint64_t add) {
  int const rank = p.view.rank;
  if constexpr (kAcrossNodes<Net>) {
    if (s / p.local != rank / p.local) {
      auto ep = network.open(transport::Thread{}, s);
      ep.put_signal(s, set_word(p, area, rank, 0), outbox, static_cast<std::size_t>(p.stride) * sizeof(uint64_t),
                    signals + static_cast<std::size_t>(rank) * sizeof(uint64_t), add);
      ep.flush();
      ep.close();
      return;
    }
  }
  uint64_t const high = static_cast<uint64_t>(tag) << 32;
  char* const window = p.net.window(s - rank / p.local * p.local);
  for (int i = 0; i < p.words; ++i)
    device::signal_set(reinterpret_cast<uint64_t*>(window + set_word(p, area, rank, i)), high | ranks[i]);
}

// Whether rank s's words in this rank's area may be read: on this node always (each word carries its tag); across
// nodes once s's counter of this rank reaches `epoch` (the puts of this epoch's words, or of a later one's, landed).
template <class Net>
__device__ __forceinline__ bool words_landed(LlAgreementParams const& p, Net const& network, int s, std::size_t signals,
                                             uint64_t epoch) {
  if constexpr (kAcrossNodes<Net>) {
    if (s / p.local != p.view.rank / p.local) {
      auto ep = network.open(transport::Thread{}, s);
      return ep.read(signals + static_cast<std::size_t>(s) * sizeof(uint64_t)) >= epoch;
    }
  }
  return true;
}

enum class SetRead { pending, ready, ahead };

// Rank s's set in this rank's `area`: ready when every word carries this agreement's tag (`ahead_of(word)` 0), into
// ranks[] with its first word in *first; ahead when a word is of a later agreement; else pending (words of an earlier
// one: not written yet, or half).
template <class AheadOf>
__device__ __forceinline__ SetRead read_set(LlAgreementParams const& p, std::size_t area, int s, AheadOf ahead_of,
                                            uint32_t* ranks, uint64_t* first) {
  bool pending = false;
  for (int i = 0; i < p.words; ++i) {
    uint64_t const word =
        device::arch::load_acquire_sys_u64(reinterpret_cast<uint64_t const*>(p.net.local() + set_word(p, area, s, i)));
    int32_t const by = ahead_of(word);
    if (by > 0) return SetRead::ahead;
    pending = pending || by < 0;
    ranks[i] = static_cast<uint32_t>(word);
    if (i == 0) *first = word;
  }
  return pending ? SetRead::pending : SetRead::ready;
}

// Thread s waits until rank s's arrival in this rank holds `epoch` (ready, its request into request[]) or a later one
// (ahead), until start_ns + the bound (pending).
template <class Net>
__device__ __forceinline__ SetRead wait_arrival(LlAgreementParams const& p, Net const& network, int s, uint64_t epoch,
                                                uint64_t start_ns, uint64_t bound_ns, uint32_t* request) {
  auto const ahead_of = [epoch](uint64_t word) { return arrival_ahead(word, epoch); };
  uint64_t first = 0;
  while (true) {
    if (words_landed(p, network, s, p.arrive_signals, epoch)) {
      SetRead const read = read_set(p, p.arrive, s, ahead_of, request, &first);
      if (read != SetRead::pending) return read;
    }
    if (device::arch::global_timer_ns() - start_ns > bound_ns) return SetRead::pending;
  }
}

// This rank learned that it is masked (thread 0): why, at which call, what it saw; the host's word last (after a
// system fence, so a host that sees it reads the rest after a sync).
__device__ __forceinline__ void mask_self(LlAgreementParams const& p, LlMaskSelf why, uint64_t epoch,
                                          uint32_t const* view, uint32_t const* lost, int by) {
  detail::LlMaskWords& m = p.state->ll.mask;
  m.epoch = epoch;
  m.self = static_cast<uint32_t>(why);
  m.self_epoch = epoch;
  m.self_call = p.send_seq[0] + 1;
  m.self_leg = static_cast<uint32_t>(p.leg);
  for (int k = 0; k < p.words; ++k) {
    m.self_view[k] = view[k];
    m.self_lost[k] = lost != nullptr ? lost[k] : 0u;
  }
  m.self_by = by;
  __threadfence_system();
  *reinterpret_cast<uint32_t volatile*>(&p.host->self) = static_cast<uint32_t>(why);
}

// The shared sets of one agreement (words [0, LlAgreementParams::words) of each).
struct AgreementSets {
  uint32_t live[kMaskWords];     // the ranks not masked before it
  uint32_t request[kMaskWords];  // this rank's request, read once
  uint32_t present[kMaskWords];  // the arrivals seen (this rank's view)
  uint32_t estimate[kMaskWords];
  uint32_t alive[kMaskWords];  // the ranks it still hears from
  uint32_t heard[kMaskWords];  // of a round
  uint32_t meet[kMaskWords];   // of a round: the intersection of the estimates heard, or the decision adopted
  uint32_t view[kMaskWords];   // scratch: what mask_self records
  uint32_t lost[kMaskWords];
  uint32_t asked[kMaskWords];
  int first;  // the lowest rank found ahead, or the lowest adopter
};

// This rank is masked because rank `by` is past this agreement without it (every thread calls it): its view is the
// ranks masked before, and itself.
__device__ __forceinline__ void leave_ahead(LlAgreementParams const& p, AgreementSets& sets, uint64_t epoch, int by) {
  int const s = static_cast<int>(threadIdx.x);
  int const rank = p.view.rank;
  if (s < p.words)
    sets.view[s] = (world_word(p.view.world, s) & ~sets.live[s]) | (s == rank >> 5 ? 1u << (rank & 31) : 0u);
  __syncthreads();
  if (s == 0) mask_self(p, LlMaskSelf::ahead, epoch, sets.view, nullptr, by);
}

// What one round of estimates brought (step 3): sets.heard and sets.meet (the intersection of the estimates heard),
// or a decision to adopt (in sets.meet), or the rank that is past this agreement (ahead >= 0: this rank is masked).
struct RoundRead {
  bool adopted = false;
  int ahead = -1;
};

// 3b. Thread s reads rank s's estimate of `round` (and its words of the next round, where a decision shows first)
//     until every rank in sets.alive was heard, a decision or a later epoch is seen, or the deadline. Every thread
//     calls it; the outcome is the same on all.
template <class Net>
__device__ RoundRead read_round(LlAgreementParams const& p, Net const& network, AgreementSets& sets, int round,
                                uint64_t epoch, uint64_t deadline_ns) {
  int const s = static_cast<int>(threadIdx.x);
  bool const mine = s < p.view.world && has(sets.alive, s);
  auto const ahead_of = [epoch](uint64_t word) { return estimate_ahead(word, epoch); };
  bool heard = false;
  uint32_t view[kMaskWords];
  uint32_t decision[kMaskWords];
  if (s < p.words) sets.meet[s] = 0xffffffffu;
  if (s == 0) sets.first = kMaxWorld;
  while (true) {
    bool ahead = false;
    bool adopt = false;
    for (int r = round; mine && !adopt && r <= round + 1 && r <= kMaskEstimateSlots + 1; ++r) {
      if ((r == round && heard) || !words_landed(p, network, s, estimate_counters(p, r), epoch)) continue;
      uint32_t* const into = r == round ? view : decision;  // read only when ready
      uint64_t first = 0;
      SetRead const read = read_set(p, estimate_words(p, r, epoch), s, ahead_of, into, &first);
      ahead = ahead || read == SetRead::ahead;
      if (read != SetRead::ready) continue;
      heard = heard || r == round;
      if (estimate_decided(first)) {  // every decision of one agreement is the same set
        adopt = true;
        if (r == round)
          for (int k = 0; k < p.words; ++k) decision[k] = view[k];
      }
    }
    RoundRead out;
    if (__syncthreads_or(ahead)) {
      if (ahead) atomicMin(&sets.first, s);
      __syncthreads();
      out.ahead = sets.first;
      return out;
    }
    if (__syncthreads_or(adopt)) {
      if (adopt) atomicMin(&sets.first, s);
      __syncthreads();
      if (s == sets.first)
        for (int k = 0; k < p.words; ++k) sets.meet[k] = decision[k];
      __syncthreads();
      out.adopted = true;
      return out;
    }
    bool const all_heard = __syncthreads_and(!mine || heard);
    bool const late = __syncthreads_or(s == 0 && device::arch::global_timer_ns() > deadline_ns);
    if (all_heard || late) {
      if (heard)
        for (int k = 0; k < p.words; ++k) atomicAnd(&sets.meet[k], view[k]);
      gather(sets.heard, heard);
      return out;
    }
  }
}

// Net: OneNode (every rank on this node), or the network to the ranks of other nodes (NetParams: Emulated, Gin).
// Launched with agreement_threads(world) threads.
template <class Net = OneNode>
__global__ void __launch_bounds__(kMaxAgreementThreads, 1)
    ll_agreement_kernel(NetParams<LlAgreementParams, Net> const p) {
  __shared__ AgreementSets sets;
  __shared__ uint64_t s_start;
  int const s = static_cast<int>(threadIdx.x);
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const words = p.words;
  decltype(auto) network = network_in<Net>(p);
  detail::LlMaskWords& m = p.state->ll.mask;
  if (m.self != 0) return;  // masked already: nothing to agree on (the leg's kernel returns too)
  uint64_t const timeout = p.view.timeout_ns;
  uint64_t const epoch = m.epoch + 1;
  int const my_word = rank >> 5;
  uint32_t const my_bit = 1u << (rank & 31);
  auto const mine = [&](int k) { return k == my_word ? my_bit : 0u; };
  if (s < words) {
    sets.live[s] = world_word(world, s) & ~m.masked[s];
    sets.request[s] = reinterpret_cast<uint32_t const volatile*>(p.host->request)[s];
  }
  if (s == 0) s_start = device::arch::global_timer_ns();
  __syncthreads();
  uint64_t const start = s_start;
  bool const peer = s < world && has(sets.live, s);

  // 1. arrival (release: the leg's rows come after the agreement, which orders them)
  std::size_t const arrival_box = outbox_set(p, 0, epoch);
  stage_set<Net>(p, arrival_box, static_cast<uint32_t>(epoch), sets.request);
  if (peer)
    send_set(p, network, s, p.arrive, p.arrive_signals, arrival_box, static_cast<uint32_t>(epoch), sets.request, 1);
  // 2. the live ranks' arrivals, one deadline for all: this rank's view, its first estimate
  uint32_t request[kMaskWords];  // rank s's request (its arrival's ranks)
  SetRead const arrival = peer ? wait_arrival(p, network, s, epoch, start, timeout, request) : SetRead::pending;
  gather(sets.present, arrival != SetRead::pending);
  if (__syncthreads_or(arrival == SetRead::ahead)) {
    if (s == 0) sets.first = kMaxWorld;
    __syncthreads();
    if (arrival == SetRead::ahead) atomicMin(&sets.first, s);
    __syncthreads();
    leave_ahead(p, sets, epoch, sets.first);
    return;
  }
  if (arrival != SetRead::ready)  // none, or a half-read set of a rank not seen
    for (int k = 0; k < words; ++k) request[k] = 0;
  // 3. rounds of estimates, until this rank decides or adopts a decision
  if (s < words) {
    sets.estimate[s] = sets.present[s];
    sets.alive[s] = sets.present[s] & ~mine(s);
  }
  __syncthreads();
  bool decided = false;  // the same on every thread
  for (int round = 2;; ++round) {
    // a. this rank's estimate into every live rank; a rank that decided writes it once more, marked, and goes on
    std::size_t const box = outbox_set(p, round - 1, epoch);
    stage_set<Net>(p, box, estimate_tag(epoch, decided), sets.estimate);
    if (peer && s != rank) {
      uint64_t add = 0;
      if constexpr (kAcrossNodes<Net>) {
        add = epoch - m.signaled[round - 2][s];
        m.signaled[round - 2][s] = epoch;
      }
      send_set(p, network, s, estimate_words(p, round, epoch), estimate_counters(p, round), box,
               estimate_tag(epoch, decided), sets.estimate, add);
    }
    if (decided) break;
    // NOTE: one round more than the slots hold: more ranks died inside this agreement than it takes, and the ranks
    // may now disagree, so nothing after it can be trusted
    if (round > kMaskEstimateSlots) {
      bool const lost = s < world && s != rank && has(sets.present, s) && !has(sets.alive, s);
      if (lost)
        device::record_timeout(p.view, s, p.leg == LlMaskLeg::dispatch ? WaitPhase::ll_dispatch : WaitPhase::ll_combine,
                               epoch << 32, 0);
      if (s == 0) m.epoch = epoch;
      return;
    }
    // b. the estimates of this round, or a decision (the deadline leaves a rank that arrived up to a timeout later,
    //    and each round before, half a timeout of margin)
    uint64_t const deadline = start + static_cast<uint64_t>(round) * timeout + (round - 1) * (timeout / 2);
    RoundRead const read = read_round(p, network, sets, round, epoch, deadline);
    if (read.ahead >= 0) {
      leave_ahead(p, sets, epoch, read.ahead);
      return;
    }
    // c. adopt a decision, or decide when every rank waited for was heard (else those not heard died, and leave the
    //    estimate: go round again)
    bool const all_heard = __syncthreads_and(s >= words || sets.heard[s] == sets.alive[s]);
    if (s < words) {
      if (read.adopted) {
        sets.estimate[s] = sets.meet[s];
      } else {
        sets.estimate[s] &= sets.meet[s] & ~(sets.alive[s] & ~sets.heard[s]);
        sets.alive[s] = sets.heard[s];
      }
    }
    decided = read.adopted || all_heard;
    __syncthreads();
  }
  // 4. the ranks of the call, and the requests of those ranks
  if (s < words) sets.asked[s] = 0;
  __syncthreads();
  if (s < world && has(sets.estimate, s))
    for (int k = 0; k < words; ++k)
      if (request[k] != 0) atomicOr(&sets.asked[k], request[k]);
  __syncthreads();
  if (s < words) {
    sets.asked[s] &= sets.estimate[s];
    sets.lost[s] = sets.live[s] & ~sets.estimate[s];
  }
  __syncthreads();
  bool const self_lost = (sets.lost[my_word] & my_bit) != 0;
  bool const self_asked = (sets.asked[my_word] & my_bit) != 0;
  if (s < words) {
    uint32_t const all = world_word(world, s);
    sets.view[s] =
        self_lost ? (all & ~sets.estimate[s]) | mine(s) : (all & ~sets.live[s]) | sets.lost[s] | sets.asked[s];
  }
  __syncthreads();
  if (self_lost) {
    if (s == 0) mask_self(p, LlMaskSelf::timeout, epoch, sets.view, sets.lost, -1);
  } else if (self_asked) {
    if (s == 0) mask_self(p, LlMaskSelf::asked, epoch, sets.view, sets.asked, -1);
  } else {
    if (s < words) m.masked[s] |= sets.lost[s] | sets.asked[s];
    if (s == 0) {
      m.epoch = epoch;
      if (p.leg == LlMaskLeg::dispatch)
        m.last_dispatch_entries = 0;
      else
        m.last_combine_entries = 0;
    }
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
  if (tid == 0) s.ll.dropped_seq = 0;  // a drop before the realignment is no later call's
  uint64_t const per_call = static_cast<uint64_t>(p.num_ctas);
  if (tid < p.local) {  // this node's sources
    int const d = p.rank / p.local * p.local + tid;
    p.dispatch_arrivals[d] = p.to.dispatch_seq * per_call;
    p.combine_arrivals[d] = p.to.combine_seq * per_call;
  }
  detail::LlMaskWords& m = s.ll.mask;  // every word but entry_rank (set once at allocation)
  static_assert(cuda_ep::kMaxLlCtas >= detail::kMaskWords, "a thread per word of a set");
  if (tid < detail::kMaskWords) {
    m.masked[tid] = 0;
    m.self_view[tid] = 0;
    m.self_lost[tid] = 0;
    p.host->request[tid] = 0;
  }
  // the network's counters of the estimates now hold to.epoch (realign_network_counters): the next word adds 1
  for (int i = tid; i < kMaskEstimateSlots * kMaxWorld; i += static_cast<int>(blockDim.x))
    m.signaled[i / kMaxWorld][i % kMaxWorld] = p.to.epoch;
  if (tid == 0) {
    m.epoch = p.to.epoch;
    m.self = 0;
    m.self_epoch = 0;
    m.self_call = 0;
    m.self_leg = 0;
    m.self_by = 0;
    m.last_dispatch_entries = 0;
    m.dispatch_entries = 0;
    m.last_combine_entries = 0;
    m.combine_entries = 0;
    s.num_tokens = 0;  // the dispatch before the clear is forgotten (dispatch again before a combine)
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
// Thread s speaks for rank s; the ranks of this node are the reset kernel's (load/store).
inline constexpr int kNetworkCounters = cuda_ep::kLlMaskNetworkCounters;

struct LlCounterParams {
  DeviceView view;
  int local;                               // ranks per node
  std::size_t counters[kNetworkCounters];  // offsets of the [world] arrays (by source)
  uint64_t target[kNetworkCounters];       // what every counter must hold
  uint64_t* read;                          // step 1: [kNetworkCounters][world] this rank's counters
  uint64_t const* add;                     // step 2: [kNetworkCounters][world] what to add to each rank's of this one
};
// legs: the network of the legs' counters (a Gin's range is the layout's), agreement: the agreement's (LlMaskArea).
template <class Net>
struct LlCounterNets : LlCounterParams {
  Net legs;
  Net agreement;
};

enum class LlCounterStep { read, add, wait };

// Launched with agreement_threads(world) threads.
template <class Net, LlCounterStep kStep>
__global__ void __launch_bounds__(kMaxAgreementThreads, 1) ll_counters_kernel(LlCounterNets<Net> const p) {
  int const s = static_cast<int>(threadIdx.x);
  int const rank = p.view.rank;
  if (s >= p.view.world || s / p.local == rank / p.local) return;
  for (int k = 0; k < kNetworkCounters; ++k) {
    auto ep = (k < 2 ? p.legs : p.agreement).open(transport::Thread{}, s);
    if constexpr (kStep == LlCounterStep::read) {
      p.read[static_cast<std::size_t>(k) * p.view.world + s] =
          ep.read(p.counters[k] + static_cast<std::size_t>(s) * sizeof(uint64_t));
    } else if constexpr (kStep == LlCounterStep::add) {
      uint64_t const add = p.add[static_cast<std::size_t>(k) * p.view.world + s];
      if (add != 0) ep.signal(s, p.counters[k] + static_cast<std::size_t>(rank) * sizeof(uint64_t), add);
      ep.close();
    } else {
      if (!ep.wait(p.view, p.counters[k] + static_cast<std::size_t>(s) * sizeof(uint64_t), p.target[k], s,
                   WaitPhase::clear_mask))
        return;
    }
  }
}

}  // namespace ferry::cuda_ll
