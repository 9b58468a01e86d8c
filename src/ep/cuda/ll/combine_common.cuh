// What the low-latency combine's send half (ll/combine.cuh) and its steps across nodes (ll/combine_network.cuh)
// share: the expert-major reduction of a received row, where its combine row goes, and the chunked and nvfp4 sends.
#pragma once

#include <cstdint>
#include <type_traits>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/entry_reduce.cuh"
#include "ep/cuda/landing.cuh"  // publish_abort
#include "ep/cuda/ll/params.cuh"
#include "trace/device_trace.cuh"
#include "wire/device_codec.cuh"
#include "wire/device_push.cuh"  // CtaRowMax
#include "wire/device_scales.cuh"

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

// Where the combine row of rank-major row `row` (source, token) goes: the source's landing zone at (this rank,
// token), or, for a source of another node (kNet), this rank's staged row, which the network leg puts there.
// The forward route instead: the row as bf16 (it is summed with its node's first) into the partials of this node's
// rail for that source (the rank of the source's local index here), at (source's node, this rank's local index).
template <bool kNet>
__device__ __forceinline__ char* combine_row_at(LlCombineParams const& p, int parity, int source, int token, int row) {
  std::size_t const wire_bytes = p.layout.ll.combine_row_bytes;
  if constexpr (kNet)
    if (!same_node(p, source)) {
      if (p.forward) {
        int const rail = source % p.local;  // the rank of the source's local index on this node (a local index)
        return p.net.window(rail) + p.layout.ll.partials +
               (((static_cast<std::size_t>(parity) * p.nodes + source / p.local) * p.local + p.view.rank % p.local) *
                    p.max_tokens +
                token) *
                   static_cast<std::size_t>(p.hidden) * 2;
      }
      return p.net.local() + p.layout.ll.combine_send +
             (static_cast<std::size_t>(parity) * p.view.world * p.max_tokens + row) * wire_bytes;
    }
  return near_window<kNet>(p, source) + p.layout.ll.combine_rows +
         ((static_cast<std::size_t>(parity) * p.view.world + p.view.rank) * p.max_tokens + token) * wire_bytes;
}

// Chunks per row of the chunked send: bf16 splits a batch with fewer rows than the grid has warps into more
// (smaller) chunks, so that every warp has bytes in flight; quantized formats keep 1024-element chunks (their scale
// blocks lie inside a chunk), across nodes (kNet) a power of two of them (<= kWarps, checked by the backend), so that
// a row's chunks are in one CTA and the network leg puts the row whole (chunks past the row's are idle). bf16 across
// nodes takes a power of two <= kWarps too where one holds its 1024-element chunks (hidden <= 16384), for the same
// whole-row puts (one message per row, not per chunk); a wider row keeps its chunks and its per-chunk puts.
template <WireFormat kFormat, bool kNet>
__device__ __forceinline__ int combine_chunks(LlCombineParams const& p, int num_recv) {
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  if constexpr (kFormat == WireFormat::bf16) {
    int const chunks = max(num_chunks, device::chunks_per_row(num_recv, p.num_ctas * kWarps, num_vec));
    if constexpr (kNet) {
      int whole = 1;
      while (whole < num_chunks) whole *= 2;
      while (whole * 2 <= min(chunks, kWarps)) whole *= 2;
      if (whole <= kWarps) return whole;
    }
    return chunks;
  }
  if constexpr (kNet) {
    int chunks = 1;
    while (chunks < num_chunks) chunks *= 2;
    return chunks;
  }
  return num_chunks;
}

