// Vector copies of rows: 16 bytes per thread per step, several loads in flight before the stores.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/device/work_items.hpp"  // chunk_range, chunks_per_row: the (row, chunk) items of the kernels

namespace ferry::device {

inline constexpr int kVecBytes = 16;

// Copies `bytes` (a multiple of 16, both pointers 16-byte aligned) with the threads [lane, lane + stride, ...] of a
// group of `stride` threads. Unrolled by kUnroll so that kUnroll loads are in flight before the first store.
// kNcSource: the source is read-only for the kernel's duration (caller input) and may use the non-coherent path.
template <bool kNcSource, int kUnroll = 4>
__device__ __forceinline__ void copy_16B(void* dst, void const* src, std::size_t bytes, int lane, int stride) {
  auto* d = static_cast<int4*>(dst);
  auto const* s = static_cast<int4 const*>(src);
  std::size_t const n = bytes / kVecBytes;
  // every step issues up to kUnroll loads before its stores, the last one too (predicated): a tail copied one vector
  // at a time waited one round trip per vector
  for (std::size_t i = lane; i < n; i += kUnroll * static_cast<std::size_t>(stride)) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * stride < n)
        v[u] = kNcSource ? arch::load_nc_v4(s + i + u * stride) : arch::load_v4(s + i + u * stride);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * stride < n) arch::store_na_v4(d + i + u * stride, v[u]);
  }
}

// Copies src[g] to dst[g] (`bytes` each, as copy_16B) for the `pairs` pairs at once: the grid's CTAs are dealt over the
// pairs round-robin (CTA c copies pair c % pairs, with the other CTAs of that pair), so every pair's copy runs from the
// grid's start: an all-to-all over NVLink keeps every peer's link busy. Needs gridDim.x >= pairs; every thread of
// the grid must call it.
template <bool kNcSource, int kUnroll = 4>
__device__ __forceinline__ void copy_16B_dealt(void* const* dst, void const* const* src, int pairs, std::size_t bytes) {
  int const cta = static_cast<int>(blockIdx.x);
  int const pair = cta % pairs;
  int const ctas_of_pair = (static_cast<int>(gridDim.x) - pair + pairs - 1) / pairs;
  int const block = static_cast<int>(blockDim.x);
  copy_16B<kNcSource, kUnroll>(dst[pair], src[pair], bytes, (cta / pairs) * block + static_cast<int>(threadIdx.x),
                               ctas_of_pair * block);
}

// Warp-wide copy: every lane of the warp must call it.
template <bool kNcSource = false>
__device__ __forceinline__ void copy_warp_16B(void* dst, void const* src, std::size_t bytes) {
  copy_16B<kNcSource>(dst, src, bytes, static_cast<int>(threadIdx.x % 32), 32);
}

// Block-wide copy: every thread of the block must call it.
template <bool kNcSource = false>
__device__ __forceinline__ void copy_block_16B(void* dst, void const* src, std::size_t bytes) {
  copy_16B<kNcSource>(dst, src, bytes, static_cast<int>(threadIdx.x), static_cast<int>(blockDim.x));
}

}  // namespace ferry::device
