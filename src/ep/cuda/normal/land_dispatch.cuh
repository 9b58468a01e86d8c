// Normal-mode dispatch of small batches through a landing zone: one kernel, no count exchange (every wire format).
//
// The count-exchange dispatch (normal/dispatch.cuh) needs every source's counts before its first row can move: a grid-wide
// arrival, CTA 0's count row over NVLink, the peers' rows back, then the push and a second signal. At a few hundred
// tokens that chain, not the bytes, is the leg. Here every source owns a fixed slot per token on every destination
// (landing.cuh), so the rows move first and the receiver puts them in order itself:
//  1. send (every CTA, warp per (token, chunk of its row)): the token's metadata record to every rank, its row to the
//     ranks holding one of its experts, into landing slot (parity, source, token); then per CTA: barrier, and one
//     release add per destination (device::arrival_share: a source's call adds device::kArrivalsPerCall
//     whatever its grid). A bf16 row goes to the other ranks only (the receiver copies
//     its own rows straight from x). A quantized row is quantized once, in registers, and its pieces (payload, block
//     scales, nvfp4's token scale) go into the wire row of every destination's slot, this rank's own too
//     (device_push.cuh); its chunks are whole scale groups, all in one CTA, where nvfp4's token scale (the max over
//     the chunks' amaxes) is met in shared memory;
//  2. wait until every source's arrivals reach device::arrivals_for(seq) (acquire; bounded);
//  3. every CTA scans the landed records in (source, token) order (a CTA scan): a record is present when one of its
//     ids is local, and its rank-major row is the count of present records before it: the order of the
//     count-exchange dispatch and of ref::dispatch. Row r's metadata (recv_src, recv_idx, recv_w) is written by CTA
//     r % ctas; CTA 0 counts rows per source and entries per local expert;
//  4. the rows into their delivered places over the whole grid. bf16: items (row, chunk) into recv_x, a peer's from
//     the landing zone, this rank's own straight from x. Quantized: the payload of each wire row into recv_x (items
//     (row, chunk)), its block scales into recv_scales row-major and, in another recv_scale_layout, into the final
//     scale tensor too (what the count exchange's receiver pass writes), nvfp4's token scale into recv_token_scales;
//     or, with dispatch_dequantize, each wire row dequantized into a bf16 row of recv_x (warp per row). CTA 0 writes
//     num_recv, the per-source offsets and the expert counts.
// Refusal: a source that refuses the call (a bad or repeated id seen by any of its CTAs, or its host's refusal with no
// tokens) writes seq into its abort word (land_abort, per parity) on every rank before that CTA's arrival; every rank
// reads every source's abort word after the wait, so all of them land nothing for the call (num_recv 0, no tokens
// left for a combine), and each records the refusal of every other rank that refused. A refusing CTA's rows still
// travel into the landing zone: no one reads them.
// Only used when no row can be dropped (recv_capacity = world * max_tokens_per_rank): the senders cannot know a
// receiver's drops, and combine trusts token_mask. Landing areas alternate by parity: a fast peer may send call n+1
// while this rank still reads call n, never call n+2 (that needs this rank's send of n+1, which comes after its
// receive of n). recv_x and the metadata are written by this rank only, so a peer's next call never touches them.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "comm/device/arrivals.cuh"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/landing.cuh"
#include "ep/cuda/normal/params.cuh"
#include "wire/device_codec.cuh"
#include "wire/device_push.cuh"
#include "wire/layout.hpp"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ep {