// Chunked send (bf16 and the formats whose scale blocks lie inside a 1024-element chunk): warp per (row, chunk).
template <bool kExpertMajor, WireFormat kFormat, bool kNet, bool kMasking>
__device__ __forceinline__ void ll_combine_send_chunks(LlCombineParams const& p, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const scales_offset = wire::make_row_layout(kFormat, p.hidden).scales_offset;
  // written by the dispatch's receive half, earlier on the stream
  int const num_recv = p.state->num_recv;
  int const total_warps = p.num_ctas * kWarps;
  int const chunks = combine_chunks<kFormat, kNet>(p, num_recv);
  int const items = num_recv * chunks;
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);

  for (int item = cta * kWarps + warp; item < items; item += total_warps) {
    int const row = item / chunks;
    int const chunk = item % chunks;
    if constexpr (kNet && kFormat != WireFormat::bf16)
      if (chunk >= num_chunks) continue;
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
    if constexpr (kMasking)
      if (!live.has(source)) continue;  // rank masking: masked since the dispatch, nothing to it
    char* const dst_row = combine_row_at<kNet>(p, parity, source, token, row);
    auto* dst = reinterpret_cast<int4*>(dst_row);
    // the forward route's rows for another node go to its rail as bf16, whatever the combine_format
    bool const raw = kFormat == WireFormat::bf16 || (kNet && p.forward && !same_node(p, source));
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
        if (raw) {
          if (v < v_end) device::arch::store_na_v4(dst + v, float_to_bf16x8(acc[u]));
        } else if constexpr (kFormat != WireFormat::bf16) {
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
        if (raw) {
          if (vi < v_end) device::arch::store_na_v4(dst + vi, v[u]);
        } else if constexpr (kFormat != WireFormat::bf16) {
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
template <bool kExpertMajor, bool kNet, bool kMasking>
__device__ __forceinline__ void ll_combine_send_rows_nvfp4(LlCombineParams const& p, int parity) {
  __shared__ device::CtaRowMax<kWarps> s_amax;  // the row's amax over its warps, one barrier a step
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  WireRowLayout const wl = wire::make_row_layout(WireFormat::nvfp4, p.hidden);
  int const num_recv = p.state->num_recv;
  int const rows_per_step = max(1, kWarps / num_chunks);
  int const row_warps = kWarps / rows_per_step;  // warps of the CTA per row
  int const row_of_step = warp / row_warps;      // this warp's row among the step's (>= rows_per_step: idle)
  int const first_chunk = warp % row_warps;
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);

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
      m = fmaxf(m, device::wire_detail::finite_amax<8>(x[u], all_finite));
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
        s_amax.meet(step, device::wire_detail::group_max<32>(amax), row_of_step * row_warps, row_warps);
    if (!valid) continue;
    // 2. the row's token scale, then each chunk's codes and block scales into the source's landing zone
    float const token_scale = wire::nvfp4_token_scale(row_amax);
    int const source = p.recv_src[2 * row];
    int const token = p.recv_src[2 * row + 1];
    if constexpr (kMasking)
      if (!live.has(source)) continue;  // rank masking: masked since the dispatch (past the barrier)
    auto* const dst = reinterpret_cast<uint8_t*>(combine_row_at<kNet>(p, parity, source, token, row));
    // the forward route's rows for another node go to its rail as bf16
    bool const raw = kNet && p.forward && !same_node(p, source);
    if (!raw && first_chunk == 0 && lane == 0) *reinterpret_cast<float*>(dst + wl.token_scale_offset) = token_scale;
    bool const kept = first_chunk + row_warps >= num_chunks;  // this warp's only chunk is in x
    for (int c = first_chunk; c < num_chunks; c += row_warps) {
      if (!kept) values(row, c, x);
      int const v_end = min((c + 1) * kChunkVecs, num_vec);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        int const v = c * kChunkVecs + lane + u * 32;
        if (raw) {
          if (v < v_end) device::arch::store_na_v4(reinterpret_cast<int4*>(dst) + v, float_to_bf16x8(x[u]));
        } else {
          device::quantize_vec<WireFormat::nvfp4>(x[u], v < v_end, v, dst, wl.scales_offset, token_scale);
        }
      }
    }
  }
}

}  // namespace ferry::cuda_ll
