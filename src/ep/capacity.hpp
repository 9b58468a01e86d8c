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

}  // namespace ferry::detail
