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
// Refusal (ll/params.cuh): a rank that refuses the combine sends no rows, writes its abort word before its arrival and
// sums nothing (it has no y). CTA 0 of every other rank loads the abort words right after its wait and checks them
// after the sum (off the sum's path: a refused call's y is no result), recording the refusal.
#pragma once

#include <cstdint>
#include <type_traits>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/entry_reduce.cuh"
#include "ep/cuda/landing.cuh"  // publish_abort
#include "ep/cuda/ll/params.cuh"
#include "wire/device_codec.cuh"
#include "wire/device_push.cuh"  // CtaRowMax
#include "wire/device_scales.cuh"
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

// Where the combine row of rank-major row `row` (source, token) goes: the source's landing zone at (this rank,
// token), or, for a source of another node (kNet), this rank's staged row, which the network leg puts there.
// The forward route instead: the row as bf16 (it is summed with its node's first) into the partials of this node's
// rail for that source (the rank of the source's local index here), at (source's node, this rank's local index).
template <bool kNet>
__device__ __forceinline__ char* combine_row_at(LlCombineParams const& p, int parity, int source, int token, int row) {
  std::size_t const wire_bytes = p.layout.combine_row_bytes;
  if constexpr (kNet)
    if (!same_node(p, source)) {
      if (p.forward) {
        int const rail = source % p.local;  // the rank of the source's local index on this node (a local index)
        return p.net.window(rail) + p.layout.ll_partials +
               (((static_cast<std::size_t>(parity) * p.nodes + source / p.local) * p.local + p.view.rank % p.local) *
                    p.max_tokens +
                token) *
                   static_cast<std::size_t>(p.hidden) * 2;
      }
      return p.net.local() + p.layout.ll_combine_send +
             (static_cast<std::size_t>(parity) * p.view.world * p.max_tokens + row) * wire_bytes;
    }
  return near_window<kNet>(p, source) + p.layout.combine_rows +
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
  uint32_t const live = live_ranks<kMasking>(p);

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
      if (((live >> source) & 1u) == 0) continue;  // rank masking: masked since the dispatch, nothing to it
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
  uint32_t const live = live_ranks<kMasking>(p);

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
      if (((live >> source) & 1u) == 0) continue;  // rank masking: masked since the dispatch (past the barrier)
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

// Across nodes, after the send (every thread of the CTA, past the barrier that ends it): the rows this CTA staged
// for the sources of other nodes, put from this rank's window into their landing zones, then its arrival there
// (ll_dispatch_send_network's scheme: warp w takes the ranks j = w, w + kWarps, ... of the other nodes over every
// row of the CTA, in the send's order; a row whole from its first chunk's item (combine_chunks keeps a row's chunks
// in one CTA), a bf16 row wider than 16 of its 1024-element chunks a chunk's bytes per item; CTA 0 of a refusing
// rank puts its abort word). The staged rows alternate by parity, as the landing zones. kMasking: a rank masked
// since the dispatch gets nothing (its rows were not staged either).
template <WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_combine_send_network(LlCombineParams const& p, Net const& network, int parity,
                                                        uint64_t seq) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  int const num_recv = p.abort ? 0 : p.state->num_recv;  // a refusing rank sends no rows
  std::size_t const wire = p.layout.combine_row_bytes;
  std::size_t const staged = p.layout.ll_combine_send + static_cast<std::size_t>(parity) * world * p.max_tokens * wire;
  std::size_t const landed = p.layout.combine_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * wire;
  uint32_t const live = live_ranks<kMasking>(p);
  auto ep = network.open(transport::Warp{}, (p.num_ctas + cta) * kWarps + warp);
  for (int j = warp; j < world - p.local; j += kWarps) {
    int const d = remote_rank(p, j);
    if (!is_live<kMasking>(live, d)) continue;
    auto const put_row = [&](int row, std::size_t begin, std::size_t bytes) {
      int const token = p.recv_src[2 * row + 1];
      ep.put(d, landed + (static_cast<std::size_t>(rank) * p.max_tokens + token) * wire + begin,
             staged + static_cast<std::size_t>(row) * wire + begin, bytes);
    };
    if constexpr (kFormat == WireFormat::nvfp4) {
      // ll_combine_send_rows_nvfp4's rows: rows_per_step a step of each CTA, lane i looking at the step's row i
      int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
      int const rows_per_step = max(1, kWarps / num_chunks);
      for (int r0 = cta * rows_per_step; r0 < num_recv; r0 += p.num_ctas * rows_per_step) {
        int const row = r0 + lane;
        bool const to_d = lane < rows_per_step && row < num_recv && p.recv_src[2 * row] == d;
        for (uint32_t m = __ballot_sync(0xffffffffu, to_d); m != 0; m &= m - 1) put_row(r0 + __ffs(m) - 1, 0, wire);
      }
    } else {
      // ll_combine_send_chunks's items: kWarps a step of each CTA, lane i looking at the step's item i
      int const chunks = combine_chunks<kFormat, true>(p, num_recv);
      int const items = num_recv * chunks;
      for (int base = cta * kWarps; base < items; base += p.num_ctas * kWarps) {
        int const item = base + lane;
        bool const to_d = lane < kWarps && item < items && p.recv_src[2 * (item / chunks)] == d;
        for (uint32_t m = __ballot_sync(0xffffffffu, to_d); m != 0; m &= m - 1) {
          int const it = base + __ffs(m) - 1;
          int const row = it / chunks;
          int const chunk = it % chunks;
          if (kFormat == WireFormat::bf16 && chunks > kWarps) {  // a row wider than a CTA's chunks: per chunk
            auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
            if (v_end > v_begin)
              put_row(row, static_cast<std::size_t>(v_begin) * 16, static_cast<std::size_t>(v_end - v_begin) * 16);
          } else if (chunk == 0) {
            put_row(row, 0, wire);
          }
        }
      }
    }
    if (p.abort && cta == 0)
      ep.put_value(d, p.layout.combine_abort + (static_cast<std::size_t>(parity) * world + rank) * sizeof(uint64_t),
                   seq);
    ep.signal(d, p.layout.combine_arrivals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
  }
  ep.close();
}

// The forward route's rail, at the end of a send half (every thread of the CTA): once every rank of this node has
// sent its rows (their partial arrivals, bounded waits), the CTA's share of the tokens this rail placed in the last
// dispatch (token t of node m's source: global warp t % (num_ctas * kWarps)) reduced as the reference does it: the
// bf16 rows of the node's ranks holding it summed in fp32, local ranks ascending, rounded to bf16, then quantized to
// combine_format (nvfp4: the token scale from the rounded row's amax, a first pass) into this rail's staged row;
// after the barrier warp w takes the other nodes j = w, w + kWarps, ...: to that node's source it puts the CTA's
// staged rows into its landing zone at (this rail, token), relays (CTA 0) the abort word of every rank of this node
// that refused the call, and signals +1. Returns false when a rank of the node did not send (the timeout recorded):
// then nothing is signalled, and the sources time out on this rail.
template <WireFormat kFormat, class Net>
__device__ __forceinline__ bool ll_combine_rail(LlCombineParams const& p, Net const& network, int parity,
                                                uint64_t seq) {
  __shared__ int s_rail_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const own_node = rank / p.local;
  int const first = own_node * p.local;
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  int const total_warps = p.num_ctas * kWarps;
  std::size_t const wire = p.layout.combine_row_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  std::size_t const bf16_row = static_cast<std::size_t>(p.hidden) * 2;
  WireRowLayout const wl = wire::make_row_layout(kFormat, p.hidden);
  char* const own = p.net.local();
  if (tid == 0) s_rail_ok = 1;
  __syncthreads();
  if (tid < p.local && !device::wait_signal_geq(
                           p.view, reinterpret_cast<uint64_t const*>(own + p.layout.ll_partial_arrivals) + first + tid,
                           seq * static_cast<uint64_t>(p.num_ctas), first + tid, WaitPhase::ll_combine))
    s_rail_ok = 0;
  __syncthreads();
  if (!s_rail_ok) return false;

  // 1. the reduction of each placed token into the staged row
  for (int m = 0; m < p.nodes && !p.abort; ++m) {
    if (m == own_node) continue;
    int const n = p.fwd_num[m];
    for (int t = cta * kWarps + warp; t < n; t += total_warps) {
      uint32_t const here = p.fwd_mask[static_cast<std::size_t>(m) * max_tokens + t];
      if (here == 0) continue;
      std::size_t const at = (static_cast<std::size_t>(parity) * p.nodes + m) * max_tokens + t;
      auto* const out = reinterpret_cast<uint8_t*>(own + p.layout.ll_rail_send + at * wire);
      // chunk c of the node's sum, rounded to bf16, as fp32 values in x
      auto const node_sum = [&](int c, float(&x)[kUnroll][8]) {
        device::zero_acc(x);
        int const v0 = c * kChunkVecs + lane;
        int const v_end = min((c + 1) * kChunkVecs, num_vec);
        for (uint32_t h = here; h != 0; h &= h - 1) {
          int const l = __ffs(h) - 1;
          auto const* row = reinterpret_cast<int4 const*>(
              own + p.layout.ll_partials +
              (((static_cast<std::size_t>(parity) * p.nodes + m) * p.local + l) * max_tokens + t) * bf16_row);
          device::add_bf16_vectors(row, v0, v_end, x);
        }
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) bf16x8_to_float(float_to_bf16x8(x[u]), x[u]);
      };
      float token_scale = 0.0f;
      if constexpr (kFormat == WireFormat::nvfp4) {
        float amax = 0.0f;
        for (int c = 0; c < num_chunks; ++c) {
          float x[kUnroll][8];
          node_sum(c, x);
          int const v_end = min((c + 1) * kChunkVecs, num_vec);
#pragma unroll
          for (int u = 0; u < kUnroll; ++u) {
            bool all_finite;
            if (c * kChunkVecs + lane + u * 32 < v_end)
              amax = fmaxf(amax, device::wire_detail::finite_amax<8>(x[u], all_finite));
          }
        }
        token_scale = wire::nvfp4_token_scale(device::wire_detail::group_max<32>(amax));
        if (lane == 0) *reinterpret_cast<float*>(out + wl.token_scale_offset) = token_scale;
      }
      for (int c = 0; c < num_chunks; ++c) {
        float x[kUnroll][8];
        node_sum(c, x);
        int const v_end = min((c + 1) * kChunkVecs, num_vec);
#pragma unroll
        for (int u = 0; u < kUnroll; ++u) {
          int const v = c * kChunkVecs + lane + u * 32;
          if constexpr (kFormat == WireFormat::bf16) {
            if (v < v_end) device::arch::store_na_v4(reinterpret_cast<int4*>(out) + v, float_to_bf16x8(x[u]));
          } else {
            device::quantize_vec<kFormat>(x[u], v < v_end, v, out, wl.scales_offset, token_scale);
          }
        }
      }
    }
  }

  // 2. the network leg: the CTA's rows to each other node's source, its node's refusals, then its arrival there
  __syncthreads();
  auto ep = network.open(transport::Warp{}, (p.num_ctas + cta) * kWarps + warp);
  for (int j = warp; j < p.nodes - 1; j += kWarps) {
    int const m = j < own_node ? j : j + 1;
    int const source = m * p.local + rank % p.local;
    int const n = p.abort ? 0 : p.fwd_num[m];
    std::size_t const landed =
        p.layout.combine_rows + ((static_cast<std::size_t>(parity) * world + rank) * max_tokens) * wire;
    for (int base = cta * kWarps; base < n; base += total_warps) {
      int const t = base + lane;
      bool const placed = lane < kWarps && t < n && p.fwd_mask[static_cast<std::size_t>(m) * max_tokens + t] != 0;
      for (uint32_t b = __ballot_sync(0xffffffffu, placed); b != 0; b &= b - 1) {
        int const tt = base + __ffs(b) - 1;
        std::size_t const at = (static_cast<std::size_t>(parity) * p.nodes + m) * max_tokens + tt;
        ep.put(source, landed + static_cast<std::size_t>(tt) * wire, p.layout.ll_rail_send + at * wire, wire);
      }
    }
    if (cta == 0)
      for (int d = first; d < first + p.local; ++d) {
        std::size_t const word = (static_cast<std::size_t>(parity) * world + d) * sizeof(uint64_t);
        if (*reinterpret_cast<uint64_t const volatile*>(own + p.layout.combine_abort + word) == seq)
          ep.put_value(source, p.layout.combine_abort + word, seq);
      }
    ep.signal(source, p.layout.combine_arrivals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
  }
  ep.close();
  return true;
}

// Rank masking, the receive half's warp of token t's first chunk: counts its entries whose rank is masked now (y
// misses their expert outputs), from the ranks the dispatch kept (LlMaskWords::entry_rank).
__device__ __forceinline__ void count_combine_misses(LlCombineParams const& p, int t, int lane) {
  uint32_t const live = live_ranks<true>(p);
  int const d = lane < p.topk ? p.state->ll_mask.entry_rank[static_cast<std::size_t>(t) * p.topk + lane] : -1;
  unsigned const n = __popc(__ballot_sync(0xffffffffu, d >= 0 && ((live >> d) & 1u) == 0));
  if (lane == 0 && n != 0) count_masked_entries(p, detail::LlMaskLeg::combine, n);
}

template <bool kExpertMajor, WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_combine_send(LlCombineParams const& p, Net const& network,
                                                uint64_t seq FERRY_TRACE_PARAM(trace)) {
  constexpr bool kNet = kAcrossNodes<Net>;
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const parity = static_cast<int>(seq & 1);
  // 1. the rows, into each source's landing zone (none when this rank refuses the call)
  FERRY_TRACE_BEGIN(trace, ll_combine_send);
  if (!p.abort) {
    if constexpr (kFormat == WireFormat::nvfp4)
      ll_combine_send_rows_nvfp4<kExpertMajor, kNet, kMasking>(p, parity);
    else
      ll_combine_send_chunks<kExpertMajor, kFormat, kNet, kMasking>(p, parity);
  }
  FERRY_TRACE_END(trace, ll_combine_send);

  // 2. arrival: the barrier orders every thread's rows before the release adds, which are cumulative over them
  //    (no per-thread fence, which would drain each thread's NVLink stores); a refusal's abort word goes first.
  //    Across nodes this node's ranks only; the network leg then reaches the others.
  FERRY_TRACE_BEGIN(trace, ll_combine_send_arrival);
  __syncthreads();
  uint32_t const live = live_ranks<kMasking>(p);  // rank masking: nothing to a masked rank
  if constexpr (kNet) {
    // this node's ranks, thread l its l-th (the abort word first: the same thread's release add publishes it)
    if (tid < p.local && is_live<kMasking>(live, node_first(p) + tid)) {
      if (p.abort && blockIdx.x == 0)
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.combine_abort)[parity * world + rank] = seq;
      p.net.add_signal(tid, p.layout.combine_arrivals + rank * sizeof(uint64_t), 1);
    }
  } else {
    if (p.abort && blockIdx.x == 0)
      landing::publish_abort<!kMasking>(p.net, p.layout.combine_abort, parity, world, rank, seq, live);
    if (tid < world && ((live >> tid) & 1u) != 0)
      p.net.add_signal(tid, p.layout.combine_arrivals + rank * sizeof(uint64_t), 1);
  }
  if constexpr (kNet && kMasking) {
    // rank masking across nodes runs the direct route (the backend refuses the forward one)
    ll_combine_send_network<kFormat, true>(p, network, parity, seq);
  } else if constexpr (kNet) {
    if (p.forward) {
      // this rank's rows for the rails of its node are in (the same barrier orders them)
      if (tid < p.local) p.net.add_signal(tid, p.layout.ll_partial_arrivals + rank * sizeof(uint64_t), 1);
      ll_combine_rail<kFormat>(p, network, parity, seq);
    } else {
      ll_combine_send_network<kFormat, false>(p, network, parity, seq);
    }
  }
  FERRY_TRACE_END(trace, ll_combine_send_arrival);
}

