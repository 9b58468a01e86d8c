// What both halves of the low-latency dispatch (ll/dispatch.cuh) and its steps across nodes (ll/dispatch_network.cuh)
// share: the row copies and the quantized send of a chunk, and where the expansion into expert_x takes its records
// from (this rank's own tokens, the landed records).
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/expert_layout.cuh"
#include "ep/cuda/landing.cuh"
#include "ep/cuda/ll/params.cuh"
#include "trace/device_trace.cuh"
#include "wire/device_codec.cuh"
#include "wire/device_push.cuh"
#include "wire/device_scales.cuh"

namespace ferry::cuda_ll {

// Warp copy of `bytes` of a landed row (a multiple of 8; both pointers 8-byte aligned, and 16-byte aligned when bytes
// is a multiple of 16; coherent loads: peers wrote it during this kernel): 16-byte vectors where the length allows, 4
// in flight per lane (with 8 the fp8 one-kernel leg spilled, ptxas -v), else 8-byte ones (an nvfp4 payload of
// hidden % 32 == 16 elements).
__device__ __forceinline__ void copy_payload_warp(void* dst, void const* src, std::size_t bytes, int lane) {
  if (bytes % 16 == 0) {
    device::copy_16B<false, 4>(dst, src, bytes, lane, 32);
    return;
  }
  auto* d = static_cast<uint2*>(dst);
  auto const* s = static_cast<uint2 const*>(src);
  for (std::size_t i = lane; i < bytes / 8; i += 32) d[i] = s[i];
}

// The row of x (and of x_scales, x_token_scales) that token t sends (DispatchArgs::x_repeat).
__device__ __forceinline__ int x_row(LlDispatchParams const& p, int t) {
  return p.x_row(t);
}

// Entries of one token sent as tokens of their own (p.x_group > 1: topk 1, DispatchArgs::x_repeat): whether entry
// t's id repeats an earlier entry of its group, as a repeated id within a token's topk would (warp-wide, the same on
// every lane). With `report`, counted as a bad id (the caller refuses the call: its abort flag into the exchange).
template <typename IdxT>
__device__ __forceinline__ bool group_repeat(LlDispatchParams const& p, int t, int lane, bool report) {
  auto const* ids = static_cast<IdxT const*>(p.topk_idx);
  int const first = x_row(p, t) * p.x_group;
  int64_t const id = static_cast<int64_t>(ids[t]);
  bool same = false;
  for (int j = first + lane; j < t; j += 32) same |= static_cast<int64_t>(ids[j]) == id;
  bool const repeat = id >= 0 && id < p.num_experts && __any_sync(0xffffffffu, same);
  if (report && repeat && lane == 0) device::record_bad_expert_id(p.view, id);
  return repeat;
}

// A quantized dispatch_format's send of chunk `chunk` of `chunks` of token t (device_push.cuh): quantized once from
// x (or forwarded from pre-quantized input), its pieces stored straight into the wire row at row_at(d) (a char*: the
// landing slot of destination d, or across nodes the staged row) for every destination d of `mask` (the send set: 32
// bits on one node, 64 across nodes, where bit kStagedRow is the staged row; a narrower parameter would drop it).
template <WireFormat kFormat, int kUnitElems, typename RowAt, typename Set>
__device__ __forceinline__ void send_quantized_chunk(LlDispatchParams const& p, int t, int chunk, int chunks, Set mask,
                                                     RowAt row_at, float token_scale, int lane) {
  using Codec = device::UnitCodec<kFormat, kUnitElems>;
  WireRowLayout const wl = wire::make_row_layout(kFormat, p.hidden);
  device::QuantRowInput const in = device::quant_row_input<kFormat, kUnitElems>(p.x, p.x_scales, p.hidden, x_row(p, t));
  device::push_quantized_chunk<kFormat, kUnitElems, kUnroll / Codec::kVecs>(
      in, p.hidden, chunk, chunks, mask, token_scale,
      [&](int d) {
        char* const row = row_at(d);
        return device::QuantRowPlaces{row, row + wl.scales_offset,
                                      reinterpret_cast<float*>(row + wl.token_scale_offset)};
      },
      lane);
}

// nvfp4: the token scale of the row that chunk `chunk` of `chunks` belongs to (device_push.cuh). Every thread of the
// CTA calls it once per step of the send loop (a barrier); `valid`: this warp has an item this step.
template <int kUnitElems>
__device__ __forceinline__ float nvfp4_chunk_token_scale(LlDispatchParams const& p, device::CtaRowMax<kWarps>& s_amax,
                                                         int step, int t, int chunk, int chunks, bool valid) {
  return device::cta_chunk_token_scale<kUnitElems>(p.x, p.x_scales != nullptr ? p.x_token_scales : nullptr, p.hidden,
                                                   x_row(p, t), s_amax, step, chunk, chunks, valid);
}

// ---- the expansion into expert_x, shared by the send half (this rank's own rows, bf16) and the receive half ----

// The layout's algorithm (expert_layout.cuh, shared with normal mode's expand); the records here are the landed ones
// (load_landed) and this rank's own tokens (load_own).
using cuda_ep::copy_window_bf16;
using cuda_ep::count_hits;
using cuda_ep::cta_share;
using cuda_ep::expand_records;
using cuda_ep::expand_smem_bytes;
using cuda_ep::ExpandShared;
using cuda_ep::HitRecord;
using cuda_ep::run_windows;
using cuda_ep::scan_records;
using cuda_ep::ScanTotals;
using cuda_ep::Share;
using cuda_ep::WindowHit;

// Own rows of a bf16 dispatch with own_direct (LlDispatchParams) skip the landing zone: the send half copies them
// from x straight into their slots. Otherwise (the default, and every quantized dispatch_format) they are staged in
// the landing zone like a peer's and the receive half delivers every row.
template <WireFormat kFormat>
__device__ __forceinline__ bool own_direct(LlDispatchParams const& p) {
  return kFormat == WireFormat::bf16 && p.own_direct;
}

// Landed record r of this call (receive half), in (source, token) order. Its source: the last s with
// s_base[s] <= r, walked on one node (at most 32 sources), halved across nodes (up to kMaxWorld).
template <bool kNet>
__device__ __forceinline__ HitRecord load_landed(LlDispatchParams const& p, int32_t const* s_base, int parity, int r,
                                                 int num_landed) {
  HitRecord rec;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) rec.ids[k] = -1;
  rec.r = r;
  if (r >= num_landed) return rec;
  int source = 0;
  if constexpr (kNet) {
    int hi = p.view.world - 1;  // s_base[world] > r: the source is in [source, hi]
    while (source < hi) {
      int const mid = (source + hi + 1) / 2;
      if (s_base[mid] <= r)
        source = mid;
      else
        hi = mid - 1;
    }
  } else {
    while (s_base[source + 1] <= r) ++source;
  }
  int const token = r - s_base[source];
  rec.landing = source * p.max_tokens + token;
  rec.record = reinterpret_cast<int32_t const*>(own_window<kNet>(p) + p.layout.ll.dispatch_meta +
                                                landing::slot_index(parity, p.view.world, source, p.max_tokens, token) *
                                                    p.layout.ll.meta_bytes);
  // 16-byte loads, all issued before any id is used (4-byte ones made the scan bound by L2 requests)
  landing::load_record_ids(rec.record, p.topk, rec.ids);
  count_hits(rec);
  return rec;
}

