// EpBuffer's two modes (include/ferry/ep.hpp, docs/design.md "Modes"), apart from ep.hpp so that the layers below
// the EP layer (the tuning tables, keyed by mode) name them too.
#pragma once

#include <string>

#include "ferry/error.hpp"

namespace ferry {

// normal: throughput (prefill, training); low_latency: decode, one kernel per leg.
enum class Mode { normal, low_latency };

inline char const* mode_name(Mode mode) {
  return mode == Mode::normal ? "normal" : "ll";
}

// "normal" | "ll" (or "low_latency"); ConfigError naming the allowed words for another.
inline Mode parse_mode(std::string const& name) {
  if (name == "normal") return Mode::normal;
  if (name == "ll" || name == "low_latency") return Mode::low_latency;
  FERRY_THROW(ConfigError, "config", "mode '", name, "' is unknown; use normal or ll");
}

}  // namespace ferry
