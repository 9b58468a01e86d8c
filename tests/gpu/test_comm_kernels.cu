#include "test_comm_kernels.hpp"

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "core/cuda_check.hpp"

namespace ferry::test {
namespace {

struct CopyParams {
  void* dst;
  void const* src;
  std::size_t bytes;
};

__global__ void copy_kernel(CopyParams const params) {
  device::copy_16B<false>(params.dst, params.src, params.bytes, static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x),
                          static_cast<int>(gridDim.x * blockDim.x));
}

struct StampParams {
  uint64_t* peer_slot;
  uint64_t* counter;
};

// Plain store: the barrier that follows in stream order publishes it (kernel boundary, then the barrier's release).
__global__ void stamp_kernel(StampParams const params) {
  uint64_t const value = ++(*params.counter);
  *params.peer_slot = value;
}

struct VerifyParams {
  uint64_t const* own_slot;
  uint64_t const* counter;
  uint32_t* mismatches;
};

// Volatile load: the slot was written by another GPU; never trust a cached copy.
__global__ void verify_kernel(VerifyParams const params) {
  uint64_t const seen = *reinterpret_cast<uint64_t const volatile*>(params.own_slot);
  if (seen != *params.counter) ++(*params.mismatches);
}

struct InputErrorParams {
  DeviceView view;
  int bad_value;
  int count;
  int overflow;
};

__global__ void record_input_errors_kernel(InputErrorParams const params) {
  for (int i = 0; i < params.count; ++i) device::record_input_error(params.view, params.bad_value + i, false);
  for (int i = 0; i < params.overflow; ++i) device::record_input_error(params.view, 0, true);
}

}  // namespace

void launch_copy(void* dst, void const* src, std::size_t bytes, cudaStream_t stream) {
  copy_kernel<<<16, 512, 0, stream>>>(CopyParams{dst, src, bytes});
  FERRY_CHECK_CUDA(cudaGetLastError());
}

void launch_stamp(uint64_t* peer_slot, uint64_t* counter, cudaStream_t stream) {
  stamp_kernel<<<1, 1, 0, stream>>>(StampParams{peer_slot, counter});
  FERRY_CHECK_CUDA(cudaGetLastError());
}

void launch_verify(uint64_t const* own_slot, uint64_t const* counter, uint32_t* mismatches, cudaStream_t stream) {
  verify_kernel<<<1, 1, 0, stream>>>(VerifyParams{own_slot, counter, mismatches});
  FERRY_CHECK_CUDA(cudaGetLastError());
}

void launch_record_input_errors(DeviceView const& view, int bad_value, int count, int overflow, cudaStream_t stream) {
  record_input_errors_kernel<<<1, 1, 0, stream>>>(InputErrorParams{view, bad_value, count, overflow});
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ferry::test
