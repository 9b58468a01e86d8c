// Plain-old-data views that kernels receive. No framework or CUDA header: usable from host and device code.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ferry/limits.hpp"

namespace ferry {

// Words of DeviceErrorBlock::absent: a bit per rank of the largest world.
inline constexpr int kAbsentWords = kMaxWorld / 32;

// Phases a bounded wait can time out in (recorded in DeviceErrorBlock::phase).
enum class WaitPhase : int32_t {
  none = 0,
  barrier = 1,
  count_exchange = 2,
  dispatch_data = 3,
  combine_data = 4,
  ll_dispatch = 5,
  ll_combine = 6,
  test = 7,
  weight_gradients = 8,  // combine_backward's exchange of the weight gradients (normal mode)
  clear_mask = 9,        // EpBuffer::clear_mask across nodes: the network's counters put back in step
};

char const* wait_phase_name(WaitPhase phase);

// The failures a DeviceErrorBlock records (its status once written).
inline constexpr uint32_t kErrorTimeout = 2;  // a bounded wait expired: peer did not arrive
// A wait saw a peer's signal of a later call of the same kind: the peer ran more calls of that kind on the buffer
// than this rank (expected / observed hold this rank's and the peer's sequence numbers).
inline constexpr uint32_t kErrorOutOfStep = 3;
// A host wait of this rank was ended by the interrupt check (include/ferry/interrupt.hpp) in the middle of an exchange:
// its peers may be anywhere in it, so nothing later can be paired (the cpu backend).
inline constexpr uint32_t kErrorInterrupted = 4;

// Host-visible (mapped pinned memory on cuda) record of the first failure a kernel saw. The first writer wins
// (status moves 0 -> 1 by compare-and-swap, then the fields are filled, then status moves to 2).
struct DeviceErrorBlock {
  uint32_t status;        // 0 none, 1 being written, kErrorTimeout, kErrorOutOfStep, kErrorInterrupted
  int32_t rank;           // the rank that waited
  int32_t peer;           // the rank it waited for (-1: several or unknown)
  int32_t phase;          // WaitPhase
  uint64_t expected;      // value the wait wanted (>=)
  uint64_t observed;      // last value it saw
  uint32_t input_errors;  // ids that made this rank refuse a call (out of range, repeated in a token's row)
  int32_t first_bad_value;
  uint32_t overflow_rows;  // rows dropped because a capacity (expert_capacity / max_recv_tokens) was exceeded
  // Collective refusals (DESIGN "Collective consistency"): calls this rank joined whose exchange carried a peer's
  // abort flag (that peer refused the call on input) since the last check, and the first such peer. The host reads
  // the peer's reason (Communicator::refusal_of) and raises InputError naming it; nothing of the call is returned.
  uint32_t refusals;
  int32_t refusing_rank;
  int32_t refused_phase;  // WaitPhase of the exchange that carried the flag
  // 1 + the first rank whose receive capacity a dropped row (overflow_rows) exceeded, recorded on every rank of the
  // call (a drop is an error on every rank); 0: not recorded (the rows were counted by the rank that dropped them)
  uint32_t overflow_rank;
  // Every rank a wait of this rank gave up on (bit r % 32 of word r / 32): the timed-out wait's peer, and the peers
  // of the waits that stopped early because of it and had still not seen their signal. The host names them all, and
  // a whole node when every rank of one is in it.
  uint32_t absent[kAbsentWords];
};

// Symmetric memory as a kernel sees it: one region of the same size on every rank, and the copies of this rank's
// load/store team, addressable from this rank (an LSA / IPC flat address on cuda, a shared mapping on cpu). The team
// is the world ranks [lsa_first, lsa_first + lsa_size); ptr[r - lsa_first] is the copy of its rank r. Where the team
// is the whole world (one NVLink domain; virtual ranks), lsa_first is 0 and ptr[r] is world rank r's copy.
struct SymmetricView {
  char* ptr[kMaxLsaTeam];
  std::size_t bytes;
  int32_t lsa_first;
  int32_t lsa_size;
  // World rank `rank`'s copy, or null when it is outside the team (only the network reaches it). Host code; kernels
  // index ptr[] themselves.
  char* peer(int rank) const {
    int const slot = rank - lsa_first;
    return slot >= 0 && slot < lsa_size ? ptr[slot] : nullptr;
  }
};

// What every kernel gets from its communicator.
struct DeviceView {
  int32_t rank;
  int32_t world;
  uint64_t timeout_ns;      // bound of every device wait (FERRY_TIMEOUT_S)
  DeviceErrorBlock* error;  // host-visible error block of this rank
  // Communicator-owned signal area: per rank kSignalSlots 64-bit words, written by peers with release stores.
  // signals.peer(r) + slot * 8 for a rank r of the load/store team. Slots [0, world) are the barrier slots (slot p
  // written by rank p).
  SymmetricView signals;
  // Device word this rank's barrier epochs count in (local only; incremented by the barrier itself, so barriers
  // work inside CUDA graphs without host involvement).
  uint64_t* barrier_epoch;
};

inline constexpr int kSignalSlots = 1024;
static_assert(kMaxWorld <= kSignalSlots, "the barrier slots [0, world) of the signal area must fit in it");

}  // namespace ferry