template <WireFormat kFormat, bool kMasking, bool kGrouped, class Net>
__device__ __forceinline__ void ll_combine_recv(LlCombineParams const& p, Net const& network,
                                                uint64_t seq FERRY_TRACE_PARAM(trace)) {
  constexpr bool kNet = kAcrossNodes<Net>;
  __shared__ int s_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const parity = static_cast<int>(seq & 1);
  int const num_vec = p.hidden / 8;
  int const num_chunks = (num_vec + kChunkVecs - 1) / kChunkVecs;
  std::size_t const row_bytes = p.layout.combine_row_bytes;
  auto const own = [&] { return own_window<kNet>(p); };  // read where used (a register held across the wait costs)

  // The token count and the mask of this warp's first token, loaded before the wait (both written by the dispatch,
  // earlier on the stream): the sum then starts with its row loads, one round trip sooner.
  int const num_tokens = p.state->num_tokens;
  int const items = num_tokens * num_chunks;
  int const first_item = cta * kWarps + warp;
  uint32_t const live = live_ranks<kMasking>(p);  // rank masking: a masked rank is not waited for, its rows not summed
  // (across nodes a token's mask is several words, read where it is summed)
  uint32_t const first_mask = !kNet && first_item < items ? p.token_mask[first_item / num_chunks] & live : 0u;

  // 3. every rank's send CTAs of this call (thread d waits for rank d; acquire, bounded)
  FERRY_TRACE_BEGIN(trace, ll_combine_wait_arrivals);
  if (tid == 0) s_ok = 1;
  __syncthreads();
  uint64_t abort_seen = 0;  // CTA 0, thread d: rank d's abort word of this parity, checked after the sum
  if (tid < world && (kNet ? is_live<kMasking>(live, tid) : ((live >> tid) & 1u) != 0)) {
    auto const* arrivals = reinterpret_cast<uint64_t const*>(own() + p.layout.combine_arrivals);
    uint64_t const per_call = static_cast<uint64_t>(p.num_ctas);
    uint64_t observed = 0;
    bool remote = false;
    wait_stats::Slot* const stats = wait_stats::row(p.wait_stats, wait_stats::kCombine, world);
    if constexpr (kAcrossNodes<Net>) remote = !same_node(p, tid);
    if (remote) {
      // a rank of another node: through the network (no out-of-step check: its counter is the transport's); the
      // forward route hears only from each node's rail for this rank, which relays its node's refusals
      if constexpr (kAcrossNodes<Net>) {
        if (!p.forward || tid % p.local == rank % p.local) {
          if (!wait_stats::timed(stats, tid, [&] {
                return wait_network(p, network, p.layout.combine_arrivals, tid, seq * per_call, WaitPhase::ll_combine);
              }))
            s_ok = 0;
          else if (cta == 0)
            abort_seen =
                reinterpret_cast<uint64_t const volatile*>(own() + p.layout.combine_abort)[parity * world + tid];
        }
      }
    } else if (!wait_stats::timed(stats, tid, [&] {
                 return device::wait_signal_geq_value(p.view, arrivals + tid, seq * per_call, tid,
                                                      WaitPhase::ll_combine, &observed);
               })) {
      s_ok = 0;
    } else if (observed > (seq + 1) * per_call) {
      device::record_out_of_step(p.view, tid, WaitPhase::ll_combine, seq, observed / per_call);
      s_ok = 0;
    } else if (cta == 0) {
      // after the acquire; not waited for here (the barrier does not wait for loads in flight)
      abort_seen = reinterpret_cast<uint64_t const volatile*>(own() + p.layout.combine_abort)[parity * world + tid];
    }
  }
  __syncthreads();
  if constexpr (kAcrossNodes<Net>) {
    // the forward route: a rank of another node that is no rail here refused through its rail (relayed, after the
    // rail's wait above)
    if (p.forward && cta == 0 && tid < world && !same_node(p, tid) && tid % p.local != rank % p.local)
      abort_seen = reinterpret_cast<uint64_t const volatile*>(own() + p.layout.combine_abort)[parity * world + tid];
  }
  if (!s_ok || p.abort) return;  // a refusing rank has no y
  FERRY_TRACE_END(trace, ll_combine_wait_arrivals);

  // 4. the sum, destination ranks ascending
  FERRY_TRACE_BEGIN(trace, ll_combine_sum);
  WireRowLayout const wl = wire::make_row_layout(kFormat, p.hidden);
  char const* landing =
      own() + p.layout.combine_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * row_bytes;
  // acc += the row of `token` from rank d (fp32; a quantized row dequantized first); weighted (std::true_type):
  // acc += w * row, the product rounded before the sum (CombineArgs::group)
  auto const add_row = [&](int d, int token, int v0, float(&acc)[kUnroll][8], auto weighted, float w) {
    char const* const row = landing + (static_cast<std::size_t>(d) * p.max_tokens + token) * row_bytes;
    if constexpr (kFormat == WireFormat::bf16 && !decltype(weighted)::value) {
      device::add_bf16_vectors(reinterpret_cast<int4 const*>(row), v0, num_vec, acc);
    } else {
      // y = code * scale in fp32 (plain loads: the acquire above made the peer's row visible); the weighted bf16 sum
      // reads the row as bf16 and uses neither of the next two
      [[maybe_unused]] auto const* wire = reinterpret_cast<uint8_t const*>(row);
      [[maybe_unused]] float token_scale = 0.0f;
      if constexpr (kFormat == WireFormat::nvfp4)
        token_scale = *reinterpret_cast<float const*>(wire + wl.token_scale_offset);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if (v0 + u * 32 >= num_vec) continue;
        float f[8];
        if constexpr (kFormat == WireFormat::bf16)
          bf16x8_to_float(device::arch::load_v4(reinterpret_cast<int4 const*>(row) + v0 + u * 32), f);
        else
          device::dequantize_vec<kFormat>(wire, wl.scales_offset, v0 + u * 32, token_scale, f);
#pragma unroll
        for (int j = 0; j < 8; ++j)
          acc[u][j] = __fadd_rn(acc[u][j], decltype(weighted)::value ? __fmul_rn(w, f[j]) : f[j]);
      }
    }
  };
  // The rows of `token` that come back, ranks ascending: on one node the ranks of `mask` (its destinations, live
  // ones); across nodes the words of its token_mask, where the forward route hears once from each other node that
  // holds it (from that node's rail for this rank) and from this node's ranks one by one.
  auto const add_rows = [&](uint32_t mask, int token, int v0, float(&acc)[kUnroll][8], auto weighted, float w) {
    if constexpr (kNet) {
      int const words = ferry::detail::rank_words(world);
      uint32_t const* const dests = p.token_mask + static_cast<std::size_t>(token) * words;
      auto const word = [&](int i) { return i < words ? dests[i] & (kMasking && i == 0 ? live : ~0u) : 0u; };
      if (p.forward) {
        int const own_node = rank / p.local;
        for (int n = 0; n < p.nodes; ++n) {
          int const at = n * p.local;
          uint32_t const here = ferry::detail::ranks_of_node(word, at, p.local);  // node n's ranks of the token
          if (here == 0) continue;
          if (n != own_node) {
            add_row(at + rank % p.local, token, v0, acc, weighted, w);
            continue;
          }
          for (uint32_t m = here; m != 0; m &= m - 1) add_row(at + __ffs(m) - 1, token, v0, acc, weighted, w);
        }
      } else {
        for (int i = 0; i < words; ++i)
          for (uint32_t m = word(i); m != 0; m &= m - 1) add_row(32 * i + __ffs(m) - 1, token, v0, acc, weighted, w);
      }
    } else {
      for (uint32_t m = mask; m != 0; m &= m - 1) add_row(__ffs(m) - 1, token, v0, acc, weighted, w);
    }
  };
  auto const store_y = [&](int row, int v0, float const(&acc)[kUnroll][8]) {
    auto* y = static_cast<int4*>(p.y) + static_cast<std::size_t>(row) * num_vec;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < num_vec) device::arch::store_na_v4(y + v0 + u * 32, float_to_bf16x8(acc[u]));
  };
  if constexpr (!kGrouped) {
    for (int item = cta * kWarps + warp; item < items; item += p.num_ctas * kWarps) {
      int const token = item / num_chunks;
      int const v0 = (item % num_chunks) * kChunkVecs + lane;
      uint32_t const mask = kNet ? 0u : item == first_item ? first_mask : p.token_mask[token] & live;
      if constexpr (kMasking)
        if (item % num_chunks == 0) count_combine_misses(p, token, lane);
      float acc[kUnroll][8];
      device::zero_acc(acc);
      add_rows(mask, token, v0, acc, std::false_type{}, 1.0f);
      store_y(token, v0, acc);
    }
  } else {
    // CombineArgs::group: y[u] = sum over j ascending of w(u * group + j) * (that token's row), no fma. The buffer
    // has topk 1 (EpBuffer refuses a group otherwise), so a token's row comes from one rank (or its node's rail)
    int const outputs = num_tokens / p.group;
    for (int item = cta * kWarps + warp; item < outputs * num_chunks; item += p.num_ctas * kWarps) {
      int const out = item / num_chunks;
      int const v0 = (item % num_chunks) * kChunkVecs + lane;
      float acc[kUnroll][8];
      device::zero_acc(acc);
      for (int j = 0; j < p.group; ++j) {
        int const token = out * p.group + j;
        if constexpr (kMasking)
          if (item % num_chunks == 0) count_combine_misses(p, token, lane);
        uint32_t const mask = kNet ? 0u : p.token_mask[token] & live;
        if (!kNet && mask == 0)
          continue;  // went nowhere (or to a rank masked since): adds nothing, whatever its weight
        add_rows(mask, token, v0, acc, std::true_type{}, __ldg(p.group_weights + token));
      }
      store_y(out, v0, acc);
    }
  }
  FERRY_TRACE_END(trace, ll_combine_sum);
  if (cta == 0 && tid < world && tid != rank && abort_seen == seq)
    device::record_refusal(p.view, tid, WaitPhase::ll_combine);
}