// This rank's token t (send half): the ids of its experts on this rank, from the caller's topk_idx (a bad id is no
// local expert; the send loop reports it).
template <typename IdxT>
__device__ __forceinline__ HitRecord load_own(LlDispatchParams const& p, int t) {
  HitRecord rec;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) rec.ids[k] = -1;
  rec.r = t;
  rec.landing = t;
  if (t >= p.num_tokens) return rec;
  auto const* idx = static_cast<IdxT const*>(p.topk_idx) + static_cast<std::size_t>(t) * p.topk;
  int64_t const lo = static_cast<int64_t>(p.view.rank) * p.num_local_experts;
  int64_t e[kMaxTopk];
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) e[k] = k < p.topk ? static_cast<int64_t>(__ldg(idx + k)) : -1;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k)
    rec.ids[k] = e[k] >= lo && e[k] < lo + p.num_local_experts ? static_cast<int32_t>(e[k] - lo) : -1;
  count_hits(rec);
  return rec;
}

// Send half, bf16: this rank's own hits into expert_x straight from x, spread evenly over the grid. Own rows take the
// first slots of every expert (ref::expert_layout's order), so this needs no peer's routing; the receive half writes
// their metadata (it knows their rank-major rows).
template <typename IdxT>
__device__ __forceinline__ void expand_own(LlDispatchParams const& p, ExpandShared& s, int32_t* s_before) {
  auto const* x = static_cast<int4 const*>(p.x);
  std::size_t const row_vecs = static_cast<std::size_t>(p.hidden) / 8;
  // each hit's slot for the receive half's metadata (own_slot: -1 past expert_capacity, dropped and counted here)
  auto const on_slot = [&](WindowHit const& hit, int slot) {
    p.own_slot[static_cast<std::size_t>(hit.landing) * p.topk + hit.k] = slot < p.expert_slots ? slot : -1;
    if (slot >= p.expert_slots) device::record_input_error(p.view, slot, true);
  };
  expand_records(
      s, s_before, p.num_tokens, static_cast<int>(blockIdx.x), p.num_ctas, [&](int t) { return load_own<IdxT>(p, t); },
      [](HitRecord const&) {}, on_slot,
      [&](int n) { copy_window_bf16<true>(p, s, n, [&](int t) { return x + x_row(p, t) * row_vecs; }); });
}

}  // namespace ferry::cuda_ll
