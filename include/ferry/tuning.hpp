// Launch geometry of a kernel leg (EpConfig::dispatch_geometry / combine_geometry pin it).
#pragma once

namespace ferry {

// The CTA count a leg launches with; 0 = choose (FERRY_*_BLOCKS, then the tuning table, then the kernels' default:
// docs/tuning.md). Warps per CTA are not a setting: every kernel is compiled for 16 warps.
struct Geometry {
  int blocks = 0;  // CTAs; 0 = choose
  bool operator==(Geometry const&) const = default;
};

}  // namespace ferry
