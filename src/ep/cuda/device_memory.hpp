// Local device allocations of the cuda backends (cuda_ep.cu, ll_ep.cu). Every allocation holds at least one element,
// so a config with an empty area still gets a valid pointer; device_free frees and nulls (again: a no-op).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "core/cuda_check.hpp"

namespace ferry::detail {

// count elements of T (at least one). Throws CudaError.
template <typename T>
T* device_alloc(std::size_t count) {
  void* ptr = nullptr;
  FERRY_CHECK_CUDA(cudaMalloc(&ptr, std::max<std::size_t>(count, 1) * sizeof(T)));
  return static_cast<T*>(ptr);
}

// count elements of T (at least one), zeroed with cudaMemset (the default stream: synchronize the device before
// another stream uses them). Throws CudaError; then nothing stays allocated.
template <typename T>
T* device_zeroed(std::size_t count) {
  T* const ptr = device_alloc<T>(count);
  try {
    FERRY_CHECK_CUDA(cudaMemset(ptr, 0, std::max<std::size_t>(count, 1) * sizeof(T)));
  } catch (...) {
    cudaFree(ptr);
    throw;
  }
  return ptr;
}

// Frees ptr (when set) and nulls it. Never throws: a failed free at teardown has no one to report to.
template <typename T>
void device_free(T*& ptr) noexcept {
  if (ptr) cudaFree(ptr);
  ptr = nullptr;
}

}  // namespace ferry::detail
