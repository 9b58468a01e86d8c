// Checks for CUDA runtime, CUDA driver and NCCL calls: a failed call throws CudaError / NcclError, formatted like every
// Ferry error ("cuda error (file:line): <call> failed: <name> (<text>); <what to do>"). Only for code built with the
// cuda backend (it includes the CUDA and NCCL headers).
#pragma once

#include <cuda.h>
#include <cuda_runtime_api.h>
#include <nccl.h>

#include <chrono>
#include <thread>

#include "core/interrupt.hpp"
#include "ferry/error.hpp"

namespace ferry::detail {

// The advice appended to every failed CUDA call. Most failures after start-up are a fault of an earlier kernel that
// the runtime reports at the next call; compute-sanitizer and CUDA_LAUNCH_BLOCKING=1 point at the real culprit.
inline constexpr char kCudaAdvice[] =
    "if this follows a kernel launch, an earlier kernel may have faulted: rerun with CUDA_LAUNCH_BLOCKING=1 or under "
    "compute-sanitizer; check the GPU is visible (nvidia-smi, CUDA_VISIBLE_DEVICES)";

[[noreturn]] inline void raise_cuda(char const* file, int line, char const* expr, cudaError_t error) {
  raise<CudaError>(
      "cuda", file, line,
      concat(expr, " failed: ", cudaGetErrorName(error), " (", cudaGetErrorString(error), "); ", kCudaAdvice));
}

// Driver results are reported by number: naming them would need cuGetErrorName, i.e. linking libcuda, which
// binaries that must start on machines without a driver (CI) cannot do. Driver entry points are fetched through
// cudaGetDriverEntryPointByVersion instead.
[[noreturn]] inline void raise_cu(char const* file, int line, char const* expr, CUresult result) {
  raise<CudaError>(
      "cuda", file, line,
      concat(expr, " failed: CUresult ", static_cast<int>(result), " (see cuda.h's CUresult); ", kCudaAdvice));
}

[[noreturn]] inline void raise_nccl(char const* file, int line, char const* expr, ncclResult_t result) {
  // ncclGetLastError holds the detail of the most recent failure on this thread (may be empty).
  char const* last = ncclGetLastError(nullptr);
  raise<NcclError>(
      "nccl", file, line,
      concat(expr, " failed: ", ncclGetErrorString(result), (last && *last) ? " - " : "", (last && *last) ? last : "",
             "; rerun with NCCL_DEBUG=WARN (or INFO) for NCCL's own account of the failure"));
}

}  // namespace ferry::detail

// Throws CudaError when a CUDA runtime call does not return cudaSuccess.
#define FERRY_CHECK_CUDA(expr)                                                                                       \
  do {                                                                                                               \
    cudaError_t const ferry_cuda_error_ = (expr);                                                                    \
    if (ferry_cuda_error_ != cudaSuccess) ::ferry::detail::raise_cuda(__FILE__, __LINE__, #expr, ferry_cuda_error_); \
  } while (0)

// Throws CudaError when a CUDA driver call does not return CUDA_SUCCESS.
#define FERRY_CHECK_CU(expr)                                                                                      \
  do {                                                                                                            \
    CUresult const ferry_cu_result_ = (expr);                                                                     \
    if (ferry_cu_result_ != CUDA_SUCCESS) ::ferry::detail::raise_cu(__FILE__, __LINE__, #expr, ferry_cu_result_); \
  } while (0)

// Throws NcclError when an NCCL call does not return ncclSuccess.
#define FERRY_CHECK_NCCL(expr)                                                                                         \
  do {                                                                                                                 \
    ncclResult_t const ferry_nccl_result_ = (expr);                                                                    \
    if (ferry_nccl_result_ != ncclSuccess) ::ferry::detail::raise_nccl(__FILE__, __LINE__, #expr, ferry_nccl_result_); \
  } while (0)

namespace ferry::detail {

// cudaStreamSynchronize; with an interrupt check set (include/ferry/interrupt.hpp), cudaStreamQuery in a loop that
// asks it every kInterruptPoll and throws Interrupted when it says so. The stream's work goes on: a kernel waiting for
// a late peer ends (or times out) on the device, and the next synchronisation reports it.
inline void synchronize_stream(cudaStream_t stream) {
  if (!interrupt_check_set()) {
    FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
    return;
  }
  auto const spin_until = std::chrono::steady_clock::now() + std::chrono::milliseconds(1);
  while (true) {
    cudaError_t const status = cudaStreamQuery(stream);
    if (status == cudaSuccess) return;
    if (status != cudaErrorNotReady) raise_cuda(__FILE__, __LINE__, "cudaStreamQuery(stream)", status);
    if (interrupt_requested())
      FERRY_THROW(Interrupted, "cuda",
                  "interrupted (a signal: KeyboardInterrupt in Python) while waiting for the GPU; its kernels go on, "
                  "and the next call or check_errors reports how they ended");
    if (std::chrono::steady_clock::now() > spin_until) std::this_thread::sleep_for(std::chrono::microseconds(20));
  }
}

}  // namespace ferry::detail
