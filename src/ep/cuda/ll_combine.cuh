// Low-latency combine over NVLink: one kernel (or, with the hook, its send half and its receive half apart).
//
// Send half (every CTA, warp per (received row, chunk of at most 1024 elements; smaller bf16 chunks when the batch has
// fewer rows than the grid has warps)):
//  1. expert-major: acc = fmaf(w[k], out(e_k, slot_k), acc) over the row's local entries, k ascending, rounded to bf16
//     (the canonical receiver order); rank-major: the caller's row. Stored straight into the source's landing zone
//     at (this rank, token) of the current parity: one row per (token, rank) on the wire. A quantized combine_format
//     quantizes the bf16 chunk where it is (registers; its scale blocks lie inside the chunk) into the wire row's
//     payload and scales. nvfp4 puts a row's chunks on warps of one CTA, which meet the row's amax (its token scale)
//     in shared memory before they quantize;
//  2. per CTA: barrier, then +1 on every source's arrival counter of this rank (release, cumulative).
// Receive half (every CTA, warp per (own token, chunk)):
//  3. wait until every rank's arrivals reach seq * num_ctas (acquire; bounded);
//  4. y[t] = bf16(sum over destination ranks d ascending that hold t of float(landing[d][t])), from +0.0f; a quantized
//     combine_format dequantizes each rank's row to fp32 (code * scale, one product) in the same loop.
// Refusal (ll_params.cuh): a rank that refuses the combine sends no rows, writes its abort word before its arrival and
// sums nothing (it has no y). CTA 0 of every other rank loads the abort words right after its wait and checks them
// after the sum (off the sum's path: a refused call's y is no result), recording the refusal.
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/entry_reduce.cuh"
#include "ep/cuda/landing.cuh"  // publish_abort
#include "ep/cuda/ll_params.cuh"
#include "quant/device_codec.cuh"
#include "quant/device_push.cuh"  // CtaRowMax
#include "quant/device_scales.cuh"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ll {

// The local entries of received row `row` (expert-major combine): lane k < topk holds its weight and the address of
// its expert output row, valid when the entry is a local expert with a slot.
struct RowEntries {
  int4 const* entry = nullptr;
  float w = 0.0f;
  uint32_t mask = 0;  // lanes with a valid entry
};

__device__ __forceinline__ RowEntries row_entries(LlCombineParams const& p, int row, int lane, int num_vec) {
  RowEntries r;
  bool valid = false;
  if (lane < p.topk) {
    std::size_t const at = static_cast<std::size_t>(row) * p.topk + lane;
    int32_t const el = p.recv_idx[at];
    int32_t const slot = p.recv_slot[at];
    float const w = p.recv_w[at];  // loaded with the ids, not after them (one round trip, not two)
    valid = el >= 0 && slot >= 0;
    if (valid) {
      r.w = w;
      r.entry = static_cast<int4 const*>(p.x) + (static_cast<std::size_t>(el) * p.expert_slots + slot) * num_vec;
    }
  }
  r.mask = __ballot_sync(0xffffffffu, valid);
  return r;
}

// acc[u] = the canonical fmaf chain (k ascending) over the entries, for vectors v0 + u * 32 below v_end.
__device__ __forceinline__ void reduce_chunk(RowEntries const& r, int v0, int v_end, float (&acc)[kUnroll][8]) {
  device::reduce_entries_step<kUnroll>(r.mask, r.w, r.entry, v0, v_end, acc);
}

