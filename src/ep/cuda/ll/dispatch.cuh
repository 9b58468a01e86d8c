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
// expert (about twice the mean rows with random routing) set the leg's length (docs/design-notes.md).
// Steps 2b, 5 and 6 run the expert-major layout's one algorithm (expert_layout.cuh, normal mode's expand runs it too);
// this file says where their records come from (load_own, load_landed) and what each slot writes.
#pragma once

#include <cstdint>

#include "ep/cuda/ll/dispatch_common.cuh"
#include "ep/cuda/ll/dispatch_network.cuh"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ll {

// Rank masking, a token's entry on lane k < topk (warp-wide; dest and e as token_destination left them): an entry
// whose expert's rank is masked goes nowhere, as an id of -1 (ref::without_ranks). With `first` (the token's chunk
// 0) its entries are counted and their ranks kept for the combine's count (LlMaskWords::entry_rank).
__device__ __forceinline__ int mask_destination(LlDispatchParams const& p, LiveRanks<true> const& live, int t,
                                                bool first, int lane, int dest, int64_t& e) {
  bool const gone = dest >= 0 && !live.has(dest);
  if (first) {
    if (lane < p.topk)
      p.state->ll.mask.entry_rank[static_cast<std::size_t>(t) * p.topk + lane] = static_cast<int16_t>(dest);
    unsigned const n = __popc(__ballot_sync(0xffffffffu, gone));
    if (lane == 0 && n != 0) count_masked_entries(p, detail::LlMaskLeg::dispatch, n);
  }
  if (!gone) return dest;
  e = -1;
  return -1;
}

// 1. this call's token count to every destination (covered by CTA 0's arrival); across nodes to this node's ranks,
//    thread l to its l-th (the network leg puts it to the others). Not to a masked rank (rank masking).
template <bool kNet, bool kMasking>
__device__ __forceinline__ void send_token_count(LlDispatchParams const& p, LiveRanks<kMasking> const& live, int first,
                                                 int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  if constexpr (kNet) {
    if (cta == 0 && tid < p.local && live.has(first + tid))
      reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.ll.dispatch_tokens)[parity * world + rank] =
          static_cast<uint64_t>(p.num_tokens);
  } else if (cta == 0 && tid < world && live.has(tid)) {
    auto* word =
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.ll.dispatch_tokens) + parity * world + rank;
    *word = static_cast<uint64_t>(p.num_tokens);
  }
  if (cta == 0 && tid == 0) p.state->num_tokens = p.num_tokens;
}

// 2. the chunks a row splits into (items (token, chunk)): a batch with fewer tokens than the grid has warps splits each
//    row so that every warp has bytes in flight (a warp walking a whole row waits for ~7 round trips in a row, and a
//    quantized row's conversions run on its 32 lanes alone). A quantized row's chunks are whole scale groups, a power
//    of two of them in one CTA (nvfp4's token scale). Across nodes a bf16 row's chunks are in one CTA too, so that the
//    network leg puts each row whole: one message per row and remote rank (or rail), not one per chunk (a NIC's
//    message rate is what small puts run into).
template <WireFormat kFormat, int kUnitElems, bool kNet>
__device__ __forceinline__ int ll_send_chunks(LlDispatchParams const& p) {
  int const total_warps = p.num_ctas * kWarps;
  int const num_vec = p.hidden / 8;
  if constexpr (kFormat == WireFormat::bf16 && !kNet)
    return device::chunks_per_row(p.num_tokens, total_warps, num_vec);
  else if constexpr (kFormat == WireFormat::bf16)
    return device::cta_chunks_per_row(p.num_tokens, total_warps, (num_vec + 31) / 32, kWarps);
  else
    return device::cta_chunks_per_row(p.num_tokens, total_warps, device::scale_groups<kFormat, kUnitElems>(p.hidden),
                                      kWarps);
}

// A row's destinations, warp-wide: the destination ranks (a word) on one node; across nodes (ll/params.cuh "Wider
// worlds") the ranks of this node by local index, and bit kStagedRow for the ranks of other nodes: they get the token
// through this rank's window, each one's record staged, the row staged once; the network leg puts them after the loop.
inline constexpr int kStagedRow = 32;
template <bool kNet>
using SendSet = std::conditional_t<kNet, uint64_t, uint32_t>;

