// Low-latency dispatch over NVLink: one kernel (or, with the hook, its send half and its receive half apart).
//
// Expert-major order (ref::expert_layout): an expert's slots take the rank-major rows from this rank's own first row
// on (own tokens, then sources rank + 1, ..., then 0, ..., rank - 1), k ascending. Own rows first is what lets a bf16
// dispatch copy them into their slots while the peers' rows are still on the wire: their slots depend on no peer.
//
// Send half (every CTA, warp per (token, chunk of its row), no step waits for another CTA):
//  1. the token's destination ranks from its topk ids (a bad or repeated id is counted and makes this rank refuse the
//     call: its abort word goes to every rank with its arrival, ll/params.cuh);
//  2. its metadata record (local expert ids for that rank, weights) to EVERY rank, so each receiver knows the full
//     routing of the source without a count exchange; the row itself only to the peers that hold one of its experts
//     (wire de-duplication), at landing slot (source, token) of the destination's current parity. A batch with fewer
//     tokens than the grid has warps splits each row over several warps. A quantized dispatch_format sends the
//     token's wire row to every destination, this rank included: each chunk (whole scale blocks; a row's chunks in
//     one CTA) quantized once in registers (or forwarded from pre-quantized input) and its payload and scales stored
//     into every destination (device_push.cuh); nvfp4's token scale is the max of the chunks' amaxes, met in shared
//     memory;
//  2b. bf16 (expand_own): this rank's own hits (entries (token, k) of its experts) copied from x into their slots,
//     spread evenly over the grid (as in 6), their slots kept in own_slot for the receive half's metadata;
//  3. per CTA: barrier, then +1 on every destination's arrival counter of this source (release, cumulative).
// Receive half (every CTA; the work is the hits, spread evenly over the grid):
//  4. wait until every source's arrivals reach seq * num_ctas (acquire; bounded);
//  5. scan the landed records in (source, token) order with a CTA scan, in every CTA: a row is present when one of
//     its ids is local; its rank-major index is the count of present rows before it; its hits are numbered in the
//     expert-major order above. CTA c takes the hits [c H / C, (c + 1) H / C) of the H to copy here (bf16: the
//     peers'; quantized: all): per expert, the hits before its share (shared-memory counters) give the share's first
//     slots, and within the share an entry of expert e gets the next slot of e (one warp, in order): exactly
//     ref::expert_layout, no global atomics. The rank-major metadata of the rows is written in the same scan, each
//     record by one CTA (spread over the grid; an own bf16 row's slots come from own_slot);
//  6. copy the share's rows from the landing zone into expert_x: each landed row loaded once and stored to each of
//     its hits' slots (the wire carried one copy per rank; the expert-major duplicates are made locally). A quantized
//     dispatch_format copies the payload and writes the block scales into the expert's scale tensor (and nvfp4's
//     token scale), or dequantizes the row into bf16 (dispatch_dequantize), in the same copy. A bf16 row is split
//     over warps when a share has fewer rows than warps.
// Why the hits and not the experts are spread over the grid (one CTA per expert before): the CTA of the busiest
// expert (about twice the mean rows with random routing) set the leg's length (docs/perf.md, session 10).
// Steps 2b, 5 and 6 run the expert-major layout's one algorithm (expert_layout.cuh, normal mode's expand runs it too);
// this file says where their records come from (load_own, load_landed) and what each slot writes.
#pragma once

#include <cstdint>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/expert_layout.cuh"
#include "ep/cuda/landing.cuh"
#include "ep/cuda/ll/params.cuh"
#include "wire/device_codec.cuh"
#include "wire/device_push.cuh"
#include "wire/device_scales.cuh"
#include "trace/device_trace.cuh"

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

// A quantized dispatch_format's send of chunk `chunk` of `chunks` of token t (device_push.cuh): quantized once from
// x (or forwarded from pre-quantized input), its pieces stored straight into the wire row at row_at(d) (a char*: the
// landing slot of destination d, or across nodes the staged row) for every destination d of `mask` (the send set: 32
// bits on one node, 64 across nodes, where bit kStaged is the staged row; a narrower parameter would drop it).
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
  rec.record = reinterpret_cast<int32_t const*>(own_window<kNet>(p) + p.layout.dispatch_meta +
                                                landing::slot_index(parity, p.view.world, source, p.max_tokens, token) *
                                                    p.layout.meta_bytes);
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

