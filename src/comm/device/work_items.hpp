// Arithmetic of the kernels' (row, chunk) work items, shared by the device code (normal/dispatch.cuh, normal/combine.cuh, the LL
// kernels) and the host tests (tests/unit/test_work_items.cpp): a row of n 16-byte vectors is split into `chunks`
// near-equal parts, and a small batch picks enough chunks per row that every warp of its grid has an item.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define FERRY_WORK_HD __host__ __device__ __forceinline__
#else
#define FERRY_WORK_HD inline
#endif

namespace ferry::device {

// Part `chunk` of `chunks` near-equal parts of [0, n): the vectors a (row, chunk) work item covers. The parts are
// contiguous, cover [0, n) in order, and their sizes differ by at most one.
struct ChunkRange {
  int begin;
  int end;
};

FERRY_WORK_HD ChunkRange chunk_range(int n, int chunk, int chunks) {
  return {static_cast<int>(static_cast<int64_t>(n) * chunk / chunks),
          static_cast<int>(static_cast<int64_t>(n) * (chunk + 1) / chunks)};
}

// Chunks per row when `warps` warps share `rows` rows of `num_vec` 16-byte vectors as (row, chunk) work items: a batch
// with fewer rows than warps splits each row so that every warp has bytes in flight (one warp walking a 14 KB row
// waits for ~7 memory round trips one after another), down to one vector per lane (32 vectors a chunk). Never more
// than one item per warp on average, never fewer than one chunk.
FERRY_WORK_HD int chunks_per_row(int rows, int warps, int num_vec) {
  if (rows <= 0 || rows >= warps) return 1;
  int const most = (num_vec + 31) / 32;
  int const want = warps / rows;
  int const chunks = want < most ? want : most;
  return chunks > 1 ? chunks : 1;
}

// Chunks per row when a row's chunks must be worked by warps of one CTA (a quantized LL send: nvfp4's token scale is
// the max over the chunks' amaxes, met in shared memory): the largest power of two that is at most cta_warps (a power
// of two, so the chunks of a row never straddle two CTAs), warps / rows (one item per warp on average) and `groups`
// (the pieces a chunk may not split, e.g. a row's scale blocks). Never fewer than one.
FERRY_WORK_HD int cta_chunks_per_row(int rows, int warps, int groups, int cta_warps) {
  int const want = rows > 0 ? warps / rows : 1;
  int most = cta_warps < want ? cta_warps : want;
  most = most < groups ? most : groups;
  int chunks = 1;
  while (chunks * 2 <= most) chunks *= 2;
  return chunks;
}

}  // namespace ferry::device
