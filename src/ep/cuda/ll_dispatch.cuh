// Low-latency dispatch over NVLink: one kernel (or, with the hook, its send half and its receive half apart).
//
// Send half (every CTA, warp per (token, chunk of its row), no step waits for another CTA):
//  1. the token's destination ranks from its topk ids (bad ids dropped and counted);
//  2. its metadata record (local expert ids for that rank, weights) to EVERY rank, so each receiver knows the full
//     routing of the source without a count exchange; the row itself only to the ranks that hold one of its experts
//     (wire de-duplication), at landing slot (source, token) of the destination's current parity. A bf16 batch with
//     fewer tokens than the grid has warps splits each row over several warps. A quantized dispatch_format sends the
//     token's wire row (warp per token): quantized once by this warp with the device codec (or forwarded from
//     pre-quantized input), straight into the destination when there is one, else built in this rank's own landing
//     slot (t's slot of the source's own region: only this warp writes it, and when no local expert takes t the
//     receive half never reads it) and copied from there to the other destinations;
//  3. per CTA: barrier, then +1 on every destination's arrival counter of this source (release, cumulative).
// Receive half (CTA per (local expert, part)):
//  4. wait until every source's arrivals reach seq * num_ctas (acquire; bounded);
//  5. scan the received records in (source, token) order with a CTA scan: a row is present when one of its ids is
//     local; its rank-major index is the count of present rows before it; entry (row, k) of expert e gets the next
//     slot of e. This is exactly ref::expert_layout's order, computed by every CTA for its expert, no atomics. The
//     rank-major metadata of the rows is written in the same scan, each record by one CTA (spread over the grid);
//  6. copy each filled slot's row from the landing zone into expert_x (the wire carried one copy per rank; the
//     expert-major duplicates are made locally). A quantized dispatch_format copies the payload and writes the block
//     scales into the expert's scale tensor (and nvfp4's token scale), or dequantizes the row into bf16
//     (dispatch_dequantize), in the same copy. A bf16 row is split over warps when a CTA has fewer rows than warps.
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/landing.cuh"
#include "ep/cuda/ll_params.cuh"
#include "quant/device_codec.cuh"
#include "quant/device_scales.cuh"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ll {

// Warp copy of `bytes` (a multiple of 8; both pointers 8-byte aligned, and 16-byte aligned when bytes is a multiple of
// 16): 16-byte vectors where the length allows, else 8-byte ones (an nvfp4 payload of hidden % 32 == 16 elements).
template <bool kNcSource>
__device__ __forceinline__ void copy_payload_warp(void* dst, void const* src, std::size_t bytes, int lane) {
  if (bytes % 16 == 0) {
    // 2 in flight: with 4 or 8 the nvfp4 one-kernel leg spilled (ptxas -v), 2 spills in no instance
    device::copy_16B<kNcSource, 2>(dst, src, bytes, lane, 32);
    return;
  }
  auto* d = static_cast<uint2*>(dst);
  auto const* s = static_cast<uint2 const*>(src);
  for (std::size_t i = lane; i < bytes / 8; i += 32) d[i] = kNcSource ? __ldg(s + i) : s[i];
}

