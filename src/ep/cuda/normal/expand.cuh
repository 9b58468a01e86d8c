// Expert-major layout of the rows the last dispatch received (local memory only: the wire carried one copy per rank),
// with the algorithm of every expert-major layout (expert_layout.cuh): the records are the received rank-major rows,
// scanned from this rank's own first row on (then wrapping around: ref::expert_layout's order), k ascending, so the
// scan's hit order is the layout's order. Every CTA of the grid (one per SM) scans every row's local expert ids, takes
// an even share of the hits, gives them their slots in order and copies the share's rows: a row loaded once per
// window and stored to each of its slots.
//
// kCopyRows: also copy the rows into expert_x and fill expert_src_row (DispatchArgs::expand); without it only
// recv_slot is written (what an expert-major combine needs after a dispatch that did not expand). With quantized
// delivery the rows are the payloads, and each slot's block scales (from the row-major recv_scales) and nvfp4 token
// scale go into the expert's scale tensor (recv_scale_layout, expert_slots rows) and token scales.
#pragma once

#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/expert_layout.cuh"
#include "ep/cuda/normal/params.cuh"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

// Warp copy of a row of `bytes` (a multiple of 8; both pointers 8-byte aligned): 16-byte vectors when the row and
// both pointers allow it (every format but nvfp4 payloads of hidden % 32 != 0).
__device__ __forceinline__ void copy_row_warp(char* dst, char const* src, std::size_t bytes, int lane) {
  if (bytes % 16 == 0 && reinterpret_cast<uintptr_t>(dst) % 16 == 0 && reinterpret_cast<uintptr_t>(src) % 16 == 0) {
    device::copy_warp_16B<true>(dst, src, bytes);
    return;
  }
  for (std::size_t i = static_cast<std::size_t>(lane) * 8; i < bytes; i += 32 * 8)
    *reinterpret_cast<uint2*>(dst + i) = *reinterpret_cast<uint2 const*>(src + i);
}

// The block scales and token scale of received row `row` into slot `slot` of expert e's tensors.
__device__ __forceinline__ void copy_slot_scales(ExpandParams const& p, int e, int slot, int row, int lane) {
  wire::FormatTraits const traits = wire::format_traits(p.format);
  int const num_scales = p.hidden / traits.block_elems;
  std::size_t const elem = static_cast<std::size_t>(traits.scale_bytes);
  auto const* src = reinterpret_cast<uint8_t const*>(p.sym_local + p.layout.normal.recv_scales) +
                    static_cast<std::size_t>(row) * num_scales * elem;
  auto* dst = static_cast<uint8_t*>(p.expert_scales) + static_cast<std::size_t>(e) * p.expert_scale_bytes;
  for (int j = lane; j < num_scales; j += 32) {
    std::size_t const to = wire::scale_offset(p.format, p.scale_layout, static_cast<std::size_t>(p.expert_slots),
                                              p.hidden, static_cast<std::size_t>(slot), static_cast<std::size_t>(j));
    if (elem == 4)
      *reinterpret_cast<uint32_t*>(dst + to) = *reinterpret_cast<uint32_t const*>(src + j * elem);
    else
      dst[to] = src[j];
  }
  if (traits.token_scale_bytes != 0 && lane == 0)
    p.expert_token_scales[static_cast<std::size_t>(e) * p.expert_slots + slot] =
        reinterpret_cast<float const*>(p.sym_local + p.layout.normal.recv_token_scales)[row];
}

// The received rows in the layout's order: scan index r is rank-major row (own_first + r) mod num_recv, this rank's
// own rows first.
struct ReceivedRows {
  int32_t const* recv_idx;  // [num_recv, topk] local expert or -1 (the dispatch, an earlier kernel, wrote them)
  int topk;
  int own_first;
  int num_recv;
};

