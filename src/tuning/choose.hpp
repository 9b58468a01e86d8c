// Which launch geometry (CTA count) a leg runs with, and why. Precedence (0 in a pin means "choose"):
//   1. EpConfig::dispatch_geometry / combine_geometry
//   2. FERRY_{DISPATCH,COMBINE}_BLOCKS (read at every call, so experiments and `ferry tune` can change them)
//   3. the table row for the EpBuffer's key (tables in force: table.hpp active_tables()), in the bucket of the call's
//      token count, or the largest bucket past it
//   4. the kernels' analytic default (computed by the launcher's plan function)
// The result's `source` names the pin, variable, table file + entry + bucket, or default that decided.
// Host-only; the cuda launchers call it from their plan functions.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "tuning/table.hpp"

namespace ferry::tuning {

// What decides a leg's geometry apart from the call: fixed when the EpBuffer is created.
struct LegTuning {
  Leg leg = Leg::dispatch;
  std::optional<Geometry> pin;  // EpConfig::*_geometry
  std::vector<Bucket> rows;     // the table entry's buckets for this leg (empty: no row)
  std::string rows_from;        // "builtin:h200.json entry 0 (H200 world 8 ...)", or why there is no row
};

// Looks the key up in the tables. Never throws for a missing entry (that is the analytic default's case).
LegTuning resolve_leg(Leg leg, TuningKey const& key, std::optional<Geometry> const& pin, TableSet const& tables);

// FERRY_{DISPATCH,COMBINE}_BLOCKS. Unset or 0: not pinned. Throws ConfigError for a negative value.
struct EnvPin {
  std::optional<int> blocks;
};
EnvPin read_env_pin(Leg leg);

struct Choice {
  Geometry geometry;
  std::string source;  // e.g. "table builtin:h200.json entry 0 (H200 world 8 ...) bucket <=512 tokens"
};

// Applies the precedence for a call with num_tokens tokens. `analytic` is the kernels' default geometry (blocks >= 1)
// and `analytic_why` its reason.
Choice choose(LegTuning const& tuning, EnvPin const& env, int num_tokens, Geometry analytic,
              std::string_view analytic_why);

}  // namespace ferry::tuning