// Across nodes, after the send loop (every thread of the CTA, past the barrier that ends it): what this CTA has for
// the ranks of other nodes, staged in this rank's window by the loop, put from there, then its arrival there. Warp w
// takes the ranks j = w, w + kWarps, ... of the other nodes, each over every item of the CTA (the loop's items, in
// its order): a record per token (every rank gets every record), the row whole with its chunk 0 when the rank holds
// one of the token's experts (across nodes a row's chunks are in one CTA, in every format), the token count (CTA 0)
// and the abort word (a refusing CTA). One endpoint carries all of it to that rank, so its signal (+1 per CTA and
// call, as over NVLink) covers it. The staging areas alternate by parity, and a source reuses one at call n + 2 only
// after its receive of n + 1, which waited for every rank's send of n + 1, each after that rank's receive of n, which
// waited for this rank's puts of n: so no put of n still reads the area then. kMasking: a masked rank gets nothing
// (no record, row, count, abort word or arrival), as on this node.
template <typename IdxT, WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_dispatch_send_network(LlDispatchParams const& p, Net const& network, int parity,
                                                         uint64_t seq, bool refused, int chunks, int items) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const total_warps = p.num_ctas * kWarps;
  std::size_t const wire = p.layout.dispatch_row_bytes;
  std::size_t const record = p.layout.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  auto const* topk_idx = static_cast<IdxT const*>(p.topk_idx);
  uint32_t const live = live_ranks<kMasking>(p);
  auto ep = network.open(transport::Warp{}, cta * kWarps + warp);
  for (int j = warp; j < world - p.local; j += kWarps) {
    int const d = remote_rank(p, j);
    if (!is_live<kMasking>(live, d)) continue;
    int64_t const lo = static_cast<int64_t>(d) * p.num_local_experts;
    for (int base = cta * kWarps; base < items; base += total_warps) {
      for (int w = 0; w < kWarps && base + w < items; ++w) {
        int const item = base + w;
        int const t = item / chunks;
        int const chunk = item % chunks;
        std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);
        int64_t const e =
            lane < p.topk ? static_cast<int64_t>(__ldg(topk_idx + static_cast<std::size_t>(t) * p.topk + lane)) : -1;
        if (__any_sync(0xffffffffu, e >= lo && e < lo + p.num_local_experts)) {
          std::size_t const from = p.layout.ll_send_rows + (parity * max_tokens + t) * wire;
          std::size_t const to = p.layout.dispatch_rows + slot * wire;
          if (chunk == 0) ep.put(d, to, from, wire);
        }
        if (chunk == 0)
          ep.put(d, p.layout.dispatch_meta + slot * record,
                 p.layout.ll_send_meta + ((parity * static_cast<std::size_t>(world) + d) * max_tokens + t) * record,
                 record);
      }
    }
    std::size_t const word = (static_cast<std::size_t>(parity) * world + rank) * sizeof(uint64_t);
    if (cta == 0) ep.put_value(d, p.layout.dispatch_tokens + word, static_cast<uint64_t>(p.num_tokens));
    if (refused) ep.put_value(d, p.layout.dispatch_abort + word, seq);
    ep.signal(d, p.layout.dispatch_arrivals + static_cast<std::size_t>(rank) * sizeof(uint64_t), 1);
  }
  ep.close();
}

// A token's record with its global expert ids (-1: masked or bad) and weights, for the rails of the forward route
// (warp-wide; e and w as token_destination left them, lane k < topk holding entry k).
__device__ __forceinline__ void write_global_record(char* at, int topk, int64_t e, float w, int lane) {
  int const k = (lane < topk ? lane : lane - topk) & 31;
  int const e_k = static_cast<int>(__shfl_sync(0xffffffffu, static_cast<long long>(e), k));
  float const w_k = __shfl_sync(0xffffffffu, w, k);
  if (lane < topk)
    reinterpret_cast<int32_t*>(at)[lane] = e_k;
  else if (lane < 2 * topk)
    reinterpret_cast<float*>(at)[lane] = w_k;
}

// The forward route's network leg of a send half (ll_dispatch_send_network's scheme, per node instead of per rank):
// warp w takes the nodes j = w, w + kWarps, ... other than this rank's; to that node's rail (the rank of this rank's
// local index there) it puts the CTA's records of global ids (every token: the rail places a record on every rank of
// its node) and the rows of the tokens that node holds (once per node), into the rail's forward area at this node's
// place, then the token count and the abort word, then +1 on the rail's counter of this node.
template <typename IdxT, WireFormat kFormat, class Net>
__device__ __forceinline__ void ll_dispatch_send_forward(LlDispatchParams const& p, Net const& network, int parity,
                                                         uint64_t seq, bool refused, int chunks, int items) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const total_warps = p.num_ctas * kWarps;
  int const own_node = rank / p.local;
  std::size_t const wire = p.layout.dispatch_row_bytes;
  std::size_t const record = p.layout.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  std::size_t const place = (static_cast<std::size_t>(parity) * p.nodes + own_node) * max_tokens;  // at the rail
  auto const* topk_idx = static_cast<IdxT const*>(p.topk_idx);
  auto ep = network.open(transport::Warp{}, cta * kWarps + warp);
  for (int j = warp; j < p.nodes - 1; j += kWarps) {
    int const n = j < own_node ? j : j + 1;
    int const rail = n * p.local + rank % p.local;
    int64_t const lo = static_cast<int64_t>(n) * p.local * p.num_local_experts;
    int64_t const hi = lo + static_cast<int64_t>(p.local) * p.num_local_experts;
    for (int base = cta * kWarps; base < items; base += total_warps) {
      for (int w = 0; w < kWarps && base + w < items; ++w) {
        int const item = base + w;
        int const t = item / chunks;
        int const chunk = item % chunks;
        int64_t const e =
            lane < p.topk ? static_cast<int64_t>(__ldg(topk_idx + static_cast<std::size_t>(t) * p.topk + lane)) : -1;
        if (__any_sync(0xffffffffu, e >= lo && e < hi)) {
          std::size_t const from = p.layout.ll_send_rows + (parity * max_tokens + t) * wire;
          std::size_t const to = p.layout.ll_fwd_rows + (place + t) * wire;
          if (chunk == 0) ep.put(rail, to, from, wire);
        }
        if (chunk == 0)
          ep.put(rail, p.layout.ll_fwd_meta + (place + t) * record,
                 p.layout.ll_send_meta + ((parity * static_cast<std::size_t>(world) + rank) * max_tokens + t) * record,
                 record);
      }
    }
    std::size_t const word = (static_cast<std::size_t>(parity) * p.nodes + own_node) * sizeof(uint64_t);
    if (cta == 0) ep.put_value(rail, p.layout.ll_fwd_tokens + word, static_cast<uint64_t>(p.num_tokens));
    if (refused) ep.put_value(rail, p.layout.ll_fwd_abort + word, seq);
    ep.signal(rail, p.layout.ll_fwd_arrivals + static_cast<std::size_t>(own_node) * sizeof(uint64_t), 1);
  }
  ep.close();
}