// Scan record r: its row's local expert ids in registers, -1 past topk, loaded before any is used (every CTA reads
// every row): 16-byte loads when topk is a multiple of 4 (the rows are then 16-byte aligned), else 4-byte ones.
__device__ __forceinline__ HitRecord load_received(ReceivedRows const& rows, int r) {
  HitRecord rec;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) rec.ids[k] = -1;
  rec.r = r;
  if (r >= rows.num_recv) return rec;
  int const tail = rows.num_recv - rows.own_first;  // rows from own_first on
  rec.landing = r < tail ? rows.own_first + r : r - tail;
  int32_t const* const ids = rows.recv_idx + static_cast<std::size_t>(rec.landing) * rows.topk;
  if (rows.topk % 4 == 0) {
#pragma unroll
    for (int q = 0; q < kMaxTopk / 4; ++q) {
      if (4 * q >= rows.topk) break;
      int4 const v = device::arch::load_nc_v4(reinterpret_cast<int4 const*>(ids) + q);
      rec.ids[4 * q] = v.x;
      rec.ids[4 * q + 1] = v.y;
      rec.ids[4 * q + 2] = v.z;
      rec.ids[4 * q + 3] = v.w;
    }
  } else {
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k)
      if (k < rows.topk) rec.ids[k] = __ldg(ids + k);
  }
  count_hits(rec);
  return rec;
}

// Every rank's entries past expert_capacity, by CTA 0 of the expand that copies (it follows its dispatch, whose count
// rows are in this rank's window): the rows carry every expert's counts where an expert can drop entries
// (NormalLayout::every_expert), so every rank reads the same totals and records the same drop, and the call is an
// error on every rank (signal.cuh, record_call_drops). Nothing is counted for a refused call, nor where rows were
// dropped already (the counts include rows that never landed; that drop is the call's error).
__device__ __forceinline__ void record_slot_drops(ExpandParams const& p) {
  __shared__ unsigned long long s_over;  // entries past their expert's slots, over every expert
  __shared__ int s_first;                // the lowest rank with such an expert
  __shared__ int s_skip;
  int const tid = static_cast<int>(threadIdx.x);
  int const world = p.view.world;
  int const num_local = p.num_local_experts;
  int const parity = static_cast<int>(p.state->normal.dispatch_seq & 1);
  char* const own = p.sym_local;
  auto const count = [&](int source, int word) {
    return device::arch::load_relaxed_sys_u64(count_word(own, p.layout, parity, world, source, word));
  };
  if (tid == 0) {
    s_over = 0;
    s_first = world;
    s_skip = 0;
  }
  __syncthreads();
  if (tid < world) {  // thread d: source d refused the call, or destination d dropped rows
    int32_t rows = 0;
    for (int s = 0; s < world; ++s) rows += count_value(count(s, 1 + tid));
    if ((count(tid, 0) & kCountAbort) != 0 || rows > p.recv_capacity) atomicOr(&s_skip, 1);
  }
  __syncthreads();
  if (s_skip != 0) return;
  for (int e = tid; e < world * num_local; e += kThreads) {
    int32_t total = 0;
    for (int s = 0; s < world; ++s) total += count_value(count(s, 1 + world + e));
    if (total > p.expert_slots) {
      atomicAdd(&s_over, static_cast<unsigned long long>(total - p.expert_slots));
      atomicMin(&s_first, e / num_local);
    }
  }
  __syncthreads();
  if (tid == 0 && s_over > 0)
    device::record_call_drops(p.view, static_cast<uint32_t>(s_over < 0xffffffffull ? s_over : 0xffffffffull), s_first);
}

