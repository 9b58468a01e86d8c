#include "tuning/picker.hpp"

#include <algorithm>
#include <cmath>

#include "ferry/error.hpp"

namespace ferry::tuning {

Pick pick_geometry(std::vector<Measurement> const& candidates, double tolerance) {
  FERRY_CHECK(!candidates.empty(), "no candidate geometries to pick from");
  FERRY_CHECK(tolerance >= 0, "tolerance=", tolerance, " must be >= 0");
  std::size_t const routings = candidates.front().us.size();
  FERRY_CHECK(routings > 0, "candidate measurements have no routing");
  std::vector<double> best(routings, INFINITY);
  for (Measurement const& m : candidates) {
    FERRY_CHECK(m.us.size() == routings, "candidate blocks=", m.geometry.blocks, " has ", m.us.size(),
                " routings, the first has ", routings);
    for (std::size_t r = 0; r < routings; ++r) {
      FERRY_CHECK(std::isfinite(m.us[r]) && m.us[r] > 0, "candidate blocks=", m.geometry.blocks, " has time ", m.us[r],
                  " us under routing ", r, "; times must be positive");
      best[r] = std::min(best[r], m.us[r]);
    }
  }
  auto const worst_ratio = [&](Measurement const& m) {
    double worst = 0;
    for (std::size_t r = 0; r < routings; ++r) worst = std::max(worst, m.us[r] / best[r]);
    return worst;
  };
  auto const fewer = [](Measurement const& a, Measurement const& b) { return a.geometry.blocks < b.geometry.blocks; };
  Measurement const* chosen = nullptr;
  // 1. the fewest blocks within tolerance of the best under every routing
  for (Measurement const& m : candidates)
    if (worst_ratio(m) <= 1.0 + tolerance && (!chosen || fewer(m, *chosen))) chosen = &m;
  bool const within = chosen != nullptr;
  // 2. none is: the smallest worst ratio, ties to fewer blocks
  if (!chosen)
    for (Measurement const& m : candidates)
      if (!chosen || worst_ratio(m) < worst_ratio(*chosen) ||
          (worst_ratio(m) == worst_ratio(*chosen) && fewer(m, *chosen)))
        chosen = &m;
  return Pick{chosen->geometry, chosen->us, best, worst_ratio(*chosen), within};
}

}  // namespace ferry::tuning
