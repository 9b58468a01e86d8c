// The launch of a grid whose CTAs wait for each other (the normal-mode dispatch and combine, the LL legs), shared by
// both backends' launchers. Included by .cu files only.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>

#include "core/cuda_check.hpp"

namespace ferry::cuda_grid {

// Launches `kernel` on ctas CTAs of kBlockThreads threads with smem bytes of dynamic shared memory (at most the
// default 48 KiB: no kernel here raises its limit). cooperative (the backends' default, Buffers::cooperative): the
// runtime refuses a grid that cannot be co-resident instead of letting it deadlock until the timeout; off, the grid
// launches plainly (the virtual-rank tests, whose grids run side by side on one GPU, co-resident by their size).
template <int kBlockThreads, typename Params>
void launch_grid(void (*kernel)(Params), Params const& params, int ctas, std::size_t smem, bool cooperative,
                 cudaStream_t stream) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(kBlockThreads);
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  config.attrs = &attribute;
  config.numAttrs = cooperative ? 1 : 0;
  FERRY_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, params));
}

}  // namespace ferry::cuda_grid
