#include "tuning/choose.hpp"

#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry::tuning {
namespace {

std::optional<int> env_pin(char const* name) {
  std::optional<int64_t> const value = env_optional_int(name);
  if (!value || *value == 0) return std::nullopt;
  FERRY_CHECK_CONFIG(*value > 0 && *value <= (1 << 16), name, "=", *value,
                     " is outside [0, 65536]; use a positive count, or 0 / unset to choose");
  return static_cast<int>(*value);
}

}  // namespace

LegTuning resolve_leg(Leg leg, TuningKey const& key, std::optional<Geometry> const& pin, TableSet const& tables) {
  LegTuning tuning;
  tuning.leg = leg;
  tuning.pin = pin;
  std::optional<TableSet::Found> const found = tables.find(key);
  if (!found) {
    tuning.rows_from = detail::concat("no table entry for ", describe(key), " in ", tables.origin);
  } else if (found->entry->buckets(leg).empty()) {
    tuning.rows_from = detail::concat(found->where, " (", describe(key), ") has no ", leg_name(leg), " buckets");
  } else {
    tuning.rows = found->entry->buckets(leg);
    tuning.rows_from = detail::concat(found->where, " (", describe(key), ")");
  }
  return tuning;
}

EnvPin read_env_pin(Leg leg) {
  return {env_pin(leg == Leg::dispatch ? "FERRY_DISPATCH_BLOCKS" : "FERRY_COMBINE_BLOCKS")};
}

Choice choose(LegTuning const& tuning, EnvPin const& env, int num_tokens, Geometry analytic,
              std::string_view analytic_why) {
  // the first that speaks wins: pin, variable, table row, analytic default (choose.hpp)
  Choice choice;
  if (tuning.pin && tuning.pin->blocks > 0) {
    choice.geometry.blocks = tuning.pin->blocks;
    choice.source = tuning.leg == Leg::dispatch ? "EpConfig::dispatch_geometry" : "EpConfig::combine_geometry";
  } else if (env.blocks) {
    choice.geometry.blocks = *env.blocks;
    choice.source =
        detail::concat(tuning.leg == Leg::dispatch ? "FERRY_DISPATCH_BLOCKS=" : "FERRY_COMBINE_BLOCKS=", *env.blocks);
  } else if (BucketMatch const row = match_bucket(tuning.rows, num_tokens); row.bucket) {
    choice.geometry.blocks = row.bucket->geometry.blocks;
    choice.source = detail::concat(
        "table ", tuning.rows_from, " bucket <=", row.bucket->max_tokens, " tokens",
        row.nearest ? detail::concat(" (nearest: ", num_tokens, " tokens is past the largest)") : std::string());
  } else {
    choice.geometry.blocks = analytic.blocks;
    choice.source = detail::concat("analytic default (", analytic_why, "; ",
                                   tuning.rows_from.empty() ? "no table" : tuning.rows_from, ")");
  }
  return choice;
}

}  // namespace ferry::tuning
