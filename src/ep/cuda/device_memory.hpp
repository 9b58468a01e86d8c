// Local device allocations of the cuda backend (buffers.cu, cuda_ep.cu). Every allocation holds at least one element,
// so a config with an empty area still gets a valid pointer; device_free frees and nulls (again: a no-op).
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstddef>

#include "core/cuda_check.hpp"
#include "core/log.hpp"
#include "ferry/communicator.hpp"

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

// A backend's teardown (destructor, or a constructor that throws): waits for the device, so that no kernel of this
// buffer still runs on any stream, then free_local() (the local buffers) and gives the symmetric region back
// (Communicator::release_symmetric: its peers reach it no more once their own kernels of this buffer ended). A failed
// synchronisation is logged (a teardown has no one to throw to) and the memory is given back all the same. `region`
// is emptied (again: a no-op). Never throws.
template <typename FreeLocal>
void release_backend_memory(Communicator& comm, SymmetricRegion& region, char const* what,
                            FreeLocal const& free_local) noexcept {
  if (cudaError_t const err = cudaDeviceSynchronize(); err != cudaSuccess)
    FERRY_LOG_ERROR(what, " teardown: cudaDeviceSynchronize failed (", cudaGetErrorString(err),
                    "); its memory is given back anyway");
  free_local();
  if (region.local != nullptr) comm.release_symmetric(region);
  region = SymmetricRegion{};
}

}  // namespace ferry::detail