// The rail's part of the forward route, at the start of a receive half (every thread of the CTA): for every other
// node m, once its source (the rank of this rank's local index there) has arrived through the network, the CTA's
// share of that source's tokens (token t: global warp t % (num_ctas * kWarps)) placed on every rank of this node as
// the source would have stored them on one node: its record (local ids) into each rank's landing slot (source, t),
// its row into the slots of the ranks holding it; then (CTA 0) the source's token count and abort word on every rank
// of the node, and +1 on each rank's arrival counter of that source (release, after the barrier): num_ctas per call,
// as a source of the node adds. Which ranks hold each token is kept for the combine (fwd_mask, fwd_num). Returns false
// (for the whole CTA) when a source did not arrive (the timeout is recorded).
template <class Net>
__device__ __forceinline__ bool ll_dispatch_forward(LlDispatchParams const& p, Net const& network, int parity,
                                                    uint64_t seq) {
  __shared__ int s_fwd_ok;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const own_node = rank / p.local;
  int const first = own_node * p.local;  // this node's first rank
  int const topk = p.topk;
  std::size_t const wire = p.layout.dispatch_row_bytes;
  std::size_t const record = p.layout.meta_bytes;
  std::size_t const max_tokens = static_cast<std::size_t>(p.max_tokens);
  if (tid == 0) s_fwd_ok = 1;
  __syncthreads();
  if (tid < p.nodes && tid != own_node &&
      !wait_network(p, network, p.layout.ll_fwd_arrivals, tid, seq * static_cast<uint64_t>(p.num_ctas),
                    WaitPhase::ll_dispatch))
    s_fwd_ok = 0;
  __syncthreads();
  if (!s_fwd_ok) return false;
  int const total_warps = p.num_ctas * kWarps;
  for (int m = 0; m < p.nodes; ++m) {
    if (m == own_node) continue;
    int const source = m * p.local + rank % p.local;
    std::size_t const place = (static_cast<std::size_t>(parity) * p.nodes + m) * max_tokens;
    int const n = static_cast<int>(reinterpret_cast<uint64_t const volatile*>(
        p.net.local() + p.layout.ll_fwd_tokens)[static_cast<std::size_t>(parity) * p.nodes + m]);
    for (int t = cta * kWarps + warp; t < n; t += total_warps) {
      // the record: lane k < topk its global id k, lane topk + k its weight k
      char const* const rec = p.net.local() + p.layout.ll_fwd_meta + (place + t) * record;
      int const k = (lane < topk ? lane : lane - topk) & 31;
      int64_t const e = lane < 2 * topk ? static_cast<int64_t>(reinterpret_cast<int32_t const volatile*>(rec)[k]) : -1;
      float const w = lane < 2 * topk ? reinterpret_cast<float const volatile*>(rec)[topk + k] : 0.0f;
      bool const valid = lane < topk && e >= 0 && e < p.num_experts;
      int const dest = valid ? static_cast<int>(e / p.num_local_experts) : -1;
      uint32_t const here = __reduce_or_sync(
          0xffffffffu, dest >= first && dest < first + p.local ? 1u << (dest - first) : 0u);  // local ranks holding t
      std::size_t const slot = landing::slot_index(parity, world, source, p.max_tokens, t);
      // records on every rank of the node
      landing::write_records_where(
          first, first + p.local, topk, p.num_local_experts, dest, e, w, lane, [](int) { return true; },
          [&](int d) { return p.net.window(d - first) + p.layout.dispatch_meta + slot * record; });
      // the row into each holding rank's slot: loaded once, stored to each
      // (wire rows are 16-byte multiples; coherent loads: the network wrote the row during this kernel)
      auto const* src = reinterpret_cast<int4 const*>(p.net.local() + p.layout.ll_fwd_rows + (place + t) * wire);
      for (std::size_t i = lane; i < wire / 16; i += 32) {
        int4 const v = device::arch::load_v4(src + i);
        for (uint32_t h = here; h != 0; h &= h - 1)
          device::arch::store_na_v4(
              reinterpret_cast<int4*>(p.net.window(__ffs(h) - 1) + p.layout.dispatch_rows + slot * wire) + i, v);
      }
      if (lane == 0) p.fwd_mask[static_cast<std::size_t>(m) * max_tokens + t] = here;
    }
    if (cta == 0 && tid < p.local) {  // thread l: this node's l-th rank
      std::size_t const word = static_cast<std::size_t>(parity) * world + source;
      reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.dispatch_tokens)[word] =
          static_cast<uint64_t>(n);
      if (reinterpret_cast<uint64_t const volatile*>(
              p.net.local() + p.layout.ll_fwd_abort)[static_cast<std::size_t>(parity) * p.nodes + m] == seq)
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.dispatch_abort)[word] = seq;
    }
    if (cta == 0 && tid == 0) p.fwd_num[m] = n;
  }
  // the arrivals: the barrier orders every thread's stores before the release adds (cumulative over them)
  __syncthreads();
  if (tid < p.local)
    for (int m = 0; m < p.nodes; ++m)
      if (m != own_node)
        p.net.add_signal(tid, p.layout.dispatch_arrivals + static_cast<std::size_t>(m * p.local + rank % p.local) * 8,
                         1);
  return true;
}