// kFormat: the combine_format.
// Net: OneNode, or the network to the ranks of other nodes (NetParams).
// kMasking: rank masking (ll_dispatch_kernel's rules; across nodes the direct route): a rank masked since the
// dispatch gets no rows and adds none to y, and the entries y misses are counted.
// kGrouped: the receive half sums groups of tokens with weights (CombineArgs::group; p.group_weights set).
template <bool kExpertMajor, WireFormat kFormat, bool kSend, bool kRecv, class Net = OneNode, bool kMasking = false,
          bool kGrouped = false>
__global__ void __launch_bounds__(kThreads, 1) ll_combine_kernel(NetParams<LlCombineParams, Net> const p) {
  static_assert(kSend || kRecv, "an LL combine kernel runs at least one half");
  __shared__ uint64_t s_seq[2];
  next_sequences<kSend, kRecv>(p.state->combine_send_seq, p.state->combine_recv_seq, s_seq);
  if (masked_out<kMasking>(p)) return;
  FERRY_TRACE_WARP(trace, p.trace);
  decltype(auto) network = network_of<Net>(p);
  if constexpr (kSend) ll_combine_send<kExpertMajor, kFormat, kMasking>(p, network, s_seq[0] FERRY_TRACE_ARG(trace));
  if constexpr (kRecv) ll_combine_recv<kFormat, kMasking, kGrouped>(p, network, s_seq[1] FERRY_TRACE_ARG(trace));
}

}  // namespace ferry::cuda_ll