// kQuantized (with kCopyRows): the rows are payloads and their scales are copied too (an instance of its own, so the
// bf16 copy keeps its registers).
template <bool kCopyRows, bool kQuantized = false>
__global__ void __launch_bounds__(kThreads) expand_kernel(ExpandParams const p) {
  __shared__ ExpandShared s;
  extern __shared__ int32_t s_counts[];  // [2][num_local_experts] (expand_smem_bytes)
  int const tid = static_cast<int>(threadIdx.x);
  int const cta = static_cast<int>(blockIdx.x);
  int const topk = p.topk;
  int const slots = p.expert_slots;
  int const num_local = p.num_local_experts;
  int const num_recv = p.state->num_recv;
  // per expert: its hits before this CTA's window, and all its hits (kCopyRows); zeroed before the scan's barriers
  int32_t* const s_before = s_counts;
  int32_t* const s_total = s_counts + num_local;
  for (int i = tid; i < 2 * num_local; i += kThreads) s_counts[i] = 0;
  if (kCopyRows && cta == 0 && p.layout.normal.every_expert) record_slot_drops(p);
  ReceivedRows const rows{reinterpret_cast<int32_t const*>(p.sym_local + p.layout.normal.recv_idx), topk,
                          min(p.state->src_offset[p.view.rank], num_recv), num_recv};
  // bf16 rows: hidden * 2, the code of bf16 transport; quantized delivery: the payload (EpConfig::recv_row_bytes)
  std::size_t const row_bytes = kQuantized ? p.row_bytes : static_cast<std::size_t>(p.hidden) * 2;
  char const* const recv_x = p.sym_local + p.layout.normal.recv_x;

  // 1. each row once (first fill): its hits into each expert's total; the row's entries of no local expert get slot
  //    -1 (row r of the scan: CTA r % num_ctas)
  auto const on_record = [&](HitRecord const& rec) {
    if (rec.r >= num_recv) return;
    if constexpr (kCopyRows) {
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k)
        if (rec.ids[k] >= 0) atomicAdd(&s_total[rec.ids[k]], 1);
    }
    if (rec.r % p.num_ctas != cta) return;
    std::size_t const entry0 = static_cast<std::size_t>(rec.landing) * topk;
#pragma unroll
    for (int k = 0; k < kMaxTopk; ++k) {
      if (k >= topk) break;
      if (rec.ids[k] < 0) p.recv_slot[entry0 + k] = -1;
    }
  };
  // 2. every hit's slot (in window order): recv_slot, expert_src_row; past expert_capacity dropped
  auto const on_slot = [&](WindowHit const& hit, int slot) {
    std::size_t const entry = static_cast<std::size_t>(hit.landing) * topk + hit.k;
    if (slot < slots) {
      p.recv_slot[entry] = slot;
      if constexpr (kCopyRows) p.expert_src_row[static_cast<std::size_t>(hit.expert) * slots + slot] = hit.landing;
    } else {
      p.recv_slot[entry] = -1;  // past expert_capacity: dropped (record_slot_drops counts every rank's)
    }
  };
  // 3. the window's rows into expert_x (recv_x was written by the dispatch, an earlier kernel: non-coherent loads)
  auto const copy = [&](int n) {
    if constexpr (kCopyRows && !kQuantized) {
      if (!p.skip_rows)
        copy_window_bf16<true>(p, s, n, [&](int row) {
          return reinterpret_cast<int4 const*>(recv_x + static_cast<std::size_t>(row) * row_bytes);
        });
    } else if constexpr (kCopyRows) {
      // quantized delivery: warp per hit (the payload, then the slot's scales)
      int const lane = tid & 31;
      for (int j = tid >> 5; j < n; j += kWarps) {
        int const slot = s.slot[j];
        if (slot >= slots) continue;
        int const e = s.hit[j].expert;
        int const row = s.hit[j].landing;
        char* const dst = static_cast<char*>(p.expert_x) + (static_cast<std::size_t>(e) * slots + slot) * row_bytes;
        copy_row_warp(dst, recv_x + static_cast<std::size_t>(row) * row_bytes, row_bytes, lane);
        copy_slot_scales(p, e, slot, row, lane);
      }
    }
  };
  expand_records(
      s, s_before, num_recv, cta, p.num_ctas, [&](int r) { return load_received(rows, r); }, on_record, on_slot, copy);

  // 4. -1 past each filled expert's slots, for the experts this CTA owns (e % num_ctas == cta)
  if constexpr (kCopyRows) {
    __syncthreads();  // s_total is complete after the first fill; the barrier orders it for every thread
    for (int e = cta; e < num_local; e += p.num_ctas)
      for (int slot = min(s_total[e], slots) + tid; slot < slots; slot += kThreads)
        p.expert_src_row[static_cast<std::size_t>(e) * slots + slot] = -1;
  }
}

}  // namespace ferry::cuda_ep