// Builds the wire row of pre-quantized token t (payload row of x, its block scales, nvfp4's token scale) at `dst`,
// padding written as zero: the bytes the codec would have sent for the same codes and scales.
template <WireFormat kFormat>
__device__ __forceinline__ void forward_wire_row_warp(LlDispatchParams const& p, int t, uint8_t* dst, int lane) {
  constexpr quant::FormatTraits kTraits = quant::format_traits(kFormat);
  WireRowLayout const wl = quant::make_row_layout(kFormat, p.hidden);
  // 1. payload, then the zero pad up to the scales (0 or 8 bytes)
  copy_payload_warp<true>(dst, static_cast<uint8_t const*>(p.x) + static_cast<std::size_t>(t) * wl.payload_bytes,
                          wl.payload_bytes, lane);
  if (lane == 0 && wl.scales_offset > wl.payload_bytes)
    *reinterpret_cast<uint2*>(dst + wl.payload_bytes) = make_uint2(0, 0);
  // 2. the scales as 32-bit words up to the next 16 bytes (zero past the last scale)
  std::size_t const scale_bytes = static_cast<std::size_t>(wl.num_scales) * kTraits.scale_bytes;
  int const words = static_cast<int>(quant::align_up(scale_bytes, quant::kWireAlign) / 4);
  for (int w = lane; w < words; w += 32) {
    uint32_t word = 0;
    if constexpr (kTraits.scale_bytes == 4) {
      auto const* scales = static_cast<uint32_t const*>(p.x_scales) + static_cast<std::size_t>(t) * wl.num_scales;
      if (w < wl.num_scales) word = __ldg(scales + w);
    } else {
      auto const* scales = static_cast<uint8_t const*>(p.x_scales) + static_cast<std::size_t>(t) * wl.num_scales;
#pragma unroll
      for (int b = 0; b < 4; ++b)
        if (4 * w + b < wl.num_scales) word |= static_cast<uint32_t>(__ldg(scales + 4 * w + b)) << (8 * b);
    }
    *reinterpret_cast<uint32_t*>(dst + wl.scales_offset + 4 * static_cast<std::size_t>(w)) = word;
  }
  // 3. nvfp4: the token scale and the zero pad after it (16 bytes, one word per lane)
  if constexpr (kTraits.token_scale_bytes != 0)
    if (lane < 4)
      *reinterpret_cast<uint32_t*>(dst + wl.token_scale_offset + 4 * lane) =
          lane == 0 ? __float_as_uint(__ldg(p.x_token_scales + t)) : 0u;
}

// The wire row of token t to every destination rank of `mask` (non-empty), landing slot `slot`: quantized once (or
// forwarded), then copied to the other destinations from where it was built.
template <WireFormat kFormat>
__device__ __forceinline__ void send_wire_row_warp(LlDispatchParams const& p, int t, uint32_t mask, std::size_t slot,
                                                   int lane) {
  int const rank = p.view.rank;
  std::size_t const wire_bytes = p.layout.dispatch_row_bytes;
  std::size_t const at = p.layout.dispatch_rows + slot * wire_bytes;
  // 1. where the row is built: the only destination, else this rank's own slot (a destination, or unused this call)
  bool const single = (mask & (mask - 1)) == 0;
  int const built_on = single ? __ffs(mask) - 1 : rank;
  uint8_t* const built = reinterpret_cast<uint8_t*>(p.sym[built_on] + at);
  if (p.x_scales != nullptr)
    forward_wire_row_warp<kFormat>(p, t, built, lane);
  else
    device::quantize_row_warp<kFormat, __nv_bfloat16, true, kUnroll>(
        static_cast<__nv_bfloat16 const*>(p.x) + static_cast<std::size_t>(t) * p.hidden, p.hidden, built);
  uint32_t const rest = mask & ~(1u << built_on);
  if (rest == 0) return;
  // 2. the other destinations: kUnroll coherent loads in flight per lane (this warp just wrote them; __syncwarp
  //    orders its lanes' stores before the loads), then the stores to each destination
  __syncwarp();
  auto const* src = reinterpret_cast<int4 const*>(built);
  int const num_vec = static_cast<int>(wire_bytes / 16);
  for (int i = lane; i < num_vec; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * 32 < num_vec) v[u] = device::arch::load_v4(src + i + u * 32);
    for (uint32_t m = rest; m != 0; m &= m - 1) {
      auto* dst = reinterpret_cast<int4*>(p.sym[__ffs(m) - 1] + at);
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + u * 32 < num_vec) device::arch::store_na_v4(dst + i + u * 32, v[u]);
    }
  }
}