template <bool kNet>
__device__ __forceinline__ SendSet<kNet> send_set(LlDispatchParams const& p, int dest, int first) {
  if constexpr (kNet) {
    bool const near = dest >= first && dest < first + p.local;
    uint64_t const here = __reduce_or_sync(0xffffffffu, near ? 1u << (dest - first) : 0u);
    return __any_sync(0xffffffffu, dest >= 0 && !near) ? here | uint64_t{1} << kStagedRow : here;
  } else {
    return __reduce_or_sync(0xffffffffu, dest >= 0 ? 1u << dest : 0u);
  }
}

// Chunk 0 of a token: its destinations kept for the combine (token_mask) and its metadata records: every rank gets
// one on one node; across nodes this node's ranks theirs, the direct route stages every other rank's, and the forward
// route stages one record of global ids for every rail in this rank's own slot.
template <bool kNet, bool kMasking>
__device__ __forceinline__ void write_token_records(LlDispatchParams const& p, LiveRanks<kMasking> const& live,
                                                    int first, int parity, int t, std::size_t slot, SendSet<kNet> send,
                                                    int dest, int64_t e, float w, int lane) {
  int const world = p.view.world;
  if constexpr (kNet) {
    // the token's destinations for the combine, a word at a time
    int const words = ferry::detail::rank_words(world);
    for (int i = 0; i < words; ++i) {
      uint32_t const word = __reduce_or_sync(0xffffffffu, dest >= 0 && dest / 32 == i ? 1u << (dest % 32) : 0u);
      if (lane == 0) p.token_mask[static_cast<std::size_t>(t) * words + i] = word;
    }
    auto const staged_record = [&](int d) {
      return p.net.local() + p.layout.ll.send_meta +
             ((static_cast<std::size_t>(parity) * world + d) * p.max_tokens + t) * p.layout.ll.meta_bytes;
    };
    bool const direct = kMasking || !p.forward;
    landing::write_records_where(
        direct ? 0 : first, direct ? world : first + p.local, p.topk, p.num_local_experts, dest, e, w, lane,
        [&](int d) { return live.has(d); },
        [&](int d) -> char* {
          if (d < first || d >= first + p.local) return staged_record(d);
          return p.net.window(d - first) + p.layout.ll.dispatch_meta + slot * p.layout.ll.meta_bytes;
        });
    if (!direct) write_global_record(staged_record(p.view.rank), p.topk, e, w, lane);
  } else {
    if (lane == 0) p.token_mask[t] = send;
    landing::write_records(p.net, world, p.layout.ll.dispatch_meta, slot, p.layout.ll.meta_bytes, p.topk,
                           p.num_local_experts, dest, e, w, lane, live.word);
  }
}

