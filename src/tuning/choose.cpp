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
  bool const dispatch = leg == Leg::dispatch;
  return {env_pin(dispatch ? "FERRY_DISPATCH_BLOCKS" : "FERRY_COMBINE_BLOCKS"),
          env_pin(dispatch ? "FERRY_DISPATCH_WARPS" : "FERRY_COMBINE_WARPS")};
}

Choice choose(LegTuning const& tuning, EnvPin const& env, int num_tokens, Geometry analytic,
              std::string_view analytic_why, int kernel_warps) {
  bool const dispatch = tuning.leg == Leg::dispatch;
  std::string const pin_name = dispatch ? "EpConfig::dispatch_geometry" : "EpConfig::combine_geometry";
  std::string const env_prefix = dispatch ? "FERRY_DISPATCH_" : "FERRY_COMBINE_";
  BucketMatch const row = match_bucket(tuning.rows, num_tokens);
  std::string row_source;
  if (row.bucket)
    row_source = detail::concat(
        "table ", tuning.rows_from, " bucket <=", row.bucket->max_tokens, " tokens",
        row.nearest ? detail::concat(" (nearest: ", num_tokens, " tokens is past the largest)") : std::string());
  std::string const default_source = detail::concat("analytic default (", analytic_why, "; ",
                                                    tuning.rows_from.empty() ? "no table" : tuning.rows_from, ")");

  Choice choice;
  std::string blocks_source, warps_source;
  // 1. blocks
  if (tuning.pin && tuning.pin->blocks > 0) {
    choice.geometry.blocks = tuning.pin->blocks;
    blocks_source = pin_name;
  } else if (env.blocks) {
    choice.geometry.blocks = *env.blocks;
    blocks_source = detail::concat(env_prefix, "BLOCKS=", *env.blocks);
  } else if (row.bucket) {
    choice.geometry.blocks = row.bucket->geometry.blocks;
    blocks_source = row_source;
  } else {
    choice.geometry.blocks = analytic.blocks;
    blocks_source = default_source;
  }
  // 2. warps: a pin the kernels cannot run is an error; a table row they cannot run is reported
  if (tuning.pin && tuning.pin->warps > 0) {
    FERRY_CHECK_CONFIG(kernel_warps == 0 || tuning.pin->warps == kernel_warps, pin_name, ".warps=", tuning.pin->warps,
                       " is not available: the kernels run ", kernel_warps, " warps per CTA; use 0 (choose) or ",
                       kernel_warps);
    choice.geometry.warps = tuning.pin->warps;
    warps_source = pin_name;
  } else if (env.warps) {
    FERRY_CHECK_CONFIG(kernel_warps == 0 || *env.warps == kernel_warps, env_prefix, "WARPS=", *env.warps,
                       " is not available: the kernels run ", kernel_warps, " warps per CTA; unset it or set ",
                       kernel_warps);
    choice.geometry.warps = *env.warps;
    warps_source = detail::concat(env_prefix, "WARPS=", *env.warps);
  } else if (row.bucket) {
    int const asked = row.bucket->geometry.warps;
    if (kernel_warps != 0 && asked != kernel_warps) {
      choice.geometry.warps = kernel_warps;
      warps_source = detail::concat(row_source, " asks ", asked, " warps, which these kernels do not run (",
                                    kernel_warps, " only): ran ", kernel_warps, "; re-tune this table");
    } else {
      choice.geometry.warps = asked;
      warps_source = row_source;
    }
  } else {
    choice.geometry.warps = kernel_warps != 0 ? kernel_warps : analytic.warps;
    warps_source = default_source;
  }
  choice.source = blocks_source == warps_source ? blocks_source
                                                : detail::concat("blocks: ", blocks_source, "; warps: ", warps_source);
  return choice;
}

}  // namespace ferry::tuning
