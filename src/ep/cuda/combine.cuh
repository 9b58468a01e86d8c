// Normal-mode combine over NVLink: push, pipelined by token tiles.
//
// The grid splits in two roles that run at the same time:
//  - push CTAs take items (tile j of source s): the rows this rank received from s for s's tokens of tile j (found by
//    binary search: a source's rows are contiguous and in token order). Each row is reduced on the spot
//    (expert-major: acc = fmaf(w, x, acc) over k ascending, rounded to bf16; rank-major: the caller's row) and stored
//    straight into s's landing zone at [this rank][token] over NVLink. After the tile, one release flag on s.
//  - sum CTAs take this rank's tiles in order, wait for the flag of every rank, and write
//    y[t] = bf16(sum over d ascending of float(landing[d][t])) for the destinations d that hold t.
// Items go in tile order on both sides, so a source's first tiles complete while later ones are still in flight:
// the HBM-bound sum overlaps the NVLink-bound push instead of following it.
// Sequence numbers (DeviceState::combine_seq) make flags monotone; the landing zone alternates by parity because a
// fast peer may push call n+1 while this rank still sums call n (it cannot be two calls ahead: call n+1 needs this
// rank's flags of call n+1).
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/device/bf16x8.cuh"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/params.cuh"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ep {

// 16-byte vectors per lane per step (8 bf16 each): loads in flight per entry before the arithmetic.
inline constexpr int kCombineUnroll = 4;

using device::bf16x8_to_float;
using device::float_to_bf16x8;

// Receiver side of one row, expert-major: the canonical fmaf chain over the row's local entries (k ascending).
__device__ __forceinline__ void reduce_expert_row(CombineParams const& p, int row, int4* dst, int lane) {
  int const topk = p.topk;
  int const num_vec = p.hidden / 8;
  int4 const* entry = nullptr;
  float w = 0.0f;
  bool valid = false;
  if (lane < topk) {
    int32_t const el = reinterpret_cast<int32_t const*>(p.sym[p.view.rank] + p.layout.recv_idx)[row * topk + lane];
    int32_t const slot = p.recv_slot[row * topk + lane];
    valid = el >= 0 && slot >= 0;
    if (valid) {
      w = reinterpret_cast<float const*>(p.sym[p.view.rank] + p.layout.recv_w)[row * topk + lane];
      entry = static_cast<int4 const*>(p.x) + (static_cast<std::size_t>(el) * p.expert_slots + slot) * num_vec;
    }
  }
  uint32_t const entries = __ballot_sync(0xffffffffu, valid);
  for (int i = lane; i < num_vec; i += 32 * kCombineUnroll) {
    float acc[kCombineUnroll][8];
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u)
#pragma unroll
      for (int j = 0; j < 8; ++j) acc[u][j] = 0.0f;
    for (uint32_t m = entries; m != 0; m &= m - 1) {
      int const k = __ffs(m) - 1;
      float const wk = __shfl_sync(0xffffffffu, w, k);
      auto const* src =
          reinterpret_cast<int4 const*>(__shfl_sync(0xffffffffu, reinterpret_cast<unsigned long long>(entry), k));
      int4 v[kCombineUnroll];
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u)
        if (i + u * 32 < num_vec) v[u] = device::arch::load_nc_v4(src + i + u * 32);
#pragma unroll
      for (int u = 0; u < kCombineUnroll; ++u) {
        float f[8];
        bf16x8_to_float(v[u], f);
#pragma unroll
        for (int j = 0; j < 8; ++j) acc[u][j] = __fmaf_rn(wk, f[j], acc[u][j]);
      }
    }
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u)
      if (i + u * 32 < num_vec) device::arch::store_na_v4(dst + i + u * 32, float_to_bf16x8(acc[u]));
  }
}

// First row in [lo, hi) of the receive buffers whose source token is >= token (rows of one source ascend by token).
__device__ __forceinline__ int lower_bound_token(int2 const* recv_src, int lo, int hi, int token) {
  while (lo < hi) {
    int const mid = (lo + hi) / 2;
    if (recv_src[mid].y < token)
      lo = mid + 1;
    else
      hi = mid;
  }
  return lo;
}

