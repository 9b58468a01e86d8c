// A device-side delay for `ferry bench`: keeps the stream busy while the host enqueues the timed leg, so the timed
// region measures the leg on a stream that already holds it (as inside an engine's captured forward pass), not the
// host's launch latency.
#include <cuda_runtime.h>

#include "bench_memory.hpp"
#include "comm/device/arch_sm90.cuh"
#include "core/cuda_check.hpp"

namespace ferry::bench {
namespace {

__global__ void delay_kernel(uint64_t ns) {
  uint64_t const start = device::arch::global_timer_ns();
  while (device::arch::global_timer_ns() - start < ns) __nanosleep(1000);
}

__global__ void empty_kernel() {}

struct ParamBlob {
  unsigned char bytes[kLaunchParamBytes];
};
__global__ void empty_params_kernel(ParamBlob) {}

}  // namespace

namespace {
// cudaLaunchKernelEx of `kernel` on ctas x threads, with the cooperative attribute or without any
template <typename... Args>
void launch_ex(BenchMemory& memory, int ctas, int threads, bool cooperative, void (*kernel)(Args...), Args... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(static_cast<unsigned>(ctas));
  config.blockDim = dim3(static_cast<unsigned>(threads));
  config.stream = memory.stream();
  cudaLaunchAttribute attribute{};
  attribute.id = cudaLaunchAttributeCooperative;
  attribute.val.cooperative = 1;
  config.attrs = &attribute;
  config.numAttrs = cooperative ? 1 : 0;
  FERRY_CHECK_CUDA(cudaLaunchKernelEx(&config, kernel, args...));
}
}  // namespace

void enqueue_empty(BenchMemory& memory, int ctas, int threads, bool cooperative) {
  if (memory.backend() != Backend::cuda) return;
  launch_ex(memory, ctas, threads, cooperative, empty_kernel);
}

void enqueue_empty_params(BenchMemory& memory, int ctas, int threads, LaunchApi api) {
  if (memory.backend() != Backend::cuda) return;
  ParamBlob const blob{};
  if (api == LaunchApi::chevrons) {
    empty_params_kernel<<<ctas, threads, 0, memory.stream()>>>(blob);
    FERRY_CHECK_CUDA(cudaGetLastError());
    return;
  }
  launch_ex(memory, ctas, threads, api == LaunchApi::launch_ex_cooperative, empty_params_kernel, blob);
}

void enqueue_delay(BenchMemory& memory, double us) {
  if (memory.backend() != Backend::cuda) return;
  delay_kernel<<<1, 1, 0, memory.stream()>>>(static_cast<uint64_t>(us * 1000.0));
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ferry::bench
