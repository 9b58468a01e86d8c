// Low-latency combine over NVLink: one kernel (or, with the hook, its send half and its receive half apart).
//
// Send half (every CTA, warp per (received row, 1024-element chunk)):
//  1. expert-major: acc = fmaf(w[k], out(e_k, slot_k), acc) over the row's local entries, k ascending, rounded to bf16
//     (the canonical receiver order); rank-major: the caller's row. Stored straight into the source's landing zone
//     at (this rank, token) of the current parity: one row per (token, rank) on the wire;
//  2. per CTA: barrier, then +1 on every source's arrival counter of this rank (release, cumulative).
// Receive half (every CTA, warp per (own token, chunk)):
//  3. wait until every rank's arrivals reach seq * num_ctas (acquire; bounded);
//  4. y[t] = bf16(sum over destination ranks d ascending that hold t of float(landing[d][t])), from +0.0f.
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/ll_params.cuh"

namespace ferry::cuda_ll {

template <bool kExpertMajor>
__device__ __forceinline__ void ll_combine_send(LlCombineParams const& p, uint64_t seq) {
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const warp = tid >> 5;
  int const cta = static_cast<int>(blockIdx.x);
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  // written by the dispatch's receive half, earlier on the stream
  int const num_recv = p.state->num_recv;
  int const items = num_recv * num_chunks;

  for (int item = cta * kWarps + warp; item < items; item += p.num_ctas * kWarps) {
    int const row = item / num_chunks;
    int const v0 = (item % num_chunks) * kChunkVecs + lane;
    int const source = p.recv_src[2 * row];
    int const token = p.recv_src[2 * row + 1];
    auto* dst =
        reinterpret_cast<int4*>(p.sym[source] + p.layout.combine_rows +
                                ((static_cast<std::size_t>(parity) * world + rank) * p.max_tokens + token) * row_bytes);
    if constexpr (kExpertMajor) {
      int4 const* entry = nullptr;
      float w = 0.0f;
      bool valid = false;
      if (lane < topk) {
        std::size_t const at = static_cast<std::size_t>(row) * topk + lane;
        int32_t const el = p.recv_idx[at];
        int32_t const slot = p.recv_slot[at];
        valid = el >= 0 && slot >= 0;
        if (valid) {
          w = p.recv_w[at];
          entry = static_cast<int4 const*>(p.x) + (static_cast<std::size_t>(el) * p.expert_slots + slot) * num_vec;
        }
      }
      uint32_t const entries = __ballot_sync(0xffffffffu, valid);
      float acc[kUnroll][8];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
      for (uint32_t m = entries; m != 0; m &= m - 1) {
        int const k = __ffs(m) - 1;
        float const wk = __shfl_sync(0xffffffffu, w, k);
        auto const* src =
            reinterpret_cast<int4 const*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(entry), k));
        int4 v[kUnroll];
#pragma unroll
        for (int u = 0; u < kUnroll; ++u)
          if (v0 + u * 32 < num_vec) v[u] = device::arch::load_nc_v4(src + v0 + u * 32);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          float f[8];
          bf16x8_to_float(v[u], f);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[u][j] = __fmaf_rn(wk, f[j], acc[u][j]);
        }
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < num_vec) device::arch::store_na_v4(dst + v0 + u * 32, float_to_bf16x8(acc[u]));
    } else {
      auto const* src = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec;
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < num_vec) v[u] = device::arch::load_nc_v4(src + v0 + u * 32);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < num_vec) device::arch::store_na_v4(dst + v0 + u * 32, v[u]);
    }
  }

  // 2. arrival: the barrier orders every thread's rows before the release adds, which are cumulative over them
  //    (no per-thread fence, which would drain each thread's NVLink stores)
  __syncthreads();
  if (tid < world) device::signal_add(reinterpret_cast<uint64_t*>(p.sym[tid] + p.layout.combine_arrivals) + rank, 1);
}

__device__ __forceinline__ void ll_combine_recv(LlCombineParams const& p, uint64_t seq) {
  __shared__ int s_ok;
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const warp = tid >> 5;
  int const cta = static_cast<int>(blockIdx.x);
  int const parity = static_cast<int>(seq & 1);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;

  // 3. every rank's send CTAs of this call (thread d waits for rank d; acquire, bounded)
  if (tid == 0) s_ok = 1;
  __syncthreads();
  if (tid < world) {
    auto const* arrivals = reinterpret_cast<uint64_t const*>(p.sym[rank] + p.layout.combine_arrivals);
    if (!device::wait_signal_geq(p.view, arrivals + tid, seq * static_cast<uint64_t>(p.num_ctas), tid,
                                 WaitPhase::ll_combine))
      s_ok = 0;
  }
  __syncthreads();
  if (!s_ok) return;

  // 4. the sum, destination ranks ascending
  int const num_tokens = p.state->num_tokens;
  int const items = num_tokens * num_chunks;
  char const* landing =
      p.sym[rank] + p.layout.combine_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * row_bytes;
  for (int item = cta * kWarps + warp; item < items; item += p.num_ctas * kWarps) {
    int const token = item / num_chunks;
    int const v0 = (item % num_chunks) * kChunkVecs + lane;
    uint32_t const mask = p.token_mask[token];
    float acc[kUnroll][8];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      int const d = __ffs(m) - 1;
      auto const* src =
          reinterpret_cast<int4 const*>(landing + (static_cast<std::size_t>(d) * p.max_tokens + token) * row_bytes);
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < num_vec) v[u] = device::arch::load_v4(src + v0 + u * 32);  // coherent: a peer wrote it
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        float f[8];
        bf16x8_to_float(v[u], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], f[j]);
      }
    }
    auto* y = static_cast<int4*>(p.y) + static_cast<std::size_t>(token) * num_vec;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < num_vec) device::arch::store_na_v4(y + v0 + u * 32, float_to_bf16x8(acc[u]));
  }
}

template <bool kExpertMajor, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(LlCombineParams const p) {
  static_assert(kSend || kRecv, "an LL combine kernel runs at least one half");
  __shared__ uint64_t s_seq[2];
  int const cta = static_cast<int>(blockIdx.x);
  // 0. this CTA's sequence numbers (its own words, as in dispatch)
  if (threadIdx.x == 0) {
    if constexpr (kSend) s_seq[0] = ++p.state->combine_send_seq[cta];
    if constexpr (kRecv) s_seq[1] = ++p.state->combine_recv_seq[cta];
  }
  __syncthreads();
  if constexpr (kSend) ll_combine_send<kExpertMajor>(p, s_seq[0]);
  if constexpr (kRecv) ll_combine_recv(p, s_seq[1]);
}

}  // namespace ferry::cuda_ll