template <bool kExpertMajor>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams const p) {
  __shared__ uint64_t s_seq;
  __shared__ int s_ok;
  __shared__ int s_rows[2];

  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const warp = tid >> 5;
  int const cta = static_cast<int>(blockIdx.x);
  int const num_vec = p.hidden / 8;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  FERRY_TRACE_WARP(trace, p.trace);

  // 0. this call's sequence number (written by the previous call's last CTA; stream order makes it visible)
  if (tid == 0) {
    s_seq = p.state->combine_seq + 1;
    s_ok = 1;
  }
  __syncthreads();
  uint64_t const seq = s_seq;
  int const parity = static_cast<int>(seq & 1);

  if (cta < p.num_push_ctas) {
    // 1. push role: items (tile j, source s) in tile order; sources rotated so ranks start on different peers
    int max_tiles = 0;
    for (int s = 0; s < world; ++s) max_tiles = max(max_tiles, combine_num_tiles(p.state->src_tokens[s]));
    auto const* recv_src = reinterpret_cast<int2 const*>(p.sym[rank] + p.layout.recv_src);
    for (int q = cta; q < max_tiles * world; q += p.num_push_ctas) {
      int const j = q / world;
      int const s = (rank + 1 + q % world) % world;
      int const src_tokens = p.state->src_tokens[s];
      if (j >= combine_num_tiles(src_tokens)) continue;
      FERRY_TRACE_BEGIN(trace, combine_push);
      int const tile = combine_tile_tokens(src_tokens);
      if (tid < 2) {
        int const first = p.state->src_offset[s];
        int const token = tid == 0 ? j * tile : min((j + 1) * tile, src_tokens);
        s_rows[tid] = lower_bound_token(recv_src, first, first + p.state->src_count[s], token);
      }
      __syncthreads();
      char* landing =
          p.sym[s] + p.layout.landing + static_cast<std::size_t>(parity * world + rank) * p.max_tokens * row_bytes;
      for (int row = s_rows[0] + warp; row < s_rows[1]; row += kWarps) {
        int const t = recv_src[row].y;
        auto* dst = reinterpret_cast<int4*>(landing + static_cast<std::size_t>(t) * row_bytes);
        if constexpr (kExpertMajor) {
          reduce_expert_row(p, row, dst, lane);
        } else {
          auto const* src = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec;
          device::copy_16B<true, kCombineUnroll>(dst, src, row_bytes, lane, 32);
        }
      }
      // NOTE: no per-thread fence (it would drain every thread's NVLink stores after each tile and stall the
      // pipeline): the barrier orders every thread's rows before thread 0's release, which is cumulative.
      __syncthreads();
      // release: every row of the tile (all threads, ordered by the barrier) before the flag
      if (tid == 0)
        device::signal_set(reinterpret_cast<uint64_t*>(p.sym[s] + p.layout.tile_flags) + rank * kMaxCombineTiles + j,
                           seq);
      FERRY_TRACE_END(trace, combine_push);
    }
  } else {
    // 2. sum role: this rank's tiles in order
    int const my_tokens = p.state->num_tokens;
    int const tile = combine_tile_tokens(my_tokens);
    int const num_tiles = combine_num_tiles(my_tokens);
    int const num_sum_ctas = p.num_ctas - p.num_push_ctas;
    auto const* flags = reinterpret_cast<uint64_t const*>(p.sym[rank] + p.layout.tile_flags);
    char const* landing = p.sym[rank] + p.layout.landing;
    for (int j = cta - p.num_push_ctas; j < num_tiles; j += num_sum_ctas) {
      // every rank flags every tile (acquire: its rows of the tile are visible after the barrier)
      FERRY_TRACE_BEGIN(trace, combine_wait_tile);
      if (tid < world &&
          !device::wait_signal_geq(p.view, flags + tid * kMaxCombineTiles + j, seq, tid, WaitPhase::combine_data))
        s_ok = 0;
      __syncthreads();
      if (!s_ok) break;
      FERRY_TRACE_END(trace, combine_wait_tile);
      FERRY_TRACE_BEGIN(trace, combine_sum);
      int const t_end = min((j + 1) * tile, my_tokens);
      for (int t = j * tile + warp; t < t_end; t += kWarps) {
        uint32_t const mask = p.token_mask[t];
        auto* y = static_cast<int4*>(p.y) + static_cast<std::size_t>(t) * num_vec;
        for (int i = lane; i < num_vec; i += 32 * kCombineUnroll) {
          float acc[kCombineUnroll][8];
#pragma unroll
          for (int u = 0; u < kCombineUnroll; ++u)
#pragma unroll
            for (int k = 0; k < 8; ++k) acc[u][k] = 0.0f;
          for (uint32_t m = mask; m != 0; m &= m - 1) {
            int const d = __ffs(m) - 1;
            auto const* src = reinterpret_cast<int4 const*>(
                landing + (static_cast<std::size_t>(parity * world + d) * p.max_tokens + t) * row_bytes);
            int4 v[kCombineUnroll];
#pragma unroll
            for (int u = 0; u < kCombineUnroll; ++u)
              if (i + u * 32 < num_vec) v[u] = device::arch::load_v4(src + i + u * 32);  // coherent: a peer wrote it
#pragma unroll
            for (int u = 0; u < kCombineUnroll; ++u) {
              float f[8];
              bf16x8_to_float(v[u], f);
#pragma unroll
              for (int k = 0; k < 8; ++k) acc[u][k] = __fadd_rn(acc[u][k], f[k]);
            }
          }
#pragma unroll
          for (int u = 0; u < kCombineUnroll; ++u)
            if (i + u * 32 < num_vec) device::arch::store_na_v4(y + i + u * 32, float_to_bf16x8(acc[u]));
        }
      }
      __syncthreads();  // the flags of the next tile are waited by tid < world only after every warp is done here
      FERRY_TRACE_END(trace, combine_sum);
    }
  }

  // 3. the last CTA advances the sequence (every CTA read it at step 0) and resets the arrival counter
  FERRY_TRACE_BEGIN(trace, combine_finish);
  __syncthreads();
  if (tid == 0) {
    unsigned long long const old = atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->combine_done), 1ull);
    if (old == static_cast<unsigned long long>(p.num_ctas - 1)) {
      p.state->combine_done = 0;
      p.state->combine_seq = seq;
    }
  }
  FERRY_TRACE_END(trace, combine_finish);
}

}  // namespace ferry::cuda_ep