// 2. items (token, chunk) of this CTA: the token's destinations (chunk 0 reports bad ids and writes its mask and
//    metadata), then the row's chunk once per destination rank (with own_direct not to this rank: expand_own). Every
//    warp of a CTA runs the same steps (nvfp4's barrier); a warp past the items only joins the barrier. s_refuse:
//    this CTA saw a bad or repeated id (within a token, or within an x_repeat group of entries: group_repeat).
template <typename IdxT, WireFormat kFormat, int kUnitElems, bool kMasking, bool kNet>
__device__ __forceinline__ void ll_send_items(LlDispatchParams const& p, LiveRanks<kMasking> const& live, int first,
                                              int parity, int chunks, int items, int& s_refuse) {
  __shared__ device::CtaRowMax<kWarps> s_amax;  // nvfp4: the chunks' amaxes of a step (nvfp4_chunk_token_scale)
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  int const num_vec = p.hidden / 8;
  int const total_warps = p.num_ctas * kWarps;
  landing::Routing const routing{p.view, p.topk_idx, p.topk_weights, p.topk, p.num_experts, p.num_local_experts};
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
    if (p.x_group > 1) refused |= group_repeat<IdxT>(p, t, lane, chunk == 0);
    if constexpr (kMasking) dest = mask_destination(p, live, t, chunk == 0, lane, dest, e);
    SendSet<kNet> const send = send_set<kNet>(p, dest, first);
    std::size_t const slot = landing::slot_index(parity, world, rank, p.max_tokens, t);
    if (refused) s_refuse = 1;  // any lane: every writer writes 1
    std::size_t const staged = (static_cast<std::size_t>(parity) * p.max_tokens + t);
    auto const row_at = [&](int d) -> char* {
      if constexpr (kNet)
        if (d == kStagedRow) return p.net.local() + p.layout.ll.send_rows + staged * p.layout.ll.dispatch_row_bytes;
      return p.net.window(d) + p.layout.ll.dispatch_rows + slot * p.layout.ll.dispatch_row_bytes;
    };
    if (chunk == 0) write_token_records<kNet, kMasking>(p, live, first, parity, t, slot, send, dest, e, w, lane);

    // the row (this chunk of it), once per destination rank (with own_direct not to this rank: expand_own)
    if constexpr (kFormat != WireFormat::bf16) {
      if (send != 0) send_quantized_chunk<kFormat, kUnitElems>(p, t, chunk, chunks, send, row_at, token_scale, lane);
    } else if (SendSet<kNet> const to =
                   own_direct<kFormat>(p) ? send & ~(SendSet<kNet>{1} << (kNet ? p.net.rank : rank)) : send;
               to != 0) {
      auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
      landing::send_row_chunk<kUnroll>(
          reinterpret_cast<int4 const*>(static_cast<char const*>(p.x) +
                                        static_cast<std::size_t>(x_row(p, t)) * row_bytes),
          v_begin, v_end, to, [&](int d) { return reinterpret_cast<int4*>(row_at(d)); }, lane);
    }
  }
}

// 3. arrival: the barrier orders every thread's stores before the release adds, which are cumulative over them (one
//    release per destination; no per-thread fence, which would drain each thread's NVLink stores). Across nodes this
//    node's ranks, thread l its l-th (the abort word first: the same thread's release add publishes it); the ranks
//    of other nodes through the network leg.
template <bool kNet, bool kMasking>
__device__ __forceinline__ void send_arrival(LlDispatchParams const& p, LiveRanks<kMasking> const& live, int first,
                                             int parity, uint64_t seq, bool refuse) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  __syncthreads();
  if constexpr (kNet) {
    if (tid < p.local && live.has(first + tid)) {
      if (refuse)
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.ll.dispatch_abort)[parity * world + rank] =
            seq;
      p.net.add_signal(tid, p.layout.ll.dispatch_arrivals + rank * sizeof(uint64_t), 1);
    }
  } else {
    if (refuse)
      landing::publish_abort<!kMasking>(p.net, p.layout.ll.dispatch_abort, parity, world, rank, seq, live.word);
    if (tid < world && live.has(tid)) p.net.add_signal(tid, p.layout.ll.dispatch_arrivals + rank * sizeof(uint64_t), 1);
  }
}

template <typename IdxT, WireFormat kFormat, int kUnitElems, bool kMasking, class Net>
__device__ __forceinline__ void ll_dispatch_send(LlDispatchParams const& p, Net const& network, ExpandShared& s,
                                                 int32_t* s_counts, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  constexpr bool kNet = kAcrossNodes<Net>;
  static_assert(sizeof(IdxT) == 4 || sizeof(IdxT) == 8, "topk_idx is int32 or int64");
  static_assert((kFormat == WireFormat::bf16) == (kUnitElems == 0), "bf16 rows are copied; quantized rows need a unit");
  __shared__ int s_refuse;  // this CTA saw a bad or repeated id, or the host refuses the call
  int const tid = static_cast<int>(threadIdx.x);
  int const parity = static_cast<int>(seq & 1);
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);  // rank masking: nothing to a masked rank
  int const first = kNet ? node_first(p) : 0;                // across nodes: this node's first rank

  FERRY_TRACE_BEGIN(trace, ll_dispatch_send);
  send_token_count<kNet, kMasking>(p, live, first, parity);  // 1.
  if (tid == 0) s_refuse = p.abort;  // the send loop's barriers (or the one before the arrival) order it
  if (own_direct<kFormat>(p))        // the own expansion's counters (the send loop's barriers order this)
    for (int i = tid; i < p.num_local_experts; i += kThreads) s_counts[i] = 0;
  int const chunks = ll_send_chunks<kFormat, kUnitElems, kNet>(p);
  int const items = p.num_tokens * chunks;
  ll_send_items<IdxT, kFormat, kUnitElems, kMasking, kNet>(p, live, first, parity, chunks, items, s_refuse);  // 2.
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

  FERRY_TRACE_BEGIN(trace, ll_dispatch_send_arrival);
  send_arrival<kNet, kMasking>(p, live, first, parity, seq, s_refuse != 0);  // 3.
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

