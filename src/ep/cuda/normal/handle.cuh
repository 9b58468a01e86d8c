// The copy of a normal-mode dispatch's layout into a dispatch handle's storage, and back (EpBuffer::make_handle,
// DispatchArgs::save_handle, CombineArgs::handle, the backward passes).
//
// One small kernel, both directions: a list of areas of 4-byte words (HandleCopyParams), each a fixed number of
// words or a number of rows read on the device (the layout's received rows, so the host never waits for num_recv),
// copied by the whole grid (16-byte vectors, then the tail words). On save it also narrows the dispatch's ids to int32
// (a cached dispatch reads them as int32). It never waits for a peer: the dispatch before it (stream order) has
// acquired every row this rank received, and a restore runs between calls, when no peer writes this rank's receive
// areas (they do so only during a dispatch this rank has joined).
#pragma once

#include <cstdint>

#include "ep/cuda/normal/params.cuh"

namespace ferry::cuda_ep {

// Words [0, n) from src to dst, by thread `thread` of `threads`: 16-byte vectors when both pointers are 16-byte
// aligned, then the tail; words alone otherwise. NOTE: not every area is: the layout words of DeviceState start at
// byte 44 of it, and a caller's topk_weights need only be 4-byte aligned (a misaligned vector load faults the context).
__device__ __forceinline__ void copy_words(uint32_t* dst, uint32_t const* src, std::size_t n, std::size_t thread,
                                           std::size_t threads) {
  bool const aligned = ((reinterpret_cast<uintptr_t>(dst) | reinterpret_cast<uintptr_t>(src)) & 15u) == 0;
  std::size_t const vectors = aligned ? n / 4 : 0;
  auto* const dst4 = reinterpret_cast<int4*>(dst);
  auto const* const src4 = reinterpret_cast<int4 const*>(src);
  for (std::size_t i = thread; i < vectors; i += threads) dst4[i] = src4[i];
  for (std::size_t i = vectors * 4 + thread; i < n; i += threads) dst[i] = src[i];
}

__global__ void __launch_bounds__(kThreads) handle_copy_kernel(HandleCopyParams const p) {
  std::size_t const thread = static_cast<std::size_t>(blockIdx.x) * kThreads + threadIdx.x;
  std::size_t const threads = static_cast<std::size_t>(gridDim.x) * kThreads;
  // the received rows of the layout (written by the dispatch before this kernel, or saved with the handle)
  int const num_rows = *p.num_rows;
  for (int a = 0; a < p.num_areas; ++a) {
    HandleArea const area = p.areas[a];
    int const rows = area.counted ? max(0, min(num_rows, area.rows)) : area.rows;
    copy_words(static_cast<uint32_t*>(area.dst), static_cast<uint32_t const*>(area.src),
               static_cast<std::size_t>(rows) * area.words_per_row, thread, threads);
  }
  if (p.counts != nullptr) {
    std::size_t const world = static_cast<std::size_t>(p.world);
    uint64_t const* const rows = p.counts + (*p.seq & 1) * world * p.count_words;
    for (std::size_t i = thread; i < world * world; i += threads)
      p.counts_dst[i] = count_value(rows[i / world * p.count_words + 1 + i % world]);
  }
  // save: the ids as int32; an int64 id outside int32 (a bad id: that dispatch was refused) stays a bad id (-2)
  for (std::size_t i = thread; i < static_cast<std::size_t>(p.num_ids); i += threads) {
    if (p.widen) {
      static_cast<int64_t*>(p.ids_dst)[i] = static_cast<int32_t const*>(p.ids)[i];
    } else if (p.ids_64) {
      int64_t const id = static_cast<int64_t const*>(p.ids)[i];
      static_cast<int32_t*>(p.ids_dst)[i] = id < -1 || id > INT32_MAX ? -2 : static_cast<int32_t>(id);
    } else {
      static_cast<int32_t*>(p.ids_dst)[i] = static_cast<int32_t const*>(p.ids)[i];
    }
  }
}

}  // namespace ferry::cuda_ep