template <typename IdxT, WireFormat kFormat>
__device__ __forceinline__ void ll_dispatch_send(LlDispatchParams const& p, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  static_assert(sizeof(IdxT) == 4 || sizeof(IdxT) == 8, "topk_idx is int32 or int64");
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const warp = tid >> 5;
  int const cta = static_cast<int>(blockIdx.x);
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const num_local = p.num_local_experts;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  int const num_vec = p.hidden / 8;
  int const total_warps = p.num_ctas * kWarps;
  landing::Routing const routing{p.view, p.topk_idx, p.topk_weights, topk, p.num_experts, num_local};

  // 1. this call's token count to every destination (covered by CTA 0's arrival below)
  FERRY_TRACE_BEGIN(trace, ll_dispatch_send);
  if (cta == 0 && tid < world) {
    auto* word = reinterpret_cast<uint64_t volatile*>(p.sym[tid] + p.layout.dispatch_tokens) + parity * world + rank;
    *word = static_cast<uint64_t>(p.num_tokens);
  }
  if (cta == 0 && tid == 0) p.state->num_tokens = p.num_tokens;

  // 2. items (token, chunk): a bf16 batch with fewer tokens than the grid has warps splits each row into chunks so
  //    that every warp has bytes in flight (a warp walking a whole row waits for ~7 round trips in a row); quantized
  //    rows stay whole (the codec works on a row). Chunk 0 reports bad ids and writes the token's mask and metadata.
  int const chunks = kFormat == WireFormat::bf16 ? device::chunks_per_row(p.num_tokens, total_warps, num_vec) : 1;
  int const items = p.num_tokens * chunks;
  for (int item = cta * kWarps + warp; item < items; item += total_warps) {
    int const t = item / chunks;
    int const chunk = item % chunks;
    int64_t e;
    float w;
    int const dest = landing::token_destination<IdxT>(routing, t, lane, chunk == 0, e, w);
    uint32_t const mask = __reduce_or_sync(0xffffffffu, dest >= 0 ? 1u << dest : 0u);
    std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);

    if (chunk == 0) {
      if (lane == 0) p.token_mask[t] = mask;
      landing::write_records(p.sym, world, p.layout.dispatch_meta, slot, p.layout.meta_bytes, topk, num_local, dest, e,
                             w, lane);
    }

    // the row (this chunk of it), once per destination rank
    if constexpr (kFormat != WireFormat::bf16) {
      if (mask != 0) send_wire_row_warp<kFormat>(p, t, mask, slot, lane);
    } else {
      auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
      std::size_t const at = p.layout.dispatch_rows + slot * row_bytes;
      landing::send_row_chunk<kUnroll>(
          reinterpret_cast<int4 const*>(static_cast<char const*>(p.x) + static_cast<std::size_t>(t) * row_bytes),
          v_begin, v_end, mask, [&](int d) { return reinterpret_cast<int4*>(p.sym[d] + at); }, lane);
    }
  }
  FERRY_TRACE_END(trace, ll_dispatch_send);

  // 3. arrival: the barrier orders every thread's stores before the release adds, which are cumulative over them
  //    (one release per destination; no per-thread fence, which would drain each thread's NVLink stores)
  FERRY_TRACE_BEGIN(trace, ll_dispatch_send_arrival);
  __syncthreads();
  if (tid < world) device::signal_add(reinterpret_cast<uint64_t*>(p.sym[tid] + p.layout.dispatch_arrivals) + rank, 1);
  FERRY_TRACE_END(trace, ll_dispatch_send_arrival);
}