// What the receive half keeps in shared memory past the expansion's (ExpandShared) and its counters.
template <bool kNet>
struct RecvShared {
  static constexpr int kSources = kMaxSources<kNet>;
  int32_t base[kSources + 1];  // first rank-major landing row of each source
  int ok;
  uint32_t aborted[kSources / 32];  // sources that refused this call, a bit each
};

// 4. every source's send CTAs of this call (thread s waits for source s; acquire, bounded). The forward route: first
//    this rank's part as a rail, after which every source of another node arrives as one of this node. Returns the
//    records landed, -1 (the whole CTA) when a source did not arrive or is out of step (recorded).
template <bool kMasking, class Net>
__device__ __forceinline__ int wait_landed(LlDispatchParams const& p, Net const& network,
                                           RecvShared<kAcrossNodes<Net>>& r, uint64_t seq, int parity) {
  constexpr bool kNet = kAcrossNodes<Net>;
  constexpr int kSources = kMaxSources<kNet>;
  int const world = p.view.world;
  int const tid = static_cast<int>(threadIdx.x);
  if constexpr (kNet && !kMasking)
    if (p.forward && !ll_dispatch_forward(p, network, parity, seq)) return -1;
  if (tid == 0) {
    r.ok = 1;
    if constexpr (!kNet) r.aborted[0] = 0;
  }
  if constexpr (kNet)
    if (tid < kSources / 32) r.aborted[tid] = 0;
  __syncthreads();
  wait_stats::Slot* const stats = wait_stats::row(p.wait_stats, wait_stats::kDispatch, world);
  auto const window = [&] { return own_window<kNet>(p); };  // read where used (a register held across the wait costs)
  auto const wait = [&](auto const& remote) {
    return landing::wait_sources<std::decay_t<decltype(remote)>, kSources>(
        p.view, reinterpret_cast<uint64_t const*>(window() + p.layout.ll.dispatch_arrivals), seq,
        static_cast<uint64_t>(p.num_ctas),
        reinterpret_cast<uint64_t const volatile*>(window() + p.layout.ll.dispatch_tokens) + parity * world,
        reinterpret_cast<uint64_t const volatile*>(window() + p.layout.ll.dispatch_abort) + parity * world,
        WaitPhase::ll_dispatch, r.base, r.aborted, &r.ok, stats, remote);
  };
  if constexpr (kNet && kMasking) {
    return wait(NetworkSources<Net, true>{p, network, p.layout.ll.dispatch_arrivals, WaitPhase::ll_dispatch,
                                          live_ranks<kMasking>(p)});
  } else if constexpr (kNet) {
    if (p.forward) return wait(landing::NoRemoteSources{});
    return wait(
        NetworkSources<Net>{p, network, p.layout.ll.dispatch_arrivals, WaitPhase::ll_dispatch, live_ranks<false>(p)});
  } else if constexpr (kMasking) {
    return wait(landing::LiveSources{{}, live_ranks<kMasking>(p).word});  // a masked source: no wait, no rows
  } else {
    return wait(landing::NoRemoteSources{});
  }
}

