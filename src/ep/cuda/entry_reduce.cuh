// The expert-major combine's row reduction, shared by normal mode and low-latency mode: for one step of a row
// (vectors v0 + u * 32, u < kUnroll, of each entry's expert output row), the canonical fmaf chain over the row's
// local entries in ascending k, from +0.0f: acc = fmaf(w_k, x_k, acc).
#pragma once

#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/device/bf16x8.cuh"

namespace ferry::device {

// Takes the lowest entry of m (m loses it): its weight into wk, and its expert row's address, shuffled from the lane
// that holds them (lane k holds entry k's w and entry). Every lane of the warp must call it with the same m.
__device__ __forceinline__ int4 const* next_entry(uint32_t& m, float w, int4 const* entry, float& wk) {
  int const k = __ffs(m) - 1;
  m &= m - 1;
  wk = __shfl_sync(0xffffffffu, w, k);
  return reinterpret_cast<int4 const*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(entry), k));
}

template <int kRows>
__device__ __forceinline__ void zero_acc(float (&acc)[kRows][8]) {
#pragma unroll
  for (int u = 0; u < kRows; ++u)
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
}

// acc[u] += the bf16 vector src[v0 + u * 32] for each u with v0 + u * 32 < end, in fp32: every load issued before the
// first add. Coherent loads: the rows may be a peer's writes, acquired by the caller (never the non-coherent path).
template <int kRows>
__device__ __forceinline__ void add_bf16_vectors(int4 const* src, int v0, int end, float (&acc)[kRows][8]) {
  int4 v[kRows];
#pragma unroll
  for (int u = 0; u < kRows; ++u)
    if (v0 + u * 32 < end) v[u] = arch::load_v4(src + v0 + u * 32);
#pragma unroll
  for (int u = 0; u < kRows; ++u) {
    float f[8];
    bf16x8_to_float(v[u], f);
#pragma unroll
    for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], f[j]);
  }
}

// entries: the lanes k holding a valid entry (the same on every lane); lane k holds that entry's weight in w and its
// row's address in entry. Every lane of the warp must call it with the same entries (the shuffles need the warp);
// vectors at or past num_vec are neither loaded nor summed.
// NOTE: pipelined over the entries: entry k+1's loads are issued before entry k's arithmetic, so a step waits for
// one memory round trip rather than one per entry (a row of a random top-8 routing has about 4 local entries at
// world 2, and the reduction was latency-bound on those round trips).
template <int kUnroll>
__device__ __forceinline__ void reduce_entries_step(uint32_t entries, float w, int4 const* entry, int v0, int num_vec,
                                                    float (&acc)[kUnroll][8]) {
  zero_acc(acc);
  if (entries == 0) return;
  // the next entry of m (m loses it): its weight into wk and its vectors of this step into v
  auto fetch = [&](uint32_t& m, float& wk, int4(&v)[kUnroll]) {
    int4 const* const src = next_entry(m, w, entry, wk);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < num_vec) v[u] = arch::load_nc_v4(src + v0 + u * 32);
  };
  uint32_t m = entries;
  float wk;
  int4 v[kUnroll];
  fetch(m, wk, v);
  while (true) {
    bool const more = m != 0;  // the same on every lane
    float next_w = 0.0f;
    int4 next[kUnroll];
    if (more) fetch(m, next_w, next);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      float f[8];
      bf16x8_to_float(v[u], f);
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = __fmaf_rn(wk, f[j], acc[u][j]);
    }
    if (!more) break;
    wk = next_w;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) v[u] = next[u];
  }
}

// The same chain for a small step (kVecs vectors per lane: v0 + u * 32 below v_end), with the loads of kGroup entries
// issued before the first product: a row of up to kGroup local entries costs one memory round trip instead of one per
// entry. For small batches, whose rows are split into chunks of 32 or 64 vectors so that every warp of the grid has
// one (the pipelined step above needs kUnroll vectors per lane to pay off).
template <int kVecs, int kGroup>
__device__ __forceinline__ void reduce_entries_grouped(uint32_t entries, float w, int4 const* entry, int v0, int v_end,
                                                       float (&acc)[kVecs][8]) {
  zero_acc(acc);
  for (uint32_t m = entries; m != 0;) {  // m is the same on every lane
    float wk[kGroup];
    int4 v[kGroup][kVecs];
    int n = 0;
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (m == 0) break;
      int4 const* const src = next_entry(m, w, entry, wk[g]);
#pragma unroll
      for (int u = 0; u < kVecs; ++u)
        if (v0 + u * 32 < v_end) v[g][u] = arch::load_nc_v4(src + v0 + u * 32);
      n = g + 1;
    }
#pragma unroll
    for (int g = 0; g < kGroup; ++g) {
      if (g >= n) break;
#pragma unroll
      for (int u = 0; u < kVecs; ++u) {
        float f[8];
        bf16x8_to_float(v[g][u], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = __fmaf_rn(wk[g], f[j], acc[u][j]);
      }
    }
  }
}

}  // namespace ferry::device