// Step 4 of a quantized delivery (not dequantized): the payload, block scales and nvfp4 token scale of each received
// row's wire row (wire_row(row): its landing slot) into the places the count exchange delivers them to (DispatchParams
// ::qdst), and in another recv_scale_layout the scales into the final tensor too. Every thread of the grid calls it.
// Loads are coherent: peers wrote the landing zone during this kernel.
template <WireFormat kFormat, typename WireRow>
__device__ __forceinline__ void land_deliver_quantized(DispatchParams const& p, int num_recv, WireRow wire_row) {
  constexpr int kScaleBytes = wire::format_traits(kFormat).scale_bytes;
  WireRowLayout const wl = wire::make_row_layout(kFormat, p.hidden);
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const cta = static_cast<int>(blockIdx.x);
  int const total_warps = p.num_ctas * kWarps;
  char* const sym = p.net.window(p.view.rank);
  // the payload, items (row, chunk); 8-byte pieces when a row's payload is not a multiple of 16 bytes (nvfp4 with
  // hidden % 32 == 16: its rows in recv_x are then only 8-byte aligned)
  int const piece = wl.payload_bytes % 16 == 0 ? 16 : 8;
  int const pieces = static_cast<int>(wl.payload_bytes / piece);
  int const chunks = device::chunks_per_row(num_recv, total_warps, (pieces * piece) / 16);
  for (int item = cta * kWarps + (tid >> 5); item < num_recv * chunks; item += total_warps) {
    int const row = item / chunks;
    auto const [u_begin, u_end] = device::chunk_range(pieces, item % chunks, chunks);
    std::size_t const skip = static_cast<std::size_t>(u_begin) * piece;
    std::size_t const bytes = static_cast<std::size_t>(u_end - u_begin) * piece;
    char* const dst = sym + p.qdst.payload + static_cast<std::size_t>(row) * p.qdst.payload_stride + skip;
    char const* const src = wire_row(row) + skip;
    if (piece == 16) {
      device::copy_16B<false, landing::kCopyUnroll>(dst, src, bytes, lane, 32);
    } else {
      for (std::size_t i = lane; i < bytes / 8; i += 32)
        reinterpret_cast<uint2*>(dst)[i] = reinterpret_cast<uint2 const*>(src)[i];
    }
  }
  // the scales, thread per (row, block), blocks fastest (coalesced loads and row-major stores)
  bool const relayout = p.recv_pass == RecvPass::relayout;
  auto* const final_scales = static_cast<uint8_t*>(p.recv_scales_final);
  int const num_scales = wl.num_scales;
  int64_t const total = static_cast<int64_t>(num_recv) * num_scales;
  for (int64_t i = static_cast<int64_t>(cta) * kThreads + tid; i < total;
       i += static_cast<int64_t>(p.num_ctas) * kThreads) {
    int const row = static_cast<int>(i / num_scales);
    int const block = static_cast<int>(i % num_scales);
    char const* const src = wire_row(row) + wl.scales_offset + static_cast<std::size_t>(block) * kScaleBytes;
    char* const dst = sym + p.qdst.scales + static_cast<std::size_t>(row) * p.qdst.scales_stride +
                      static_cast<std::size_t>(block) * kScaleBytes;
    std::size_t const to =
        relayout ? wire::scale_offset(kFormat, p.scale_layout, static_cast<std::size_t>(p.recv_capacity), p.hidden,
                                       static_cast<std::size_t>(row), static_cast<std::size_t>(block))
                 : 0;
    if constexpr (kScaleBytes == 4) {
      uint32_t const v = *reinterpret_cast<uint32_t const volatile*>(src);
      *reinterpret_cast<uint32_t*>(dst) = v;
      if (relayout) *reinterpret_cast<uint32_t*>(final_scales + to) = v;
    } else {
      uint8_t const v = *reinterpret_cast<uint8_t const volatile*>(src);
      *reinterpret_cast<uint8_t*>(dst) = v;
      if (relayout) final_scales[to] = v;
    }
  }
  if constexpr (kFormat == WireFormat::nvfp4) {
    for (int row = cta * kThreads + tid; row < num_recv; row += p.num_ctas * kThreads)
      *reinterpret_cast<float*>(sym + p.qdst.token + static_cast<std::size_t>(row) * p.qdst.token_stride) =
          *reinterpret_cast<float const volatile*>(wire_row(row) + wl.token_scale_offset);
  }
}