// Chunked send (bf16 and the formats whose scale blocks lie inside a 1024-element chunk): warp per (row, chunk).
template <bool kExpertMajor, WireFormat kFormat>
__device__ __forceinline__ void ll_combine_send_chunks(LlCombineParams const& p, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const wire_bytes = p.layout.combine_row_bytes;
  std::size_t const scales_offset = quant::make_row_layout(kFormat, p.hidden).scales_offset;
  // written by the dispatch's receive half, earlier on the stream
  int const num_recv = p.state->num_recv;
  // bf16: a batch with fewer rows than the grid has warps splits rows into more (smaller) chunks, so that every warp
  // has bytes in flight; quantized formats keep 1024-element chunks (their scale blocks lie inside a chunk)
  int const total_warps = p.num_ctas * kWarps;
  int const chunks = kFormat == WireFormat::bf16
                         ? max(num_chunks, device::chunks_per_row(num_recv, total_warps, num_vec))
                         : num_chunks;
  int const items = num_recv * chunks;

  for (int item = cta * kWarps + warp; item < items; item += total_warps) {
    int const row = item / chunks;
    int const chunk = item % chunks;
    // this item's vectors: v0 + u * 32 below v_end (at most kChunkVecs of them)
    int v_begin = chunk * kChunkVecs;
    int v_end = min(v_begin + kChunkVecs, num_vec);
    if constexpr (kFormat == WireFormat::bf16) {
      device::ChunkRange const range = device::chunk_range(num_vec, chunk, chunks);
      v_begin = range.begin;
      v_end = range.end;
    }
    int const v0 = v_begin + lane;
    int const source = p.recv_src[2 * row];
    int const token = p.recv_src[2 * row + 1];
    char* const dst_row = p.net.window(source) + p.layout.combine_rows +
                          ((static_cast<std::size_t>(parity) * world + rank) * p.max_tokens + token) * wire_bytes;
    auto* dst = reinterpret_cast<int4*>(dst_row);
    if constexpr (kExpertMajor) {
      RowEntries const entries = row_entries(p, row, lane, num_vec);
      if constexpr (kFormat == WireFormat::bf16) {
        if (v_end - v_begin <= 32) {
          // one vector per lane (small batches): every entry's loads issued at once, one round trip (the pipelined
          // step below waits one per entry)
          float a[1][8];
          device::reduce_entries_grouped<1, 6>(entries.mask, entries.w, entries.entry, v0, v_end, a);
          if (v0 < v_end) device::arch::store_na_v4(dst + v0, float_to_bf16x8(a[0]));
          continue;
        }
      }
      float acc[kUnroll][8];
      reduce_chunk(entries, v0, v_end, acc);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int const v = v0 + u * 32;
        if constexpr (kFormat == WireFormat::bf16) {
          if (v < v_end) device::arch::store_na_v4(dst + v, float_to_bf16x8(acc[u]));
        } else {
          // the bf16 row's values (what the reference quantizes), then the codec's step for this vector
          float x[8];
          bf16x8_to_float(float_to_bf16x8(acc[u]), x);
          device::quantize_vec<kFormat>(x, v < v_end, v, reinterpret_cast<uint8_t*>(dst_row), scales_offset, 0.0f);
        }
      }
    } else {
      auto const* src = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec;
      int4 v[kUnroll];
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if constexpr (kFormat != WireFormat::bf16) v[u] = make_int4(0, 0, 0, 0);  // lanes past the row quantize zeros
        if (v0 + u * 32 < v_end) v[u] = device::arch::load_nc_v4(src + v0 + u * 32);
      }
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int const vi = v0 + u * 32;
        if constexpr (kFormat == WireFormat::bf16) {
          if (vi < v_end) device::arch::store_na_v4(dst + vi, v[u]);
        } else {
          float x[8];
          bf16x8_to_float(v[u], x);
          device::quantize_vec<kFormat>(x, vi < v_end, vi, reinterpret_cast<uint8_t*>(dst_row), scales_offset, 0.0f);
        }
      }
    }
  }
}