// 5a. the rank-major metadata of one present landed record (row `row`), written by one CTA: its source, local ids and
//     weights, and, for an own bf16 row that expand_own placed, its slots (own_slot) and their expert_src_row.
template <WireFormat kFormat>
__device__ __forceinline__ void write_landed_metadata(LlDispatchParams const& p, HitRecord const& rec, int row) {
  int const topk = p.topk;
  int const slots = p.expert_slots;
  int const source = rec.landing / p.max_tokens;
  int const token = rec.landing % p.max_tokens;
  // bf16: an own row's slots come from expand_own (its hits take no window here)
  bool const own_row = own_direct<kFormat>(p) && source == p.view.rank;
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

// 6, quantized: the window's n hits into expert_x, warp per hit (the codec's scale delivery works on a row): the
//    payload and scales delivered, or the row dequantized (dispatch_dequantize).
template <WireFormat kFormat>
__device__ __forceinline__ void copy_window_quantized(LlDispatchParams const& p, ExpandShared const& s, int n,
                                                      char const* landing_zone) {
  int const tid = static_cast<int>(threadIdx.x);
  int const lane = tid & 31;
  int const slots = p.expert_slots;
  std::size_t const wire_bytes = p.layout.ll.dispatch_row_bytes;
  std::size_t const row_bytes = p.expert_row_bytes;
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

// 7. the counts of the experts this CTA owns (e % num_ctas == cta), -1 past each one's filled slots, and the call's
//    seq in dropped_seq where one took more entries than its slots (its combine refuses); CTA 0 writes num_recv, and a
//    refused call leaves no tokens for the combine (the send half, earlier on the stream, wrote this rank's count).
template <bool kNet>
__device__ __forceinline__ void finish_landed(LlDispatchParams const& p, RecvShared<kNet> const& r,
                                              int32_t const* s_total, int rows, uint64_t seq) {
  int const tid = static_cast<int>(threadIdx.x);
  int const cta = static_cast<int>(blockIdx.x);
  int const slots = p.expert_slots;
  __syncthreads();  // s_total is complete after the first fill; the barrier orders it for every thread
  for (int e = cta; e < p.num_local_experts; e += p.num_ctas) {
    int const count = s_total[e];
    if (tid == 0) {
      p.expert_counts[e] = count;
      if (count > slots) p.state->ll.dropped_seq = seq;  // every writer writes the same value
    }
    for (int slot = min(count, slots) + tid; slot < slots; slot += kThreads)
      p.expert_src_row[static_cast<std::size_t>(e) * slots + slot] = -1;
  }
  if (cta == 0 && tid == 0) {
    p.state->num_recv = rows;
    bool aborted = false;
    for (int i = 0; i < (kNet ? ferry::detail::rank_words(p.view.world) : 1); ++i) aborted |= r.aborted[i] != 0;
    if (aborted) p.state->num_tokens = 0;
  }
}

template <WireFormat kFormat, bool kMasking, class Net>
__device__ __forceinline__ void ll_dispatch_recv(LlDispatchParams const& p, Net const& network, ExpandShared& s,
                                                 int32_t* s_counts, uint64_t seq FERRY_TRACE_PARAM(trace)) {
  constexpr bool kNet = kAcrossNodes<Net>;
  __shared__ RecvShared<kNet> r;
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const cta = static_cast<int>(blockIdx.x);
  int const parity = static_cast<int>(seq & 1);
  int const topk = p.topk;
  int const num_local = p.num_local_experts;
  int const slots = p.expert_slots;
  std::size_t const wire_bytes = p.layout.ll.dispatch_row_bytes;
  int32_t* const s_before = s_counts;
  int32_t* const s_total = s_counts + num_local;
  for (int i = tid; i < 2 * num_local; i += kThreads) s_counts[i] = 0;  // ordered by the wait's barriers
  if (tid == 0) {
    s.marks[0] = 0;
    s.marks[1] = -1;
  }

  FERRY_TRACE_BEGIN(trace, ll_dispatch_wait_arrivals);
  int const num_landed = wait_landed<kMasking>(p, network, r, seq, parity);  // 4.
  if (num_landed < 0) return;
  FERRY_TRACE_END(trace, ll_dispatch_wait_arrivals);

  // 5. the totals, and where this rank's own records start and end in hit order (marks): one step keeps its records
  //    in registers for the first windows below, more steps scan again
  FERRY_TRACE_BEGIN(trace, ll_dispatch_scan);
  auto const load = [&](int i) { return load_landed<kNet>(p, r.base, parity, i, num_landed); };
  auto const mark = [&](HitRecord const& rec, int first_hit) {
    if (rec.r == r.base[rank] - 1) s.marks[0] = first_hit + rec.hits;
    if (rec.r == r.base[rank + 1] - 1) s.marks[1] = first_hit + rec.hits;
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
      if (first_fill && rec.r % p.num_ctas == cta) write_landed_metadata<kFormat>(p, rec, row);
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
  char const* const landing_zone = own_window<kNet>(p) + p.layout.ll.dispatch_rows +
                                   static_cast<std::size_t>(parity) * world * p.max_tokens * wire_bytes;
  auto const copy = [&](int n) {
    FERRY_TRACE_END(trace, ll_dispatch_scan);
    FERRY_TRACE_BEGIN(trace, ll_dispatch_copy);
    if constexpr (kFormat == WireFormat::bf16) {
      copy_window_bf16<false>(p, s, n, [&](int landing) {
        return reinterpret_cast<int4 const*>(landing_zone + static_cast<std::size_t>(landing) * wire_bytes);
      });
    } else {
      copy_window_quantized<kFormat>(p, s, n, landing_zone);
    }
    FERRY_TRACE_END(trace, ll_dispatch_copy);
    FERRY_TRACE_BEGIN(trace, ll_dispatch_scan);
  };
  // bf16: the own hits are in place with their slots (expand_own; the metadata above): only the peers' hits here
  int const first_hit = own_direct<kFormat>(p) ? own : 0;
  Share const share = cta_share(first_hit, totals.hits - first_hit, cta, p.num_ctas);
  run_windows(s, s_before, share.begin, share.end, fill, on_slot, copy);
  FERRY_TRACE_END(trace, ll_dispatch_scan);

  finish_landed(p, r, s_total, totals.rows, seq);  // 7.
}

// The halves a launch runs are LlParams::halves (both: the one-kernel leg; one: the hook's halves). kFormat: the
// dispatch_format; kUnitElems: the send's codec unit (device::unit_elems_for; 0 for bf16).
// Net: OneNode, or the network to the ranks of other nodes (NetParams). kMasking: rank masking (the agreement before
// this kernel set the mask; across nodes the direct route): no record, row, count or arrival to a masked rank, no
// wait for one, and a masked rank's own kernel returns at once.
// The symbol is ferry::cuda_ll::leg::dispatch<...>: profilers that find a leg's kernel by name (DeepEP's bench_kineto
// looks for "::dispatch" and "::combine" in the trace) find this one kernel, launched once or, with the hook, twice.
namespace leg {
template <typename IdxT, WireFormat kFormat, int kUnitElems, class Net = OneNode, bool kMasking = false>
__global__ void __launch_bounds__(kThreads, 1) dispatch(NetParams<LlDispatchParams, Net> const p) {
  __shared__ uint64_t s_seq[2];
  __shared__ ExpandShared s_expand;
  extern __shared__ int32_t s_counts[];  // [2][num_local_experts] (expand_smem_bytes)
  next_sequences(p.halves, p.state->ll.dispatch_send_seq, p.state->ll.dispatch_recv_seq, s_seq);
  if (masked_out<kMasking>(p)) return;
  FERRY_TRACE_WARP(trace, p.trace);
  decltype(auto) network = network_in<Net>(p);
  if (p.halves & kSendHalf)
    ll_dispatch_send<IdxT, kFormat, kUnitElems, kMasking>(p, network, s_expand, s_counts,
                                                          s_seq[0] FERRY_TRACE_ARG(trace));
  if (p.halves & kRecvHalf)
    ll_dispatch_recv<kFormat, kMasking>(p, network, s_expand, s_counts, s_seq[1] FERRY_TRACE_ARG(trace));
}
}  // namespace leg

}  // namespace ferry::cuda_ll
