// The rule `ferry tune` uses to turn measurements into a table row: per token bucket and leg, the fewest blocks whose
// time is within `tolerance` of the best under every routing measured (fewer CTAs leave SMs to the computation that
// overlaps communication, and a geometry that is near-best under both uniform and skewed routing is robust), ties
// broken by fewer blocks, so the pick is deterministic. Host-only; pure.
#pragma once

#include <string>
#include <vector>

#include "ferry/tuning.hpp"

namespace ferry::tuning {

// One candidate's scores: the median time under each routing (the same routing order for every candidate).
struct Measurement {
  Geometry geometry;
  std::vector<double> us;
};

struct Pick {
  Geometry geometry;
  std::vector<double> us;       // the pick's times, per routing
  std::vector<double> best_us;  // the best time of any candidate, per routing
  double worst_ratio = 0;       // max over routings of us / best_us
  // false when no candidate is within tolerance under every routing: then the pick minimises worst_ratio
  // (ties: fewer blocks).
  bool within_tolerance = true;
};

// Throws Error for no candidates, a candidate with a different number of routings, or a time that is not positive.
Pick pick_geometry(std::vector<Measurement> const& candidates, double tolerance);

}  // namespace ferry::tuning