// nvfp4 send: the row's 1024-element chunks go to warps of one CTA (kWarps / num_chunks rows per step of the CTA,
// or one row whose warps take several chunks each), which meet the row's amax in shared memory: the whole row's
// amax enters every block scale through the token scale. A warp of one chunk keeps its values in registers across
// the barrier and quantizes them there; a warp of several (rows wider than kWarps chunks) computes them again after
// it. Every thread of the CTA runs the same steps (the barrier).
template <bool kExpertMajor>
__device__ __forceinline__ void ll_combine_send_rows_nvfp4(LlCombineParams const& p, int parity) {
  __shared__ device::CtaRowMax<kWarps> s_amax;  // the row's amax over its warps, one barrier a step
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const wire_bytes = p.layout.combine_row_bytes;
  WireRowLayout const wl = quant::make_row_layout(WireFormat::nvfp4, p.hidden);
  int const num_recv = p.state->num_recv;
  int const rows_per_step = max(1, kWarps / num_chunks);
  int const row_warps = kWarps / rows_per_step;  // warps of the CTA per row
  int const row_of_step = warp / row_warps;      // this warp's row among the step's (>= rows_per_step: idle)
  int const first_chunk = warp % row_warps;

  // The bf16 values (as fp32) of chunk c of row `row`, zeros past the row's end: what the reference quantizes.
  auto values = [&](int row, int c, float(&x)[kUnroll][8]) {
    int const v0 = c * kChunkVecs + lane;
    int const v_end = min((c + 1) * kChunkVecs, num_vec);
    int4 v[kUnroll];
    if constexpr (kExpertMajor) {
      float acc[kUnroll][8];
      reduce_chunk(row_entries(p, row, lane, num_vec), v0, v_end, acc);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) v[u] = float_to_bf16x8(acc[u]);
    } else {
      auto const* src = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec;
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (v0 + u * 32 < v_end) v[u] = device::arch::load_nc_v4(src + v0 + u * 32);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      if (v0 + u * 32 >= v_end) v[u] = make_int4(0, 0, 0, 0);  // not loaded (or not reduced)
      bf16x8_to_float(v[u], x[u]);
    }
  };
  auto chunk_amax = [&](float const(&x)[kUnroll][8]) {
    float m = 0.0f;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      bool all_finite;
      m = fmaxf(m, device::quant_detail::finite_amax<8>(x[u], all_finite));
    }
    return m;
  };

  for (int r0 = cta * rows_per_step, step = 0; r0 < num_recv; r0 += p.num_ctas * rows_per_step, ++step) {
    int const row = r0 + row_of_step;
    bool const valid = row_of_step < rows_per_step && row < num_recv;  // the same on every lane
    // 1. this warp's chunks of the row, their amax to the CTA (a warp of one chunk keeps its values in x)
    float x[kUnroll][8];
    float amax = 0.0f;
    if (valid) {
      for (int c = first_chunk; c < num_chunks; c += row_warps) {
        values(row, c, x);
        amax = fmaxf(amax, chunk_amax(x));
      }
    }
    float const row_amax =
        s_amax.meet(step, device::quant_detail::group_max<32>(amax), row_of_step * row_warps, row_warps);
    if (!valid) continue;
    // 2. the row's token scale, then each chunk's codes and block scales into the source's landing zone
    float const token_scale = quant::nvfp4_token_scale(row_amax);
    int const source = p.recv_src[2 * row];
    int const token = p.recv_src[2 * row + 1];
    auto* const dst = reinterpret_cast<uint8_t*>(
        p.net.window(source) + p.layout.combine_rows +
        ((static_cast<std::size_t>(parity) * world + rank) * p.max_tokens + token) * wire_bytes);
    if (first_chunk == 0 && lane == 0) *reinterpret_cast<float*>(dst + wl.token_scale_offset) = token_scale;
    bool const kept = first_chunk + row_warps >= num_chunks;  // this warp's only chunk is in x
    for (int c = first_chunk; c < num_chunks; c += row_warps) {
      if (!kept) values(row, c, x);
      int const v_end = min((c + 1) * kChunkVecs, num_vec);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int const v = c * kChunkVecs + lane + u * 32;
        device::quantize_vec<WireFormat::nvfp4>(x[u], v < v_end, v, dst, wl.scales_offset, token_scale);
      }
    }
  }
}

template <bool kExpertMajor, WireFormat kFormat>
__device__ __forceinline__ void ll_combine_send(LlCombineParams const& p, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const parity = static_cast<int>(seq & 1);
  // 1. the rows, into each source's landing zone (none when this rank refuses the call)
  FERRY_TRACE_BEGIN(trace, ll_combine_send);
  if (!p.abort) {
    if constexpr (kFormat == WireFormat::nvfp4)
      ll_combine_send_rows_nvfp4<kExpertMajor>(p, parity);
    else
      ll_combine_send_chunks<kExpertMajor, kFormat>(p, parity);
  }
  FERRY_TRACE_END(trace, ll_combine_send);

  // 2. arrival: the barrier orders every thread's rows before the release adds, which are cumulative over them
  //    (no per-thread fence, which would drain each thread's NVLink stores); a refusal's abort word goes first
  FERRY_TRACE_BEGIN(trace, ll_combine_send_arrival);
  __syncthreads();
  if (p.abort && blockIdx.x == 0) landing::publish_abort(p.net, p.layout.combine_abort, parity, world, rank, seq);
  if (tid < world) p.net.add_signal(tid, p.layout.combine_arrivals + rank * sizeof(uint64_t), 1);
  FERRY_TRACE_END(trace, ll_combine_send_arrival);
}