// What one CTA of land_dispatch_kernel keeps in shared memory besides its dynamic part (s_land: the landing slot of
// each rank-major row, [world * max_tokens]; s_entries: [num_local] entries per local expert).
struct LandShared {
  int32_t base[kMaxCudaWorld + 1];  // first landed record of each source
  int32_t src_rows[kMaxCudaWorld];  // CTA 0: present rows per source
  landing::ScanShared<kWarps> scan;
  uint64_t seq;
  int ok;
  int refuse;        // this CTA saw a bad or repeated id
  uint32_t aborted;  // sources that refused this call
};

// Token t's destinations (warp-wide, returned as a mask); chunk 0 reports bad ids and writes its mask and its record
// to every rank, at landing slot `slot`.
template <typename IdxT>
__device__ __forceinline__ uint32_t land_route(DispatchParams const& p, LandShared& s, int t, int chunk,
                                               std::size_t slot, int lane) {
  landing::Routing const routing{p.view, p.topk_idx, p.topk_weights, p.topk, p.num_experts, p.num_local_experts};
  int64_t e;
  float w;
  bool refused;
  int const dest = landing::token_destination<IdxT>(routing, t, lane, chunk == 0, e, w, refused);
  uint32_t const mask = __reduce_or_sync(0xffffffffu, dest >= 0 ? 1u << dest : 0u);
  if (refused) s.refuse = 1;  // any lane: every writer writes 1
  if (chunk == 0) {
    if (lane == 0) p.token_mask[t] = mask;  // no receiver drops a row here: every destination holds it
    landing::write_records(p.net, p.view.world, p.layout.normal.land_meta, slot, landing::record_bytes(p.topk), p.topk,
                           p.num_local_experts, dest, e, w, lane);
  }
  return mask;
}

// 1, bf16: items (token, chunk); the row to the other destinations only (this rank's copy step takes its own rows
// straight from x).
template <typename IdxT>
__device__ __forceinline__ void land_send_bf16(DispatchParams const& p, LandShared& s, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const total_warps = p.num_ctas * kWarps;
  int const num_vec = p.hidden / 8;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  int const send_chunks = device::chunks_per_row(p.num_tokens, total_warps, num_vec);
  for (int item = cta * kWarps + warp; item < p.num_tokens * send_chunks; item += total_warps) {
    int const t = item / send_chunks;
    int const chunk = item % send_chunks;
    std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);
    uint32_t const mask = land_route<IdxT>(p, s, t, chunk, slot, lane);
    auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, send_chunks);
    std::size_t const at = p.layout.normal.land_rows + slot * row_bytes;
    landing::send_row_chunk<kDispatchUnroll>(
        reinterpret_cast<int4 const*>(static_cast<char const*>(p.x) + static_cast<std::size_t>(t) * row_bytes),
        v_begin, v_end, mask & ~(1u << rank), [&](int d) { return reinterpret_cast<int4*>(p.net.window(d) + at); },
        lane);
  }
}