// Rank masking, a token's entry on lane k < topk (warp-wide; dest and e as token_destination left them): an entry
// whose expert's rank is masked goes nowhere, as an id of -1 (ref::without_ranks). With `first` (the token's chunk
// 0) its entries are counted and their ranks kept for the combine's count (LlMaskWords::entry_rank).
__device__ __forceinline__ int mask_destination(LlDispatchParams const& p, uint32_t live, int t, bool first, int lane,
                                                int dest, int64_t& e) {
  bool const gone = dest >= 0 && ((live >> dest) & 1u) == 0;
  if (first) {
    if (lane < p.topk)
      p.state->ll_mask.entry_rank[static_cast<std::size_t>(t) * p.topk + lane] = static_cast<int8_t>(dest);
    unsigned const n = __popc(__ballot_sync(0xffffffffu, gone));
    if (lane == 0 && n != 0) count_masked_entries(p, detail::LlMaskLeg::dispatch, n);
  }
  if (!gone) return dest;
  e = -1;
  return -1;
}

template <typename IdxT, WireFormat kFormat, int kUnitElems, bool kMasking, class Net>
__device__ __forceinline__ void ll_dispatch_send(LlDispatchParams const& p, Net const& network, ExpandShared& s,
                                                 int32_t* s_counts, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  constexpr bool kNet = kAcrossNodes<Net>;
  static_assert(sizeof(IdxT) == 4 || sizeof(IdxT) == 8, "topk_idx is int32 or int64");
  static_assert((kFormat == WireFormat::bf16) == (kUnitElems == 0), "bf16 rows are copied; quantized rows need a unit");
  // a row's destinations: world ranks on one node; across nodes this node's ranks by local index and the staged row
  using Send = std::conditional_t<kNet, uint64_t, uint32_t>;
  constexpr int kStaged = 32;
  __shared__ device::CtaRowMax<kWarps> s_amax;  // nvfp4: the chunks' amaxes of a step (nvfp4_chunk_token_scale)
  __shared__ int s_refuse;                      // this CTA saw a bad or repeated id, or the host refuses the call
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const num_local = p.num_local_experts;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  int const num_vec = p.hidden / 8;
  int const total_warps = p.num_ctas * kWarps;
  landing::Routing const routing{p.view, p.topk_idx, p.topk_weights, topk, p.num_experts, num_local};

  // 1. this call's token count to every destination (covered by CTA 0's arrival below)
  FERRY_TRACE_BEGIN(trace, ll_dispatch_send);
  //    (across nodes to this node's ranks, thread l to its l-th; the network leg puts it to the others)
  uint32_t const live = live_ranks<kMasking>(p);  // rank masking: nothing to a masked rank
  int const first = kNet ? node_first(p) : 0;     // across nodes: this node's first rank
  if constexpr (kNet) {
    if (cta == 0 && tid < p.local && is_live<kMasking>(live, first + tid))
      reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.dispatch_tokens)[parity * world + rank] =
          static_cast<uint64_t>(p.num_tokens);
  } else if (cta == 0 && tid < world && ((live >> tid) & 1u) != 0) {
    auto* word =
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.dispatch_tokens) + parity * world + rank;
    *word = static_cast<uint64_t>(p.num_tokens);
  }
  if (cta == 0 && tid == 0) p.state->num_tokens = p.num_tokens;
  if (tid == 0) s_refuse = p.abort;  // the send loop's barriers (or the one before the arrival) order it
  if (own_direct<kFormat>(p))        // the own expansion's counters (the send loop's barriers order this)
    for (int i = tid; i < num_local; i += kThreads) s_counts[i] = 0;

  // 2. items (token, chunk): a batch with fewer tokens than the grid has warps splits each row into chunks so that
  //    every warp has bytes in flight (a warp walking a whole row waits for ~7 round trips in a row, and a quantized
  //    row's conversions run on its 32 lanes alone). A quantized row's chunks are whole scale groups, a power of two
  //    of them in one CTA (nvfp4's token scale). Chunk 0 reports bad ids and writes the token's mask and metadata.
  //    Every warp of a CTA runs the same steps (nvfp4's barrier); a warp past the items only joins the barrier.
  //    Across nodes a bf16 row's chunks are in one CTA too, so that the network leg puts each row whole: one message
  //    per row and remote rank (or rail), not one per chunk (a NIC's message rate is what small puts run into).
  int chunks = 1;
  if constexpr (kFormat == WireFormat::bf16 && !kNet)
    chunks = device::chunks_per_row(p.num_tokens, total_warps, num_vec);
  else if constexpr (kFormat == WireFormat::bf16)
    chunks = device::cta_chunks_per_row(p.num_tokens, total_warps, (num_vec + 31) / 32, kWarps);
  else
    chunks = device::cta_chunks_per_row(p.num_tokens, total_warps, device::scale_groups<kFormat, kUnitElems>(p.hidden),
                                        kWarps);
  int const items = p.num_tokens * chunks;
  for (int base = cta * kWarps, step = 0; base < items; base += total_warps, ++step) {
    int const item = base + warp;
    int const t = item / chunks;
    int const chunk = item % chunks;
    float token_scale = 0.0f;
    if constexpr (kFormat == WireFormat::nvfp4)
      token_scale = nvfp4_chunk_token_scale<kUnitElems>(p, s_amax, step, t, chunk, chunks, item < items);
    if (item >= items) continue;
    int64_t e;
    float w;
    bool refused;
    int dest = landing::token_destination<IdxT>(routing, t, lane, chunk == 0, e, w, refused);
    if constexpr (kMasking) dest = mask_destination(p, live, t, chunk == 0, lane, dest, e);
    // One node: the destination ranks (a word). Across nodes (ll/params.cuh "Wider worlds") the ranks of this node by
    // local index, and bit kStaged for the ranks of other nodes: they get the token through this rank's window, each
    // one's record staged, the row staged once; the network leg puts them after the loop.
    Send const send = [&]() -> Send {
      if constexpr (kNet) {
        bool const near = dest >= first && dest < first + p.local;
        Send const here = __reduce_or_sync(0xffffffffu, near ? 1u << (dest - first) : 0u);
        return __any_sync(0xffffffffu, dest >= 0 && !near) ? here | Send{1} << kStaged : here;
      } else {
        return __reduce_or_sync(0xffffffffu, dest >= 0 ? 1u << dest : 0u);
      }
    }();
    std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);
    if (refused) s_refuse = 1;  // any lane: every writer writes 1
    std::size_t const staged = (static_cast<std::size_t>(parity) * p.max_tokens + t);
    auto const row_at = [&](int d) -> char* {
      if constexpr (kNet)
        if (d == kStaged) return p.net.local() + p.layout.ll_send_rows + staged * p.layout.dispatch_row_bytes;
      return p.net.window(d) + p.layout.dispatch_rows + slot * p.layout.dispatch_row_bytes;
    };

    if (chunk == 0) {
      if constexpr (kNet) {
        // the token's destinations for the combine, a word at a time
        int const words = ferry::detail::rank_words(world);
        for (int i = 0; i < words; ++i) {
          uint32_t const word = __reduce_or_sync(0xffffffffu, dest >= 0 && dest / 32 == i ? 1u << (dest % 32) : 0u);
          if (lane == 0) p.token_mask[static_cast<std::size_t>(t) * words + i] = word;
        }
        auto const staged_record = [&](int d) {
          return p.net.local() + p.layout.ll_send_meta +
                 ((static_cast<std::size_t>(parity) * world + d) * p.max_tokens + t) * p.layout.meta_bytes;
        };
        // this node's ranks their records; the direct route stages every other rank's (the forward route puts none)
        bool const direct = kMasking || !p.forward;
        landing::write_records_where(
            direct ? 0 : first, direct ? world : first + p.local, topk, num_local, dest, e, w, lane,
            [&](int d) { return is_live<kMasking>(live, d); },
            [&](int d) -> char* {
              if (d < first || d >= first + p.local) return staged_record(d);
              return p.net.window(d - first) + p.layout.dispatch_meta + slot * p.layout.meta_bytes;
            });
        // the forward route: one record of global ids for every rail, staged in this rank's own slot
        if (!direct) write_global_record(staged_record(rank), topk, e, w, lane);
      } else {
        if (lane == 0) p.token_mask[t] = send;
        landing::write_records(p.net, world, p.layout.dispatch_meta, slot, p.layout.meta_bytes, topk, num_local, dest,
                               e, w, lane, live);
      }
    }

    // the row (this chunk of it), once per destination rank (with own_direct not to this rank: expand_own)
    if constexpr (kFormat != WireFormat::bf16) {
      if (send != 0) send_quantized_chunk<kFormat, kUnitElems>(p, t, chunk, chunks, send, row_at, token_scale, lane);
    } else if (Send const to = own_direct<kFormat>(p) ? send & ~(Send{1} << (kNet ? p.net.rank : rank)) : send;
               to != 0) {
      auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
      landing::send_row_chunk<kUnroll>(
          reinterpret_cast<int4 const*>(static_cast<char const*>(p.x) +
                                        static_cast<std::size_t>(x_row(p, t)) * row_bytes),
          v_begin, v_end, to, [&](int d) { return reinterpret_cast<int4*>(row_at(d)); }, lane);
    }
  }
  FERRY_TRACE_END(trace, ll_dispatch_send);

  // 2b. own_direct: this rank's own rows into their slots while the peers' rows are on the wire (before the arrival:
  //     its release would hold the CTA until the NVLink stores complete)
  if constexpr (kFormat == WireFormat::bf16) {
    if (p.own_direct) {
      FERRY_TRACE_BEGIN(trace, ll_dispatch_own);
      __syncthreads();  // the counters above
      expand_own<IdxT>(p, s, s_counts);
      FERRY_TRACE_END(trace, ll_dispatch_own);
    }
  }

  // 3. arrival: the barrier orders every thread's stores before the release adds, which are cumulative over them
  //    (one release per destination; no per-thread fence, which would drain each thread's NVLink stores)
  FERRY_TRACE_BEGIN(trace, ll_dispatch_send_arrival);
  __syncthreads();
  if constexpr (kNet) {
    // this node's ranks, thread l its l-th (the abort word first: the same thread's release add publishes it)
    if (tid < p.local && is_live<kMasking>(live, first + tid)) {
      if (s_refuse)
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.dispatch_abort)[parity * world + rank] = seq;
      p.net.add_signal(tid, p.layout.dispatch_arrivals + rank * sizeof(uint64_t), 1);
    }
  } else {
    if (s_refuse) landing::publish_abort<!kMasking>(p.net, p.layout.dispatch_abort, parity, world, rank, seq, live);
    if (tid < world && ((live >> tid) & 1u) != 0)
      p.net.add_signal(tid, p.layout.dispatch_arrivals + rank * sizeof(uint64_t), 1);
  }
  if constexpr (kNet && kMasking) {
    // rank masking across nodes runs the direct route (the backend refuses the forward one)
    ll_dispatch_send_network<IdxT, kFormat, true>(p, network, parity, seq, s_refuse != 0, chunks, items);
  } else if constexpr (kNet) {
    if (p.forward)
      ll_dispatch_send_forward<IdxT, kFormat>(p, network, parity, seq, s_refuse != 0, chunks, items);
    else
      ll_dispatch_send_network<IdxT, kFormat, false>(p, network, parity, seq, s_refuse != 0, chunks, items);
  }
  FERRY_TRACE_END(trace, ll_dispatch_send_arrival);
}

