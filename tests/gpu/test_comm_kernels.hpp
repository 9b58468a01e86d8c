// Small kernels the communicator tests launch (tests/gpu/test_comm_kernels.cu). cuda builds only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>

#include "ferry/device_view.hpp"

namespace ferry::test {

// Copies bytes (a multiple of 16) from src to dst with 16-byte vectors; either side may be a peer's LSA address.
void launch_copy(void* dst, void const* src, std::size_t bytes, cudaStream_t stream);

// ++*counter, then writes the new value into *peer_slot (a word in the peer's memory).
void launch_stamp(uint64_t* peer_slot, uint64_t* counter, cudaStream_t stream);

// ++*mismatches unless *own_slot (written by the peer's stamp) equals *counter (our own stamp count).
void launch_verify(uint64_t const* own_slot, uint64_t const* counter, uint32_t* mismatches, cudaStream_t stream);

// Records `count` dropped ids (the first with bad_value) and `overflow` dropped rows in the view's error block.
void launch_record_input_errors(DeviceView const& view, int bad_value, int count, int overflow, cudaStream_t stream);

}  // namespace ferry::test