// 1, quantized: a row's chunks are whole scale groups, a power of two of them in one CTA (cta_chunks_per_row), and
// every warp of a CTA runs the same steps: nvfp4 meets its chunks' amaxes with a barrier a step. The pieces go to
// every destination, this rank's own slot too, so a row is quantized once and every delivered row is read from a slot.
template <typename IdxT, WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void land_send_quantized(DispatchParams const& p, LandShared& s, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  using Codec = device::UnitCodec<kFormat, kUnitElems>;
  __shared__ device::CtaRowMax<kWarps> s_amax;
  int const total_warps = p.num_ctas * kWarps;
  WireRowLayout const wl = wire::make_row_layout(kFormat, p.hidden);
  int const chunks = device::cta_chunks_per_row(p.num_tokens, total_warps,
                                                device::scale_groups<kFormat, kUnitElems>(p.hidden), kWarps);
  int const items = p.num_tokens * chunks;
  for (int base = cta * kWarps, step = 0; base < items; base += total_warps, ++step) {
    int const item = base + warp;
    int const t = item / chunks;
    int const chunk = item % chunks;
    float token_scale = 0.0f;
    if constexpr (kFormat == WireFormat::nvfp4)
      token_scale = device::cta_chunk_token_scale<kUnitElems>(p.x, p.x_scales != nullptr ? p.x_token_scales : nullptr,
                                                              p.hidden, t, s_amax, step, chunk, chunks, item < items);
    if (item >= items) continue;
    std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);
    uint32_t const mask = land_route<IdxT>(p, s, t, chunk, slot, lane);
    if (mask == 0) continue;
    device::QuantRowInput const in = device::quant_row_input<kFormat, kUnitElems>(p.x, p.x_scales, p.hidden, t);
    device::push_quantized_chunk<kFormat, kUnitElems, kDispatchUnroll / Codec::kVecs>(
        in, p.hidden, chunk, chunks, mask, token_scale,
        [&](int d) {
          char* const row = p.net.window(d) + p.layout.normal.land_rows + slot * wl.row_bytes;
          return device::QuantRowPlaces{row, row + wl.scales_offset,
                                        reinterpret_cast<float*>(row + wl.token_scale_offset)};
        },
        lane);
  }
}

// 3. ordered scan of the landed records, kThreads per step (every CTA: each needs the whole order): s_land gets each
//    row's slot, row r's metadata is written by CTA r % ctas, and CTA 0 counts rows per source (s.src_rows) and
//    entries per local expert (s_entries). Returns the rows received.
__device__ __forceinline__ int land_scan(DispatchParams const& p, LandShared& s, int32_t* s_land, int32_t* s_entries,
                                         int parity, int num_landed) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const topk = p.topk;
  int const max_tokens = p.max_tokens;
  std::size_t const record_bytes = landing::record_bytes(topk);
  char* const sym = p.net.window(rank);
  auto* const recv_src = reinterpret_cast<int2*>(sym + p.layout.normal.recv_src);
  auto* const recv_idx = reinterpret_cast<int32_t*>(sym + p.layout.normal.recv_idx);
  auto* const recv_w = reinterpret_cast<float*>(sym + p.layout.normal.recv_w);
  int num_recv = 0;
  for (int base = 0; base < num_landed; base += kThreads) {
    int const r = base + tid;
    int source = 0;
    int token = 0;
    int32_t const* record = nullptr;
    int32_t ids[kMaxTopk];
    bool present = false;
    if (r < num_landed) {
      while (s.base[source + 1] <= r) ++source;
      token = r - s.base[source];
      record = reinterpret_cast<int32_t const*>(sym + p.layout.normal.land_meta +
                                                landing::slot_index(parity, world, source, max_tokens, token) *
                                                    record_bytes);
      landing::load_record_ids(record, topk, ids);
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) present |= ids[k] >= 0;
    }
    landing::ScanOffsets const step = landing::scan_step<false>(present, 0, s.scan, warp, lane);
    if (present) {
      int const row = num_recv + step.row;
      s_land[row] = source * max_tokens + token;
      if (row % p.num_ctas == cta) {
        float const* weights = reinterpret_cast<float const*>(record + topk);
        recv_src[row] = make_int2(source, token);
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          if (k >= topk) break;  // ids stay in registers: a runtime index would put them in local memory
          recv_idx[static_cast<std::size_t>(row) * topk + k] = ids[k];
          recv_w[static_cast<std::size_t>(row) * topk + k] = weights[k];
        }
      }
      if (cta == 0) {
        atomicAdd(&s.src_rows[source], 1);
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k)
          if (ids[k] >= 0) atomicAdd(&s_entries[ids[k]], 1);
      }
    }
    num_recv += step.rows;
    __syncthreads();  // the scan words are reused by the next step
  }
  return num_recv;
}