// The sources of other nodes of a receive half: their arrivals are waited for through the network. kMasking: a
// masked source (of any node) is not waited for and lands nothing.
template <class Net, bool kMasking = false>
struct NetworkSources {
  LlParams const& p;
  Net const& network;
  std::size_t counters;
  WaitPhase phase;
  uint32_t live;  // kMasking: the ranks still in the calls
  __device__ __forceinline__ bool of(int s) const { return !same_node(p, s); }
  __device__ __forceinline__ bool wait(int s, uint64_t least) const {
    return wait_network(p, network, counters, s, least, phase);
  }
  __device__ __forceinline__ bool skip(int s) const {
    if constexpr (kMasking)
      return ((live >> s) & 1u) == 0;
    else
      return false;
  }
};

template <WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_dispatch_recv(LlDispatchParams const& p, Net const& network, ExpandShared& s,
                                                 int32_t* s_counts, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  constexpr bool kNet = kAcrossNodes<Net>;
  constexpr int kSources = kMaxSources<kNet>;
  __shared__ int32_t s_base[kSources + 1];  // first rank-major landing row of each source
  __shared__ int s_ok;
  __shared__ uint32_t s_aborted[kSources / 32];  // sources that refused this call, a bit each

  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const cta = static_cast<int>(blockIdx.x);
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const num_local = p.num_local_experts;
  int const slots = p.expert_slots;
  std::size_t const wire_bytes = p.layout.dispatch_row_bytes;
  std::size_t const row_bytes = p.expert_row_bytes;
  int32_t* const s_before = s_counts;
  int32_t* const s_total = s_counts + num_local;
  for (int i = tid; i < 2 * num_local; i += kThreads) s_counts[i] = 0;  // ordered by the wait's barriers
  if (tid == 0) {
    s.marks[0] = 0;
    s.marks[1] = -1;
  }

  // 4. every source's send CTAs of this call (thread s waits for source s; acquire, bounded). The forward route:
  //    first this rank's part as a rail, after which every source of another node arrives as one of this node
  FERRY_TRACE_BEGIN(trace, ll_dispatch_wait_arrivals);
  if constexpr (kAcrossNodes<Net> && !kMasking)
    if (p.forward && !ll_dispatch_forward(p, network, parity, seq)) return;
  if (tid == 0) {
    s_ok = 1;
    if constexpr (!kNet) s_aborted[0] = 0;
  }
  if constexpr (kNet)
    if (tid < kSources / 32) s_aborted[tid] = 0;
  __syncthreads();
  wait_stats::Slot* const stats = wait_stats::row(p.wait_stats, wait_stats::kDispatch, world);
  auto const window = [&] { return own_window<kNet>(p); };  // read where used (a register held across the wait costs)
  auto const wait = [&](auto const& remote) {
    return landing::wait_sources<std::decay_t<decltype(remote)>, kSources>(
        p.view, reinterpret_cast<uint64_t const*>(window() + p.layout.dispatch_arrivals), seq,
        static_cast<uint64_t>(p.num_ctas),
        reinterpret_cast<uint64_t const volatile*>(window() + p.layout.dispatch_tokens) + parity * world,
        reinterpret_cast<uint64_t const volatile*>(window() + p.layout.dispatch_abort) + parity * world,
        WaitPhase::ll_dispatch, s_base, s_aborted, &s_ok, stats, remote);
  };
  int num_landed = 0;
  if constexpr (kAcrossNodes<Net> && kMasking) {
    num_landed = wait(NetworkSources<Net, true>{p, network, p.layout.dispatch_arrivals, WaitPhase::ll_dispatch,
                                                live_ranks<kMasking>(p)});
  } else if constexpr (kAcrossNodes<Net>) {
    if (p.forward)
      num_landed = wait(landing::NoRemoteSources{});
    else
      num_landed =
          wait(NetworkSources<Net>{p, network, p.layout.dispatch_arrivals, WaitPhase::ll_dispatch, 0xffffffffu});
  } else if constexpr (kMasking) {
    num_landed = wait(landing::LiveSources{{}, live_ranks<kMasking>(p)});  // a masked source: no wait, no rows
  } else {
    num_landed = wait(landing::NoRemoteSources{});
  }
  if (num_landed < 0) return;
  FERRY_TRACE_END(trace, ll_dispatch_wait_arrivals);

  // 5. the totals, and where this rank's own records start and end in hit order (marks): one step keeps its records
  //    in registers for the first windows below, more steps scan again
  FERRY_TRACE_BEGIN(trace, ll_dispatch_scan);
  auto const load = [&](int r) { return load_landed<kNet>(p, s_base, parity, r, num_landed); };
  auto const mark = [&](HitRecord const& rec, int first_hit) {
    if (rec.r == s_base[rank] - 1) s.marks[0] = first_hit + rec.hits;
    if (rec.r == s_base[rank + 1] - 1) s.marks[1] = first_hit + rec.hits;
  };
  bool const one_step = num_landed <= kThreads;
  HitRecord const mine = one_step ? load(tid) : HitRecord{};
  landing::ScanOffsets first_step{0, 0, 0, 0};
  ScanTotals totals{0, 0};
  if (one_step) {
    first_step = landing::scan_step<true>(mine.present, mine.hits, s.scan, tid >> 5, tid & 31);
    mark(mine, first_step.first_hit);
    totals = {first_step.rows, first_step.hits};
  } else {
    totals = scan_records(s, num_landed, load, [&](HitRecord const& rec, int, int first_hit) { mark(rec, first_hit); });
  }
  __syncthreads();
  // Hits are numbered in ref::expert_layout's order: this rank's own records first, then the sources above it, then
  // those below (natural index j -> (j - below) mod total). A record's hits stay consecutive.
  int const below = s.marks[0];
  int const own = (s.marks[1] < 0 ? below : s.marks[1]) - below;
  auto const rotate = [&](int j) { return j >= below ? j - below : j + totals.hits - below; };

  // 5a. fill: the window's hits into shared memory; at the first fill of a run of windows, each expert's hits before
  //     it; at the very first fill also every expert's hits in all and the rank-major metadata of the records this
  //     CTA writes (record r: CTA r % num_ctas)
  bool first_fill = true;
  auto const fill = [&](int w0, int w1, bool first) {
    auto const visit = [&](HitRecord const& rec, int row, int first_hit) {
      if (!rec.present) return;
      int j = rotate(first_hit);
#pragma unroll
      for (int k = 0; k < kMaxTopk; ++k) {
        int const e = rec.ids[k];
        if (e < 0) continue;
        if (first_fill) atomicAdd(&s_total[e], 1);
        if (first && j < w0) atomicAdd(&s_before[e], 1);
        if (j >= w0 && j < w1) s.hit[j - w0] = WindowHit{e, rec.landing, row, k};
        ++j;
      }
      if (first_fill && rec.r % p.num_ctas == cta) {
        int const source = rec.landing / p.max_tokens;
        int const token = rec.landing % p.max_tokens;
        // bf16: an own row's slots come from expand_own (its hits take no window here)
        bool const own_row = own_direct<kFormat>(p) && source == rank;
        auto const* weights = reinterpret_cast<float const*>(rec.record + topk);
        int32_t const* const own_slots = p.own_slot + static_cast<std::size_t>(token) * topk;
        std::size_t const entry0 = static_cast<std::size_t>(row) * topk;
        p.recv_src[2 * row] = source;
        p.recv_src[2 * row + 1] = token;
        float w[kMaxTopk];
        int32_t own_slot[kMaxTopk];
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {
          w[k] = k < topk ? weights[k] : 0.0f;
          own_slot[k] = own_row && k < topk && rec.ids[k] >= 0 ? own_slots[k] : -1;  // written for hits only
        }
#pragma unroll
        for (int k = 0; k < kMaxTopk; ++k) {  // unrolled: the ids stay in registers
          if (k >= topk) break;
          p.recv_idx[entry0 + k] = rec.ids[k];
          p.recv_w[entry0 + k] = w[k];
          if (rec.ids[k] < 0 || own_row) p.recv_slot[entry0 + k] = own_slot[k];
          if (rec.ids[k] >= 0 && own_slot[k] >= 0)
            p.expert_src_row[static_cast<std::size_t>(rec.ids[k]) * slots + own_slot[k]] = row;
        }
      }
    };
    if (first && one_step)
      visit(mine, first_step.row, first_step.first_hit);
    else
      scan_records(s, num_landed, load, visit);
    first_fill = false;
  };
  // 5b. every hit's slot (in window order), its recv_slot and expert_src_row; past expert_capacity dropped, counted
  auto const on_slot = [&](WindowHit const& hit, int slot) {
    std::size_t const entry = static_cast<std::size_t>(hit.row) * topk + hit.k;
    if (slot < slots) {
      p.recv_slot[entry] = slot;
      p.expert_src_row[static_cast<std::size_t>(hit.expert) * slots + slot] = hit.row;
    } else {
      p.recv_slot[entry] = -1;
      device::record_input_error(p.view, slot, true);
    }
  };
  // 6. the window's landed rows into expert_x
  char const* const landing_zone =
      window() + p.layout.dispatch_rows + static_cast<std::size_t>(parity) * world * p.max_tokens * wire_bytes;
  auto const copy = [&](int n) {
    FERRY_TRACE_END(trace, ll_dispatch_scan);
    FERRY_TRACE_BEGIN(trace, ll_dispatch_copy);
    if constexpr (kFormat == WireFormat::bf16) {
      copy_window_bf16<false>(p, s, n, [&](int landing) {
        return reinterpret_cast<int4 const*>(landing_zone + static_cast<std::size_t>(landing) * wire_bytes);
      });
    } else {
      // quantized: warp per hit (the codec's scale delivery works on a row)
      int const lane = tid & 31;
      for (int j = tid >> 5; j < n; j += kWarps) {
        int const slot = s.slot[j];
        if (slot >= slots) continue;
        int const e = s.hit[j].expert;
        std::size_t const at = static_cast<std::size_t>(e) * slots + slot;
        auto const* src =
            reinterpret_cast<uint8_t const*>(landing_zone + static_cast<std::size_t>(s.hit[j].landing) * wire_bytes);
        char* const dst = static_cast<char*>(p.expert_x) + at * row_bytes;
        if (p.dequantize) {
          device::dequantize_row_warp<kFormat, __nv_bfloat16>(src, p.hidden, reinterpret_cast<__nv_bfloat16*>(dst));
        } else {
          copy_payload_warp(dst, src, row_bytes, lane);
          device::deliver_scales_warp<kFormat>(src, p.hidden, p.scale_layout, static_cast<std::size_t>(slots),
                                               static_cast<std::size_t>(slot),
                                               static_cast<uint8_t*>(p.expert_scales) + e * p.scale_tensor_bytes,
                                               p.expert_token_scales ? p.expert_token_scales + at : nullptr);
        }
      }
    }
    FERRY_TRACE_END(trace, ll_dispatch_copy);
    FERRY_TRACE_BEGIN(trace, ll_dispatch_scan);
  };
  // bf16: the own hits are in place with their slots (expand_own; the metadata above): only the peers' hits here
  int const first_hit = own_direct<kFormat>(p) ? own : 0;
  Share const share = cta_share(first_hit, totals.hits - first_hit, cta, p.num_ctas);
  run_windows(s, s_before, share.begin, share.end, fill, on_slot, copy);
  FERRY_TRACE_END(trace, ll_dispatch_scan);

  // 7. the counts of the experts this CTA owns (e % num_ctas == cta), -1 past each one's filled slots
  __syncthreads();  // s_total is complete after the first fill; the barrier orders it for every thread
  for (int e = cta; e < num_local; e += p.num_ctas) {
    int const count = s_total[e];
    if (tid == 0) p.expert_counts[e] = count;
    for (int slot = min(count, slots) + tid; slot < slots; slot += kThreads)
      p.expert_src_row[static_cast<std::size_t>(e) * slots + slot] = -1;
  }
  if (cta == 0 && tid == 0) {
    p.state->num_recv = totals.rows;
    // a refused call leaves no tokens for the combine (the send half, earlier on the stream, wrote this rank's count)
    bool aborted = false;
    for (int i = 0; i < (kNet ? ferry::detail::rank_words(world) : 1); ++i) aborted |= s_aborted[i] != 0;
    if (aborted) p.state->num_tokens = 0;
  }
}

