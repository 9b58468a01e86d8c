// Which capacities of a config can drop what a dispatch sends (docs/errors.md, "Capacities"). A drop is an error on
// every rank of the call, so a backend must make every rank learn it; these say, from the config alone (the same on
// every rank), whether it has to.
#pragma once

#include <cstdint>

#include "ferry/ep.hpp"

namespace ferry::detail {

// A receive capacity below the worst case (every token of every rank on one rank) can leave rank-major rows out.
inline bool row_drops_possible(EpConfig const& config, int world) {
  return config.recv_capacity(world) < static_cast<int64_t>(world) * config.max_tokens_per_rank;
}

// An expert's entries can outnumber its slots (expert_capacity below the receive capacity): a drop its receiver alone
// finds, unless every rank counts every expert's entries.
inline bool slot_drops_possible(EpConfig const& config, int world) {
  return config.expert_slots() > 0 && config.expert_slots() < config.recv_capacity(world);
}

// The entries of one token in a call that sends them as tokens of their own (topk 1, DispatchArgs::x_repeat = k): k,
// else 1. A group's ids must differ, as a token's topk ids must (a repeat is refused on every rank).
inline int entry_group(EpConfig const& config, int x_repeat) {
  return config.topk == 1 && x_repeat > 1 ? x_repeat : 1;
}

// The entries one rank's call of num_tokens can send to one expert: one per group (entry_group).
inline int64_t entries_per_expert_from_rank(EpConfig const& config, int num_tokens, int x_repeat) {
  int64_t const group = entry_group(config, x_repeat);
  return (num_tokens + group - 1) / group;
}

// Whether this rank's call can send an expert more than its share of the expert's slots (expert_capacity / world):
// where no rank's call does, no expert's entries outnumber its slots.
inline bool call_slot_drops_possible(EpConfig const& config, int world, int num_tokens, int x_repeat) {
  return slot_drops_possible(config, world) &&
         config.expert_slots() <
             static_cast<int64_t>(world) * entries_per_expert_from_rank(config, num_tokens, x_repeat);
}

}  // namespace ferry::detail
