// Rank masking on the cuda backend (low-latency mode, docs/internode.md "Rank masking"): the words the device keeps of
// one EpBuffer's mask (DeviceState::ll_mask, local memory, zeroed at construction and by clear_mask) and the host's
// reading of them. Plain data, no CUDA: the kernels (src/ep/cuda/ll/mask.cuh) write these words, CudaEp and the tests
// read them, and the host logic here is unit-tested without a GPU.
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>

#include "core/rank_words.hpp"
#include "ferry/ep.hpp"
#include "ferry/limits.hpp"

namespace ferry::detail {

// The agreement of every masked exchange, on both backends (docs/internode.md "Rank masking", "Who decides"): the
// arrivals, then rounds of estimates. Each round after the first that ends undecided was caused by a rank that died
// while writing that round's words (it reached some ranks and not others), so kMaskEstimateRounds rounds take that
// many deaths inside one agreement (ranks gone before it, any number, cost none); past them the ranks could disagree
// and the communicator fails. A rank that decides writes one round more (its decision), so the words of an agreement
// hold kMaskEstimateSlots rounds: round r (2 ..) in slot r - 2.
inline constexpr int kMaskEstimateRounds = 4;
inline constexpr int kMaskEstimateSlots = kMaskEstimateRounds + 1;

// A set of ranks in the mask words: bit r % 32 of word r / 32 (core/rank_words.hpp), kMaskWords words for any world
// (the kernels touch the world's first rank_words(world)).
inline constexpr int kMaskWords = rank_words(kMaxWorld);

// Why a rank learned at an agreement that it is masked (LlMaskWords::self; 0: it is not).
enum class LlMaskSelf : uint32_t {
  none = 0,
  timeout = 1,  // the ranks it saw had gone on without it (its arrival came after their FERRY_TIMEOUT_S)
  ahead = 2,    // a rank was already past this agreement (it went on without this rank)
  asked = 3,    // a rank of the call asked for it (EpBuffer::mask_ranks; it may be this rank itself)
};

// The legs whose entry is an agreement (LlMaskWords::self_leg).
enum class LlMaskLeg : uint32_t { dispatch = 0, combine = 1 };

struct LlMaskWords {
  uint64_t epoch;  // agreements this rank ran (one per low-latency leg's entry), the next one's words carry +1
  uint32_t masked[kMaskWords];     // rank r is masked (masks only grow until clear_mask)
  uint32_t self;                   // LlMaskSelf: this rank is masked; every later leg kernel of it returns at once
  uint64_t self_epoch;             // the agreement that masked it
  uint64_t self_call;              // that leg's call number on this buffer (dispatch #n or combine #n)
  uint32_t self_leg;               // LlMaskLeg of that call
  uint32_t self_view[kMaskWords];  // the masked ranks as this rank learned it (itself included)
  uint32_t self_lost[kMaskWords];  // the ranks that agreement left out (timeout) or was asked for (asked)
  int32_t self_by;                 // ahead: the rank that was past the agreement; else -1
  // this rank's (token, k) entries whose expert's rank is masked: not sent by the dispatches, missing from the
  // combines' y (the agreement of each leg zeroes its last_* word, the kernels add)
  unsigned long long last_dispatch_entries;
  unsigned long long dispatch_entries;
  unsigned long long last_combine_entries;
  unsigned long long combine_entries;
  // [max_tokens, topk] the rank of each entry of the last dispatch (-1: none), written by its send half for the
  // combine's count (Buffers::ll_entry_rank; set once at allocation)
  int16_t* entry_rank;
  // Across nodes: the agreement that this rank last sent each round's estimate to each rank in (the signal of a put
  // adds the difference, so a receiver's counter of a round holds the agreement its word belongs to; clear_mask sets
  // them to the epoch every rank starts from, as it sets the counters). Last: the host's reads stop before it
  // (kMaskWordsRead).
  uint64_t signaled[kMaskEstimateSlots][kMaxWorld];
};
// The bytes of LlMaskWords the host reads (read_ll_mask): everything but the device's own `signaled`.
inline constexpr std::size_t kMaskWordsRead = offsetof(LlMaskWords, signaled);

// The mapped host words of one EpBuffer's mask: the request (EpBuffer::mask_ranks, written by the host and carried by
// every later agreement: requests only grow until clear_mask, so a late read loses nothing) and this rank's
// LlMaskSelf, copied there by the agreement that masked it (the host checks it at every call without a sync).
struct LlMaskHost {
  uint32_t request[kMaskWords];
  uint32_t self;
};

// The call counters of one EpBuffer's low-latency protocol that clear_mask puts back in step: every rank takes the
// largest of everyone's (a masked rank's stopped where it was left out).
struct LlCallCounters {
  uint64_t dispatch_seq;  // calls of each leg (the kernels' per-CTA sequence numbers)
  uint64_t combine_seq;
  uint64_t epoch;  // agreements (LlMaskWords::epoch)
};
LlCallCounters merge_call_counters(std::span<LlCallCounters const> all);

// EpBuffer::mask_status of a rank from its words (world: the ranks of the buffer).
MaskStatus mask_status_of(LlMaskWords const& words, int world);

// The Error a masked rank's calls throw ("rank R is masked on this EpBuffer: at dispatch #n ..."), from its words
// (self != none); timeout_s: FERRY_TIMEOUT_S, named in the timeout case.
std::string self_masked_message(LlMaskWords const& words, int rank, double timeout_s);

}  // namespace ferry::detail
