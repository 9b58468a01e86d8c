// The tuning table's key of an EpBuffer (tuning/table.hpp's TuningKey): here, in the ep layer, because it reads an
// EpConfig (the tuning layer sits below ep and does not know it).
#pragma once

#include <string_view>

#include "ferry/ep.hpp"
#include "tuning/table.hpp"

namespace ferry::detail {

// The key of an EpBuffer with this config on `world` ranks of GPU model `gpu` (any spelling).
tuning::TuningKey tuning_key(std::string_view gpu, int world, EpConfig const& config);

}  // namespace ferry::detail
