// Bit sets of destinations in one register: the lowest member of a 32- or 64-bit set, so that code walking a set
// (for (m = set; m != 0; m &= m - 1) f(lowest(m))) takes either width. One node's kernels walk 32-bit sets of world
// ranks; across nodes they walk 64-bit sets of this node's ranks plus the staged row (ll/dispatch.cuh).
#pragma once

#include <cstdint>

namespace ferry::device {

__device__ __forceinline__ int lowest(uint32_t set) {
  return __ffs(set) - 1;
}
__device__ __forceinline__ int lowest(uint64_t set) {
  return __ffsll(static_cast<long long>(set)) - 1;
}

}  // namespace ferry::device