template <WireFormat kFormat>
__device__ __forceinline__ void ll_dispatch_recv(LlDispatchParams const& p, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  __shared__ int32_t s_base[kMaxLocalPeers + 1];  // first rank-major landing row of each source
  __shared__ landing::ScanShared<kWarps> s_scan;
  __shared__ int s_ok;

  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const warp = tid >> 5;
  int const cta = static_cast<int>(blockIdx.x);
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const slots = p.expert_slots;
  std::size_t const wire_bytes = p.layout.dispatch_row_bytes;
  std::size_t const row_bytes = p.expert_row_bytes;

  // 4. every source's send CTAs of this call (thread s waits for source s; acquire, bounded)
  FERRY_TRACE_BEGIN(trace, ll_dispatch_wait_arrivals);
  if (tid == 0) s_ok = 1;
  __syncthreads();
  int const num_landed = landing::wait_sources(
      p.view, reinterpret_cast<uint64_t const*>(p.sym[rank] + p.layout.dispatch_arrivals),
      seq * static_cast<uint64_t>(p.num_ctas),
      reinterpret_cast<uint64_t const volatile*>(p.sym[rank] + p.layout.dispatch_tokens) + parity * world,
      WaitPhase::ll_dispatch, s_base, &s_ok);
  if (num_landed < 0) return;
  FERRY_TRACE_END(trace, ll_dispatch_wait_arrivals);

  int const parts = p.expert_parts;
  int const part = cta % parts;
  int const expert_stride = p.num_ctas / parts;
  // The CTAs that run an expert pass share the rank-major metadata: landed record r is written by CTA r % meta_ctas
  // in its first pass (one CTA writing all of it was the last to finish at 128 tokens).
  int const meta_ctas = min(p.num_ctas, p.num_local_experts * parts);
  for (int e = cta / parts; e < p.num_local_experts; e += expert_stride) {
    FERRY_TRACE_BEGIN(trace, ll_dispatch_scan);
    bool const first_pass = e == cta / parts;
    int running_rows = 0;
    int running_slots = 0;
    // 5. ordered scan of the landed records, kThreads per step
    for (int base = 0; base < num_landed; base += kThreads) {
      int const r = base + tid;
      int source = 0;
      int token = 0;
      int present = 0;
      int hits = 0;
      int32_t const* record = nullptr;
      // the record's ids in registers, all loads issued before any is used (the slot loop below branches on them:
      // loading there made one dependent round trip per k)
      int32_t ids[kMaxTopk];
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) ids[k] = -1;
      if (r < num_landed) {
        while (s_base[source + 1] <= r) ++source;
        token = r - s_base[source];
        record = reinterpret_cast<int32_t const*>(p.sym[rank] + p.layout.dispatch_meta +
                                                  landing::slot_index(parity, world, source, p.max_tokens, token) *
                                                      p.layout.meta_bytes);
        // 16-byte loads: 4-byte ones made the scan bound by L2 requests (4.6 us at 128 tokens, 12 us at 512)
        landing::load_record_ids(record, topk, ids);
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          present |= ids[k] >= 0;
          hits += ids[k] == e;
        }
      }
      landing::ScanOffsets const step = landing::scan_step<true>(present, hits, s_scan, warp, lane);
      if (present) {
        int const row = running_rows + step.row;
        std::size_t const entry0 = static_cast<std::size_t>(row) * topk;
        if (first_pass && r % meta_ctas == cta) {
          auto const* weights = reinterpret_cast<float const*>(record + topk);
          float w[kMaxTopk];
#pragma unroll
          for (int k = 0; k < kMaxTopk; ++k) w[k] = k < topk ? weights[k] : 0.0f;
          p.recv_src[2 * row] = source;
          p.recv_src[2 * row + 1] = token;
#pragma unroll
          for (int k = 0; k < kMaxTopk; ++k) {
            if (k >= topk) break;
            p.recv_idx[entry0 + k] = ids[k];
            p.recv_w[entry0 + k] = w[k];
            if (ids[k] < 0) p.recv_slot[entry0 + k] = -1;
          }
        }
        if (hits) {
          int slot = running_slots + step.first_hit;
#pragma unroll
          for (int k = 0; k < kMaxTopk; ++k) {
            if (ids[k] != e) continue;  // -1 past topk
            if (slot < slots) {
              if (part == 0) p.recv_slot[entry0 + k] = slot;
              if (slot % parts == part) {
                std::size_t const at = static_cast<std::size_t>(e) * slots + slot;
                p.expert_src_row[at] = row;
                p.slot_landing[at] = source * p.max_tokens + token;
              }
            } else if (part == 0) {  // past expert_capacity: no slot, dropped and counted
              p.recv_slot[entry0 + k] = -1;
              device::record_input_error(p.view, slot, true);
            }
            ++slot;
          }
        }
      }
      running_rows += step.rows;
      running_slots += step.hits;
      __syncthreads();  // the scan words are reused by the next step
    }
    if (tid == 0) {
      if (part == 0) p.expert_counts[e] = running_slots;
      if (e == 0 && part == 0) p.state->num_recv = running_rows;
    }
    int const filled = running_slots < slots ? running_slots : slots;
    for (int slot = filled + tid; slot < slots; slot += kThreads)
      if (slot % parts == part) p.expert_src_row[static_cast<std::size_t>(e) * slots + slot] = -1;

    FERRY_TRACE_END(trace, ll_dispatch_scan);

    // 6. this part's filled slots (slot_landing was written by this CTA above: the barrier orders it) as items (slot,
    //    chunk), a bf16 row split over the warps when the part has fewer slots than warps (as in the send half)
    char const* landing =
        p.sym[rank] + p.layout.dispatch_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * wire_bytes;
    int const row_vecs = static_cast<int>(row_bytes / 16);
    FERRY_TRACE_BEGIN(trace, ll_dispatch_copy);
    int const count = filled > part ? (filled - part + parts - 1) / parts : 0;  // this part's slots
    int const chunks = kFormat == WireFormat::bf16 ? device::chunks_per_row(count, kWarps, row_vecs) : 1;
    for (int item = warp; item < count * chunks; item += kWarps) {
      int const slot = part + parts * (item / chunks);
      std::size_t const at = static_cast<std::size_t>(e) * slots + slot;
      char const* src = landing + static_cast<std::size_t>(p.slot_landing[at]) * wire_bytes;
      char* dst = static_cast<char*>(p.expert_x) + at * row_bytes;
      if constexpr (kFormat == WireFormat::bf16) {
        auto const [v_begin, v_end] = device::chunk_range(row_vecs, item % chunks, chunks);
        device::copy_16B<false, landing::kCopyUnroll>(
            dst + static_cast<std::size_t>(v_begin) * 16, src + static_cast<std::size_t>(v_begin) * 16,
            static_cast<std::size_t>(v_end - v_begin) * 16, lane, 32);  // coherent loads
      } else if (p.dequantize) {
        device::dequantize_row_warp<kFormat, __nv_bfloat16>(reinterpret_cast<uint8_t const*>(src), p.hidden,
                                                            reinterpret_cast<__nv_bfloat16*>(dst));
      } else {
        copy_payload_warp<false>(dst, src, row_bytes, lane);
        device::deliver_scales_warp<kFormat>(reinterpret_cast<uint8_t const*>(src), p.hidden, p.scale_layout,
                                             static_cast<std::size_t>(slots), static_cast<std::size_t>(slot),
                                             static_cast<uint8_t*>(p.expert_scales) + e * p.scale_tensor_bytes,
                                             p.expert_token_scales ? p.expert_token_scales + at : nullptr);
      }
    }
    FERRY_TRACE_END(trace, ll_dispatch_copy);
    __syncthreads();  // shared words are reused by the next expert
  }
}

// kSend / kRecv: which halves this instance runs (both: the one-kernel leg; one: the hook's halves). kFormat: the
// dispatch_format.
template <typename IdxT, WireFormat kFormat, bool kSend, bool kRecv>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(LlDispatchParams const p) {
  static_assert(kSend || kRecv, "an LL dispatch kernel runs at least one half");
  __shared__ uint64_t s_seq[2];
  int const cta = static_cast<int>(blockIdx.x);
  // 0. this CTA's sequence numbers (its own words: no other CTA touches them, stream order carries them across calls)
  if (threadIdx.x == 0) {
    if constexpr (kSend) s_seq[0] = ++p.state->dispatch_send_seq[cta];
    if constexpr (kRecv) s_seq[1] = ++p.state->dispatch_recv_seq[cta];
  }
  __syncthreads();
  FERRY_TRACE_WARP(trace, p.trace);
  if constexpr (kSend) ll_dispatch_send<IdxT, kFormat>(p, s_seq[0] FERRY_TRACE_ARG(trace));
  if constexpr (kRecv) ll_dispatch_recv<kFormat>(p, s_seq[1] FERRY_TRACE_ARG(trace));
}

}  // namespace ferry::cuda_ll
