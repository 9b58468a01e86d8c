// What `ferry tune` may sweep on the cuda backend: the warps per CTA the normal-mode kernels are compiled for.
#include "ep/cuda/params.cuh"

namespace ferry::cli {

int normal_mode_kernel_warps() {
  return cuda_ep::kWarps;
}

}  // namespace ferry::cli