template <WireFormat kFormat>
__device__ __forceinline__ void ll_combine_recv(LlCombineParams const& p, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  __shared__ int s_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const parity = static_cast<int>(seq & 1);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const row_bytes = p.layout.combine_row_bytes;

  // The token count and the mask of this warp's first token, loaded before the wait (both written by the dispatch,
  // earlier on the stream): the sum then starts with its row loads, one round trip sooner.
  int const num_tokens = p.state->num_tokens;
  int const items = num_tokens * num_chunks;
  int const first_item = cta * kWarps + warp;
  uint32_t const first_mask = first_item < items ? p.token_mask[first_item / num_chunks] : 0u;

  // 3. every rank's send CTAs of this call (thread d waits for rank d; acquire, bounded)
  FERRY_TRACE_BEGIN(trace, ll_combine_wait_arrivals);
  if (tid == 0) s_ok = 1;
  __syncthreads();
  uint64_t abort_seen = 0;  // CTA 0, thread d: rank d's abort word of this parity, checked after the sum
  if (tid < world) {
    auto const* arrivals = reinterpret_cast<uint64_t const*>(p.net.window(rank) + p.layout.combine_arrivals);
    uint64_t const per_call = static_cast<uint64_t>(p.num_ctas);
    uint64_t observed = 0;
    if (!wait_stats::timed(wait_stats::row(p.wait_stats, wait_stats::kCombine, world), tid, [&] {
          return device::wait_signal_geq_value(p.view, arrivals + tid, seq * per_call, tid, WaitPhase::ll_combine,
                                               &observed);
        })) {
      s_ok = 0;
    } else if (observed > (seq + 1) * per_call) {
      device::record_out_of_step(p.view, tid, WaitPhase::ll_combine, seq, observed / per_call);
      s_ok = 0;
    } else if (cta == 0) {
      // after the acquire; not waited for here (the barrier does not wait for loads in flight)
      abort_seen =
          reinterpret_cast<uint64_t const volatile*>(p.net.window(rank) + p.layout.combine_abort)[parity * world + tid];
    }
  }
  __syncthreads();
  if (!s_ok || p.abort) return;  // a refusing rank has no y
  FERRY_TRACE_END(trace, ll_combine_wait_arrivals);

  // 4. the sum, destination ranks ascending
  FERRY_TRACE_BEGIN(trace, ll_combine_sum);
  WireRowLayout const wl = quant::make_row_layout(kFormat, p.hidden);
  char const* landing =
      p.net.window(rank) + p.layout.combine_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * row_bytes;
  for (int item = cta * kWarps + warp; item < items; item += p.num_ctas * kWarps) {
    int const token = item / num_chunks;
    int const v0 = (item % num_chunks) * kChunkVecs + lane;
    uint32_t const mask = item == first_item ? first_mask : p.token_mask[token];
    float acc[kUnroll][8];
    device::zero_acc(acc);
    for (uint32_t m = mask; m != 0; m &= m - 1) {
      int const d = __ffs(m) - 1;
      char const* const row = landing + (static_cast<std::size_t>(d) * p.max_tokens + token) * row_bytes;
      if constexpr (kFormat == WireFormat::bf16) {
        device::add_bf16_vectors(reinterpret_cast<int4 const*>(row), v0, num_vec, acc);
      } else {
        // y = code * scale in fp32 (plain loads: the acquire above made the peer's row visible)
        auto const* wire = reinterpret_cast<uint8_t const*>(row);
        float token_scale = 0.0f;
        if constexpr (kFormat == WireFormat::nvfp4)
          token_scale = *reinterpret_cast<float const*>(wire + wl.token_scale_offset);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          if (v0 + u * 32 >= num_vec) continue;
          float f[8];
          device::dequantize_vec<kFormat>(wire, wl.scales_offset, v0 + u * 32, token_scale, f);
#pragma unroll
          for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], f[j]);
        }
      }
    }
    auto* y = static_cast<int4*>(p.y) + static_cast<std::size_t>(token) * num_vec;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < num_vec) device::arch::store_na_v4(y + v0 + u * 32, float_to_bf16x8(acc[u]));
  }
  FERRY_TRACE_END(trace, ll_combine_sum);
  if (cta == 0 && tid < world && tid != rank && abort_seen == seq)
    device::record_refusal(p.view, tid, WaitPhase::ll_combine);
}

// kFormat: the combine_format.
template <bool kExpertMajor, WireFormat kFormat, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(LlCombineParams const p) {
  static_assert(kSend || kRecv, "an LL combine kernel runs at least one half");
  __shared__ uint64_t s_seq[2];
  next_sequences<kSend, kRecv>(p.state->combine_send_seq, p.state->combine_recv_seq, s_seq);
  FERRY_TRACE_WARP(trace, p.trace);
  if constexpr (kSend) ll_combine_send<kExpertMajor, kFormat>(p, s_seq[0] FERRY_TRACE_ARG(trace));
  if constexpr (kRecv) ll_combine_recv<kFormat>(p, s_seq[1] FERRY_TRACE_ARG(trace));
}

}  // namespace ferry::cuda_ll