// 4. the rows into their delivered places, over the grid. bf16: items (row, chunk) into recv_x, a peer's from the
//    landing zone (coherent loads: written during this kernel), this rank's own from x (one coherent copy loop for
//    both: a second, non-coherent one spilled). Quantized: dequantized (dispatch_dequantize) or delivered as is.
template <WireFormat kFormat>
__device__ __forceinline__ void land_copy(DispatchParams const& p, int32_t const* s_land, int parity, int num_recv) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const max_tokens = p.max_tokens;
  int const total_warps = p.num_ctas * kWarps;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  // a landing slot's row: the bf16 row, or the format's wire row
  std::size_t const land_row_bytes =
      kFormat != WireFormat::bf16 ? wire::make_row_layout(kFormat, p.hidden).row_bytes : row_bytes;
  char* const sym = p.net.window(rank);
  char const* const landed =
      sym + p.layout.normal.land_rows +
      static_cast<std::size_t>(parity) * world * static_cast<std::size_t>(max_tokens) * land_row_bytes;
  if constexpr (kFormat == WireFormat::bf16) {
    int const num_vec = p.hidden / 8;
    char* const recv_x = sym + p.layout.normal.recv_x;
    int const copy_chunks = device::chunks_per_row(num_recv, total_warps, num_vec);
    for (int item = cta * kWarps + warp; item < num_recv * copy_chunks; item += total_warps) {
      int const row = item / copy_chunks;
      auto const [v_begin, v_end] = device::chunk_range(num_vec, item % copy_chunks, copy_chunks);
      int const slot = s_land[row];
      std::size_t const skip = static_cast<std::size_t>(v_begin) * 16;
      std::size_t const bytes = static_cast<std::size_t>(v_end - v_begin) * 16;
      char* const dst = recv_x + static_cast<std::size_t>(row) * row_bytes + skip;
      char const* const src = slot / max_tokens == rank ? static_cast<char const*>(p.x) +
                                                              static_cast<std::size_t>(slot % max_tokens) * row_bytes
                                                        : landed + static_cast<std::size_t>(slot) * row_bytes;
      device::copy_16B<false, landing::kCopyUnroll>(dst, src + skip, bytes, lane, 32);
    }
  } else {
    auto const wire_row = [&](int row) { return landed + static_cast<std::size_t>(s_land[row]) * land_row_bytes; };
    if (p.recv_pass == RecvPass::dequantize) {
      // warp per row: the wire row -> a bf16 row (the device codec: y = code * scale in fp32, rounded once)
      auto* const out = reinterpret_cast<__nv_bfloat16*>(sym + p.layout.normal.recv_x);
      for (int row = cta * kWarps + warp; row < num_recv; row += total_warps)
        device::dequantize_row_warp<kFormat, __nv_bfloat16>(reinterpret_cast<uint8_t const*>(wire_row(row)), p.hidden,
                                                            out + static_cast<std::size_t>(row) * p.hidden);
    } else {
      land_deliver_quantized<kFormat>(p, num_recv, wire_row);
    }
  }
}

// The outputs (CTA 0, every thread): the per-source offsets, rows and tokens, num_recv, the expert counts.
__device__ __forceinline__ void land_outputs(DispatchParams const& p, LandShared const& s, int32_t const* s_entries,
                                             int num_recv) {
  int const world = p.view.world;
  int const tid = static_cast<int>(threadIdx.x);
  if (tid == 0) {
    int32_t offset = 0;
    for (int src = 0; src < world; ++src) {
      p.state->src_offset[src] = offset;
      p.state->src_count[src] = s.src_rows[src];
      p.state->src_tokens[src] = s.base[src + 1] - s.base[src];
      offset += s.src_rows[src];
    }
    p.state->num_recv = num_recv;
    if (s.aborted != 0) p.state->num_tokens = 0;  // a refused call leaves no tokens for a combine
  }
  for (int el = tid; el < p.num_local_experts; el += kThreads) p.expert_counts[el] = s_entries[el];
}