// kSend / kRecv: which halves this instance runs (both: the one-kernel leg; one: the hook's halves). kFormat: the
// dispatch_format; kUnitElems: the send's codec unit (device::unit_elems_for; 0 for bf16).
// Net: OneNode, or the network to the ranks of other nodes (NetParams). kMasking: rank masking (the agreement before
// this kernel set the mask; across nodes the direct route): no record, row, count or arrival to a masked rank, no
// wait for one, and a masked rank's own kernel returns at once.
template <typename IdxT, WireFormat kFormat, int kUnitElems, bool kSend, bool kRecv, class Net = OneNode,
          bool kMasking = false>
__global__ void __launch_bounds__(kThreads, 1) ll_dispatch_kernel(NetParams<LlDispatchParams, Net> const p) {
  static_assert(kSend || kRecv, "an LL dispatch kernel runs at least one half");
  __shared__ uint64_t s_seq[2];
  __shared__ ExpandShared s_expand;
  extern __shared__ int32_t s_counts[];  // [2][num_local_experts] (expand_smem_bytes)
  next_sequences<kSend, kRecv>(p.state->dispatch_send_seq, p.state->dispatch_recv_seq, s_seq);
  if (masked_out<kMasking>(p)) return;
  FERRY_TRACE_WARP(trace, p.trace);
  decltype(auto) network = network_of<Net>(p);
  if constexpr (kSend)
    ll_dispatch_send<IdxT, kFormat, kUnitElems, kMasking>(p, network, s_expand, s_counts,
                                                          s_seq[0] FERRY_TRACE_ARG(trace));
  if constexpr (kRecv)
    ll_dispatch_recv<kFormat, kMasking>(p, network, s_expand, s_counts, s_seq[1] FERRY_TRACE_ARG(trace));
}

}  // namespace ferry::cuda_ll