template <typename IdxT, WireFormat kFormat, int kUnitElems>
__global__ void __launch_bounds__(kThreads, 1) land_dispatch_kernel(DispatchParams const p) {
  static_assert(sizeof(IdxT) == 4 || sizeof(IdxT) == 8, "topk_idx is int32 or int64");
  static_assert((kFormat == WireFormat::bf16) == (kUnitElems == 0), "bf16 rows are copied; quantized rows need a unit");
  extern __shared__ int32_t s_dyn[];  // [world * max_tokens] landing slot of each rank-major row, [num_local] entries
  __shared__ LandShared s;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int32_t* const s_land = s_dyn;
  int32_t* const s_entries = s_dyn + world * p.max_tokens;
  FERRY_TRACE_WARP(trace, p.trace);

  // 0. this CTA's sequence number (its own word: stream order carries it across calls)
  if (tid == 0) {
    s.seq = ++p.state->normal.land_seq[cta];
    s.ok = 1;
    s.refuse = p.abort;
    s.aborted = 0;
  }
  if (cta == 0) {
    for (int i = tid; i < p.num_local_experts; i += kThreads) s_entries[i] = 0;
    if (tid < world) s.src_rows[tid] = 0;
  }
  __syncthreads();
  uint64_t const seq = s.seq;
  int const parity = static_cast<int>(seq & 1);

  // 1. send: this call's token count to every destination (covered by CTA 0's release), then items (token, chunk)
  FERRY_TRACE_BEGIN(trace, dispatch_land_send);
  if (cta == 0 && tid < world)
    *(reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.normal.land_tokens) + parity * world + rank) =
        static_cast<uint64_t>(p.num_tokens);
  if (cta == 0 && tid == 0) p.state->num_tokens = p.num_tokens;
  if constexpr (kFormat == WireFormat::bf16)
    land_send_bf16<IdxT>(p, s, parity);
  else
    land_send_quantized<IdxT, kFormat, kUnitElems>(p, s, parity);
  // the barrier orders every thread's stores (the abort words too) before the release adds, cumulative over them
  __syncthreads();
  if (s.refuse) landing::publish_abort(p.net, p.layout.normal.land_abort, parity, world, rank, seq);
  if (tid < world)
    p.net.add_signal(tid, p.layout.normal.land_arrivals + rank * sizeof(uint64_t),
                     device::arrival_share(cta, p.num_ctas));
  FERRY_TRACE_END(trace, dispatch_land_send);

  // 2. every source's send CTAs of this call (thread s waits for source s; acquire, bounded)
  FERRY_TRACE_BEGIN(trace, dispatch_land_wait);
  char* const sym = p.net.window(rank);
  int const num_landed = landing::wait_sources(
      p.view, reinterpret_cast<uint64_t const*>(sym + p.layout.normal.land_arrivals), seq, device::kArrivalsPerCall,
      reinterpret_cast<uint64_t const volatile*>(sym + p.layout.normal.land_tokens) + parity * world,
      reinterpret_cast<uint64_t const volatile*>(sym + p.layout.normal.land_abort) + parity * world,
      WaitPhase::dispatch_data, s.base, &s.aborted, &s.ok);
  if (num_landed < 0) return;
  FERRY_TRACE_END(trace, dispatch_land_wait);

  FERRY_TRACE_BEGIN(trace, dispatch_land_scan);
  int const num_recv = land_scan(p, s, s_land, s_entries, parity, num_landed);  // 3.
  FERRY_TRACE_END(trace, dispatch_land_scan);

  FERRY_TRACE_BEGIN(trace, dispatch_land_copy);
  land_copy<kFormat>(p, s_land, parity, num_recv);  // 4.
  if (cta == 0) land_outputs(p, s, s_entries, num_recv);
  FERRY_TRACE_END(trace, dispatch_land_copy);
}

}  // namespace ferry::cuda_ep
