// Normal-mode dispatch over NVLink: one fused kernel does the layout, the count exchange and the push.
//
// Steps (every CTA owns a contiguous range of this rank's tokens):
//  1. layout: per token the mask of destination ranks, its position among this CTA's rows for each destination
//     (warp ballots + a CTA scan), and this CTA's entries per expert; a bad id (outside [-1, num_experts)) or a valid
//     id repeated in a token's row is counted (input_errors) and makes this rank refuse the call.
//  2. arrival: every CTA publishes its rows per destination in local scratch and adds all its counts into the rank's
//     totals (atomics: sums, whose order does not matter), and 1 to the last total when its layout found a bad or
//     repeated id, then arrives; no CTA waits for the grid.
//  3. the last CTA to arrive reads (and zeroes) the totals and writes this rank's row of the count matrix into every
//     rank (tokens, rows per destination, entries per expert of that destination), then one release signal per
//     destination: word 0, which carries kCountAbort when this rank refuses the call (a bad or repeated id in any
//     CTA's layout, or the host's refusal, DispatchParams::abort). (CTA 0 used to wait for every arrival and then sum
//     132 CTAs' counts: ~5 us more on the chain that every push waits for.)
//  4. every CTA waits for every source's row (a row of another call than this one is an out-of-step error). Every rank
//     sees the same words, so all agree whether any source refused: then no rank pushes a row, each still signals
//     and waits its sources in step 6 (the sequence and parities stay in step) and delivers 0 rows; the peers of a
//     refusing rank record its refusal. Otherwise every CTA computes its base on each destination itself: rows of lower
//     source ranks there, then rows of lower CTAs of this rank. Rows go in (source rank, token) order, whatever the
//     order of the CTAs' arrivals. nvfp4 computes its tokens' scales before this wait (the peers' rows are in flight).
//  5. push: warp per token; 16-byte loads of the row (several in flight), stored straight into the final row of every
//     destination (LSA pointers), with the metadata (local expert ids, weights, source). A quantized dispatch_format
//     quantizes the row in registers on the way (device_unit_codec.cuh: once per token, whatever the number of
//     destinations), or forwards pre-quantized input, and stores the payload, the block scales and the nvfp4 token
//     scale straight into their places on every destination (no receiver pass over the payload).
//  6. the last CTA to finish signals every destination once (release) and waits for every source's signal.
//  7. only where the delivery needs it (RecvPass): every CTA waits for every source, then a local pass over the
//     received rows: the row-major scales into another scale layout, or (dispatch_dequantize) the wire rows into
//     bf16 rows.
//  8. the last CTA writes num_recv, per-source offsets and expert counts, resets the grid counters and advances the
//     sequence.
// Sequence numbers (DeviceState::dispatch_seq) grow every call on the device, so a graph replays with no reset and a
// signal of call n is never mistaken for call n+1; count slots alternate by parity because a fast peer may write
// call n+1's row while this rank still reads call n's.
#pragma once

#include <cstdint>

#include <cuda_bf16.h>

#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/landing.cuh"  // send_row_chunk
#include "ep/cuda/normal/params.cuh"
#include "trace/device_trace.cuh"
#include "wire/device_codec.cuh"
#include "wire/device_push.cuh"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

// The first valid id that appears twice in a token's row of ids (-1 entries, and those past topk, may repeat); -1 when
// none does. A token picks distinct experts: a repeated one is refused as a bad id is.
__device__ __forceinline__ int64_t repeated_id(int64_t const (&ids)[kMaxTopk], int topk) {
#pragma unroll
  for (int a = 1; a < kMaxTopk; ++a) {
    if (a >= topk) break;  // ids stay in registers: a runtime bound would put them in local memory
#pragma unroll
    for (int b = 0; b < a; ++b)
      if (ids[a] >= 0 && ids[a] == ids[b]) return ids[a];
  }
  return -1;
}

// nvfp4 without pre-quantized input: the per-token scale of this CTA's tokens [t0, t1) (a warp per token, the row's
// amax), into p.token_scales, before the push (every block scale needs it). It runs while the CTA waits for the peers'
// counts. The push reads each row again; this pass walks the tokens backwards, so that the rows it read last, which
// the L2 still holds, are the ones the push reads first (its warps start at t0).
__device__ __forceinline__ void nvfp4_token_scales(DispatchParams const& p, int t0, int t1, int warp, int lane) {
  int const num_vec = p.hidden / 8;
  for (int t = t1 - 1 - warp; t >= t0; t -= kWarps) {
    auto const* const x_row = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(t) * num_vec;
    // the whole row as one chunk
    float const token_scale = wire::nvfp4_token_scale(device::chunk_finite_amax<16>(x_row, p.hidden, 0, 1, lane));
    if (lane == 0) p.token_scales[t] = token_scale;
  }
}

// Where row `row` of destination d's delivered buffers are (the dispatch's QuantDst: payload, scales, token scale).
__device__ __forceinline__ device::QuantRowPlaces delivered_places(DispatchParams const& p, int d, int32_t row) {
  std::size_t const r = static_cast<std::size_t>(row);
  char* const sym = p.net.window(d);
  return device::QuantRowPlaces{sym + p.qdst.payload + r * p.qdst.payload_stride,
                                sym + p.qdst.scales + r * p.qdst.scales_stride,
                                reinterpret_cast<float*>(sym + p.qdst.token + r * p.qdst.token_stride)};
}

// Push of one quantized row (items (token, chunk) as the bf16 push): the warp quantizes its chunk of the row (or
// forwards the pre-quantized pieces) and stores the pieces into every destination of `send` at its final row rows[d]
// (device_push.cuh). Chunks are whole scale groups, so a block's lanes are all in one chunk.
template <WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void push_quantized_row(DispatchParams const& p, int t, int chunk, int chunks, uint32_t send,
                                                   int32_t const* rows, int lane) {
  using Codec = device::UnitCodec<kFormat, kUnitElems>;
  bool const prequantized = p.x_scales != nullptr;
  device::QuantRowInput const in = device::quant_row_input<kFormat, kUnitElems>(p.x, p.x_scales, p.hidden, t);
  // nvfp4's per-token scale (the whole row's amax enters every block scale): given, or computed by this CTA before
  // the count exchange's wait (nvfp4_token_scales)
  float const token_scale =
      kFormat != WireFormat::nvfp4 ? 0.0f : (prequantized ? p.x_token_scales[t] : p.token_scales[t]);
  // 4 vectors of bf16 in flight per lane, as the bf16 push
  device::push_quantized_chunk<kFormat, kUnitElems, kDispatchUnroll / Codec::kVecs>(
      in, p.hidden, chunk, chunks, send, token_scale, [&](int d) { return delivered_places(p, d, rows[d]); }, lane);
}

// The receiver's local pass over rows [0, num_recv) once every source's rows have landed, spread over the whole grid.
template <WireFormat kFormat>
__device__ __forceinline__ void dispatch_recv_pass(DispatchParams const& p, int num_recv) {
  int const tid = static_cast<int>(threadIdx.x);
  int const cta = static_cast<int>(blockIdx.x);
  char* const sym = p.net.window(p.view.rank);
  if (p.recv_pass == RecvPass::dequantize) {
    // warp per row: wire row -> bf16 row (device codec: y = code * scale in fp32, rounded once)
    std::size_t const wire_bytes = wire::make_row_layout(kFormat, p.hidden).row_bytes;
    auto* const out = reinterpret_cast<__nv_bfloat16*>(sym + p.layout.normal.recv_x);
    for (int row = cta * kWarps + (tid >> 5); row < num_recv; row += p.num_ctas * kWarps)
      device::dequantize_row_warp<kFormat, __nv_bfloat16>(
          reinterpret_cast<uint8_t const*>(sym + p.layout.normal.recv_wire +
                                           static_cast<std::size_t>(row) * wire_bytes),
          p.hidden, out + static_cast<std::size_t>(row) * p.hidden);
  } else if (p.recv_pass == RecvPass::relayout) {
    // thread per scale: row-major -> recv_scale_layout. MN-major layouts take rows fastest (their stores coalesce).
    constexpr int kScaleBytes = wire::format_traits(kFormat).scale_bytes;
    int const num_scales = p.hidden / wire::format_traits(kFormat).block_elems;
    bool const rows_fastest =
        p.scale_layout == ScaleLayout::mn_major_tma || p.scale_layout == ScaleLayout::mn_major_tma_packed_ue8m0;
    int64_t const total = static_cast<int64_t>(num_recv) * num_scales;
    auto const* const src = reinterpret_cast<uint8_t const*>(sym + p.layout.normal.recv_scales);
    auto* const dst = static_cast<uint8_t*>(p.recv_scales_final);
    for (int64_t i = static_cast<int64_t>(cta) * kThreads + tid; i < total;
         i += static_cast<int64_t>(p.num_ctas) * kThreads) {
      int const row = static_cast<int>(rows_fastest ? i % num_recv : i / num_scales);
      int const block = static_cast<int>(rows_fastest ? i / num_recv : i % num_scales);
      std::size_t const from = (static_cast<std::size_t>(row) * num_scales + block) * kScaleBytes;
      std::size_t const to =
          wire::scale_offset(kFormat, p.scale_layout, static_cast<std::size_t>(p.recv_capacity), p.hidden,
                             static_cast<std::size_t>(row), static_cast<std::size_t>(block));
      // volatile loads: peers wrote the scales during this kernel (never the non-coherent path)
      if constexpr (kScaleBytes == 4)
        *reinterpret_cast<uint32_t*>(dst + to) = *reinterpret_cast<uint32_t const volatile*>(src + from);
      else
        dst[to] = *reinterpret_cast<uint8_t const volatile*>(src + from);
    }
  }
}

// Every rank's rows past its receive capacity, by one warp (lane d: destination d; world <= 32): every rank reads the
// same count matrix, so every rank records the same drop (signal.cuh, record_call_drops) and the call is an error on
// every rank, not only on the ranks that lost rows. A refused call delivers nothing and drops nothing.
template <class Params>
__device__ __forceinline__ void record_row_drops(Params const& p, char* own, int parity, bool aborted) {
  int const world = p.view.world;
  int const lane = static_cast<int>(threadIdx.x);
  int32_t over = 0;
  if (lane < world && !aborted) {
    int32_t total = 0;
    for (int s = 0; s < world; ++s)
      total += count_value(device::arch::load_relaxed_sys_u64(count_word(own, p.layout, parity, world, s, 1 + lane)));
    over = total > p.recv_capacity ? total - p.recv_capacity : 0;
  }
  uint32_t const dropped = __ballot_sync(0xffffffffu, over > 0);
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) over += __shfl_xor_sync(0xffffffffu, over, offset);
  if (lane == 0 && dropped != 0) device::record_call_drops(p.view, static_cast<uint32_t>(over), __ffs(dropped) - 1);
}

// Step 8, the dispatch's outputs (the hierarchical dispatch's too), by every thread of the last CTA once every source's
// rows have landed: rows per source, num_recv, this rank's tokens and the expert counts, for a combine, an expand or a
// handle to read. The counts come from the exchanged count rows (own: this rank's window, where they landed), or,
// where rows were dropped past recv_capacity (the exchanged counts include those), from the delivered rows' ids,
// counted in `counters` (num_local_experts int32 of scratch). A refused call delivers nothing and leaves nothing for
// a combine (0 tokens of every source, none of this rank). s_total: a shared word.
template <class Params>
__device__ __forceinline__ void write_dispatch_outputs(Params const& p, char* own, int parity, bool aborted,
                                                       int32_t* counters, int& s_total) {
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  int const num_local = p.num_local_experts;
  if (tid == 0) {
    int32_t offset = 0;
    for (int s = 0; s < world; ++s) {
      uint64_t const* row = count_word(own, p.layout, parity, world, s, 0);
      int32_t const count = aborted ? 0 : count_value(device::arch::load_relaxed_sys_u64(row + 1 + rank));
      int32_t const first = offset < p.recv_capacity ? offset : p.recv_capacity;
      int32_t const room = p.recv_capacity - first;
      p.state->src_offset[s] = first;
      p.state->src_count[s] = count < room ? count : room;
      p.state->src_tokens[s] = aborted ? 0 : count_value(device::arch::load_relaxed_sys_u64(row));
      offset += count;
    }
    s_total = offset;
    p.state->num_recv = offset < p.recv_capacity ? offset : p.recv_capacity;
    p.state->num_tokens = aborted ? 0 : p.num_tokens;
  }
  if (tid < 32 && p.recv_capacity < world * p.max_tokens) record_row_drops(p, own, parity, aborted);
  __syncthreads();
  if (s_total <= p.recv_capacity) {
    for (int el = tid; el < num_local; el += kThreads) {
      int const word = expert_word(p.layout.normal, world, rank, num_local, el);
      int32_t sum = 0;
      for (int s = 0; s < world && !aborted; ++s)
        sum += count_value(device::arch::load_relaxed_sys_u64(count_word(own, p.layout, parity, world, s, word)));
      p.expert_counts[el] = sum;
    }
  } else {  // rows were dropped: count the delivered rows' entries (the exchanged counts include the dropped ones)
    for (int el = tid; el < num_local; el += kThreads) counters[el] = 0;
    __syncthreads();
    auto const* recv_idx = reinterpret_cast<int32_t const volatile*>(own + p.layout.normal.recv_idx);
    int const entries = p.recv_capacity * p.topk;
    for (int f = tid; f < entries; f += kThreads) {
      int32_t const el = recv_idx[f];
      if (el >= 0 && el < num_local) atomicAdd(&counters[el], 1);
    }
    __syncthreads();
    if (counters != p.expert_counts)
      for (int el = tid; el < num_local; el += kThreads) p.expert_counts[el] = counters[el];
  }
}

// What one CTA of dispatch_kernel keeps in shared memory besides its counters (s_cnt, dynamic: [world] rows per
// destination, then [num_experts] entries per expert).
struct DispatchShared {
  int32_t warp_cnt[kWarps][kMaxCudaWorld];
  int32_t warp_off[kWarps][kMaxCudaWorld];
  int32_t dest_base[kMaxCudaWorld];
  int32_t row[kWarps][kMaxCudaWorld];
  uint64_t seq;
  int ok;
  int bad;           // this CTA's layout found a bad or repeated id
  uint32_t aborted;  // sources whose count row carries kCountAbort
  int last_arrival;
  int last;
  int total;
  int num_recv;
};

// This CTA's tokens, a contiguous range [t0, t1) of the rank's.
struct CtaTokens {
  int t0;
  int t1;
};

__device__ __forceinline__ CtaTokens cta_tokens(DispatchParams const& p, int cta) {
  return CtaTokens{static_cast<int>(static_cast<int64_t>(p.num_tokens) * cta / p.num_ctas),
                   static_cast<int>(static_cast<int64_t>(p.num_tokens) * (cta + 1) / p.num_ctas)};
}

// A token's destination ranks (bit d for rank d; world <= 32) from its topk ids, each valid id counted in
// expert_counts[e] (shared-memory counters: a sum, whose order does not matter). A bad id (outside [-1,
// num_experts)) or a valid id repeated in the token's row is recorded and sets `bad` (the call is refused on every
// rank). A token's ids are all loaded before the first is used (one round trip, where a loop that used each id as it
// came waited for each). Not valid: no ids (a thread past the tokens of its step).
template <typename IdxT>
__device__ __forceinline__ uint32_t token_destinations(DispatchParams const& p, IdxT const* topk_idx, int t, bool valid,
                                                       int32_t* expert_counts, int& bad) {
  int const topk = p.topk;
  int64_t ids[kMaxTopk];
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k)
    ids[k] = valid && k < topk ? static_cast<int64_t>(topk_idx[static_cast<std::size_t>(t) * topk + k]) : -1;
  uint32_t mask = 0;
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) {
    int64_t const e = ids[k];
    if (e == -1) continue;
    if (e < -1 || e >= p.num_experts) {
      device::record_bad_expert_id(p.view, e);
      bad = 1;
      continue;
    }
    mask |= 1u << (static_cast<int>(e) / p.num_local_experts);
    atomicAdd(&expert_counts[static_cast<int>(e)], 1);
  }
  if (int64_t const repeated = repeated_id(ids, topk); repeated >= 0) {
    device::record_bad_expert_id(p.view, repeated);
    bad = 1;
  }
  return mask;
}

// 1. layout of this CTA's tokens, kThreads tokens per step: per token its mask of destinations (token_mask), its
//    position among this CTA's rows for each (token_pos: warp ballots + a scan over warps), and its entries per expert
//    (s_cnt). A token's ids are all loaded before the first is used (one round trip, where a loop that used each id as
//    it came waited for each).
template <typename IdxT>
__device__ __forceinline__ void dispatch_layout(DispatchParams const& p, DispatchShared& s, int32_t* s_cnt,
                                                CtaTokens tokens) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  auto const* topk_idx = static_cast<IdxT const*>(p.topk_idx);
  for (int base = tokens.t0; base < tokens.t1; base += kThreads) {
    int const t = base + tid;
    bool const valid = t < tokens.t1;
    uint32_t const mask = token_destinations(p, topk_idx, t, valid, s_cnt + world, s.bad);
    for (int d = 0; d < world; ++d) {
      uint32_t const bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (lane == 0) s.warp_cnt[warp][d] = __popc(bits);
    }
    __syncthreads();
    if (tid < world) {  // scan over warps, one thread per destination
      int running = s_cnt[tid];
      for (int w = 0; w < kWarps; ++w) {
        s.warp_off[w][tid] = running;
        running += s.warp_cnt[w][tid];
      }
      s_cnt[tid] = running;
    }
    __syncthreads();
    uint32_t const lower = (1u << lane) - 1u;
    for (int d = 0; d < world; ++d) {
      uint32_t const bits = __ballot_sync(0xffffffffu, (mask >> d) & 1u);
      if (valid && ((mask >> d) & 1u))
        p.token_pos[static_cast<std::size_t>(t) * world + d] = s.warp_off[warp][d] + __popc(bits & lower);
    }
    if (valid) p.token_mask[t] = mask;
  }
}

// 2. this CTA's rows per destination to local scratch (the later CTAs' bases), and all its counts added into the
//    rank's totals; then the arrival. No CTA waits for the grid: the last to arrive (s.last_arrival) has every count.
__device__ __forceinline__ void dispatch_grid_arrival(DispatchParams const& p, DispatchShared& s,
                                                      int32_t const* s_cnt) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_counts = world + p.num_experts;
  int32_t* mine = p.block_counts + static_cast<std::size_t>(cta) * world;
  for (int i = tid; i <= num_counts; i += kThreads) {
    int32_t const count = i < num_counts ? s_cnt[i] : s.bad;  // the layout's barriers ordered every thread's s.bad
    if (i < world) mine[i] = count;
    if (count != 0) atomicAdd(p.count_totals + i, count);
  }
  __syncthreads();
  if (tid == 0) {
    __threadfence();  // the counts above before the arrival (gpu scope: only this GPU's CTAs read them)
    unsigned long long const old =
        atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.dispatch_arrive), 1ull);
    s.last_arrival = old == static_cast<unsigned long long>(p.num_ctas - 1);
    if (s.last_arrival)
      __threadfence();  // every CTA's counts (ordered by their fences and arrivals) before the reads below
  }
  __syncthreads();
}

// 3. by the last CTA to arrive: the totals (read and zeroed for the next call: every CTA has added its counts), and
//    this rank's row of the count matrix into every rank; the last total says whether any CTA refuses the call (read
//    in the same pass as the counts: a read of its own would add a round trip before the count words)
__device__ __forceinline__ void send_count_row(DispatchParams const& p, DispatchShared& s, int32_t* s_cnt, uint64_t seq,
                                               int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_counts = world + p.num_experts;
  int const num_local = p.num_local_experts;
  for (int i = tid; i <= num_counts; i += kThreads) {
    int32_t const total = atomicExch(p.count_totals + i, 0);
    if (i < num_counts)
      s_cnt[i] = total;
    else
      s.bad = p.abort || total != 0;
  }
  __syncthreads();
  int const words = p.layout.normal.count_words;
  uint64_t const tag = seq << 32;
  for (int i = tid; i < world * words; i += kThreads) {
    int const d = i / words;
    int const w = i % words;
    if (w == 0) continue;  // word 0 is the signal, written last
    // entries per expert: the destination's experts, or every expert (the same row to every rank: every_expert)
    int const first_expert = p.layout.normal.every_expert ? 0 : d * num_local;
    int32_t const value = w <= world ? s_cnt[w - 1] : s_cnt[world + first_expert + (w - 1 - world)];
    *reinterpret_cast<uint64_t volatile*>(count_word(p.net.window(d), p.layout, parity, world, rank, w)) =
        tag | static_cast<uint32_t>(value);
  }
  __syncthreads();
  if (tid == 0) {
    // release (cumulative): the barrier orders every thread's words before this thread's signals
    uint64_t const word0 = tag | (s.bad ? kCountAbort : 0ull) | static_cast<uint32_t>(p.num_tokens);
    // not unrolled: each store is a system-scope release (a fence and a store), and unrolled ptxas copies that
    // sequence many times for a loop that runs `world` times; code the kernel carries costs time on every call
#pragma unroll 1
    for (int d = 0; d < world; ++d) p.net.store_signal(d, count_offset(p.layout, parity, world, rank, 0), word0);
  }
}

// 4. every source's row of the count matrix (thread s waits for source s; acquire); s.aborted collects the sources
//    that refuse the call. False (for the whole CTA) when a source did not arrive or is out of step (recorded).
__device__ __forceinline__ bool wait_count_rows(DispatchParams const& p, DispatchShared& s, uint64_t seq, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  if (tid < world) {
    uint64_t word0 = 0;
    if (!device::wait_signal_geq_value(p.view, count_word(p.net.window(rank), p.layout, parity, world, tid, 0),
                                       seq << 32, tid, WaitPhase::count_exchange, &word0)) {
      s.ok = 0;
    } else if ((word0 >> 32) != (seq & 0xffffffffull)) {
      // a row of call seq + 2k in this parity's slot: that source ran more dispatches on this buffer than this rank
      device::record_out_of_step(p.view, tid, WaitPhase::count_exchange, seq & 0xffffffffull, word0 >> 32);
      s.ok = 0;
    } else if ((word0 & kCountAbort) != 0) {
      atomicOr(&s.aborted, 1u << tid);
    }
  }
  __syncthreads();
  return s.ok != 0;
}

// 4b. once per call and refusing peer, its refusal recorded (a rank that refused the call itself records none: its
//     own input error, or its host's InputError, is the call's error, and a peer's record would surface as a refusal
//     of a later call); then, unless the call is refused, every CTA's first row on each destination (s.dest_base).
__device__ __forceinline__ void destination_bases(DispatchParams const& p, DispatchShared& s, int parity,
                                                  bool aborted) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  if (cta == 0 && tid < world && tid != rank && ((s.aborted >> tid) & 1u) != 0 && ((s.aborted >> rank) & 1u) == 0)
    device::record_refusal(p.view, tid, WaitPhase::count_exchange);
  if (warp < world && !aborted) {
    // warp d: rows for destination d of lower source ranks there, then of this rank's lower CTAs (lanes share the
    // CTAs: one round trip, where a thread walking them waited for each; this rank's own row was released after
    // every CTA arrived, so their scratch is visible)
    int const d = warp;
    int32_t base = 0;
    for (int src = lane; src < rank; src += 32)
      base += count_value(
          device::arch::load_relaxed_sys_u64(count_word(p.net.window(rank), p.layout, parity, world, src, 1 + d)));
    for (int c = lane; c < cta; c += 32)
      base += *reinterpret_cast<int32_t const volatile*>(p.block_counts + static_cast<std::size_t>(c) * world + d);
#pragma unroll
    for (int offset = 16; offset > 0; offset >>= 1) base += __shfl_xor_sync(0xffffffffu, base, offset);
    if (lane == 0) s.dest_base[d] = base;
  }
  __syncthreads();
}

// Lane k's entry of token t (k < topk): its global expert id and weight; -1 and 0 past topk.
struct TokenEntry {
  int64_t e;
  float w;
  bool valid;  // e is an expert (in [0, num_experts))
};

template <typename IdxT>
__device__ __forceinline__ TokenEntry token_entry(DispatchParams const& p, int t, int lane) {
  int64_t e = -1;
  float w = 0.0f;
  if (lane < p.topk) {
    e = static_cast<int64_t>(static_cast<IdxT const*>(p.topk_idx)[static_cast<std::size_t>(t) * p.topk + lane]);
    w = p.topk_weights[static_cast<std::size_t>(t) * p.topk + lane];
  }
  return TokenEntry{e, w, e >= 0 && e < p.num_experts};
}

// A token's metadata on every destination of `send` (its rows[d]): lane k writes column k, the local expert id there
// (-1 where that expert is elsewhere) and its weight, and lane 0 the source (rank, token).
__device__ __forceinline__ void push_metadata(DispatchParams const& p, int t, uint32_t send, int32_t const* rows,
                                              TokenEntry const& entry, int lane) {
  int const rank = p.view.rank;
  int const topk = p.topk;
  int const num_local = p.num_local_experts;
  for (uint32_t m = send; m != 0; m &= m - 1) {
    int const d = __ffs(m) - 1;
    std::size_t const r = static_cast<std::size_t>(rows[d]);
    char* dst = p.net.window(d);
    if (lane < topk) {
      bool const local = entry.valid && static_cast<int>(entry.e) / num_local == d;
      reinterpret_cast<int32_t*>(dst + p.layout.normal.recv_idx)[r * topk + lane] =
          local ? static_cast<int32_t>(entry.e) - d * num_local : -1;
      reinterpret_cast<float*>(dst + p.layout.normal.recv_w)[r * topk + lane] = local ? entry.w : 0.0f;
    }
    if (lane == 0) reinterpret_cast<int2*>(dst + p.layout.normal.recv_src)[r] = make_int2(rank, t);
  }
}

// 5. push: items (token, chunk); every destination of the token from one load of the row. A CTA with fewer tokens
//    than warps splits each row into chunks so every warp has bytes in flight (small batches are latency-bound: one
//    warp per token would leave most of the grid idle); with >= kWarps tokens a chunk is the whole row.
template <typename IdxT, WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void push_rows(DispatchParams const& p, DispatchShared& s, CtaTokens tokens, bool aborted) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  std::size_t const row_bytes = static_cast<std::size_t>(p.hidden) * 2;
  int const num_cta_tokens = tokens.t1 - tokens.t0;
  int const chunks = num_cta_tokens > 0 && num_cta_tokens < kWarps ? kWarps / num_cta_tokens : 1;
  for (int item = warp; !aborted && item < num_cta_tokens * chunks; item += kWarps) {
    int const t = tokens.t0 + item % num_cta_tokens;
    int const chunk = item / num_cta_tokens;
    uint32_t const mask = p.token_mask[t];
    int row = -1;
    if (lane < world && ((mask >> lane) & 1u)) {
      row = s.dest_base[lane] + p.token_pos[static_cast<std::size_t>(t) * world + lane];
      if (row >= p.recv_capacity) row = -1;  // past the receiver's capacity: dropped (step 8 counts every rank's)
    }
    uint32_t const send = __ballot_sync(0xffffffffu, row >= 0);
    if (lane < world) s.row[warp][lane] = row;
    __syncwarp();
    if (send == 0) continue;

    if (chunk == 0) {
      // the source learns which destinations really hold the token (combine sums only those); another chunk of
      // this token may read the updated word, which yields the same `send`
      if (lane == 0 && send != mask) p.token_mask[t] = send;
      push_metadata(p, t, send, s.row[warp], token_entry<IdxT>(p, t, lane), lane);
    }

    if constexpr (kFormat != WireFormat::bf16) {
      push_quantized_row<kFormat, kUnitElems>(p, t, chunk, chunks, send, s.row[warp], lane);
    } else {
      // this chunk of the row, straight into its final row on every destination
      auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
      landing::send_row_chunk<kDispatchUnroll>(
          reinterpret_cast<int4 const*>(static_cast<char const*>(p.x) + static_cast<std::size_t>(t) * row_bytes),
          v_begin, v_end, send,
          [&](int d) {
            return reinterpret_cast<int4*>(p.net.window(d) + p.layout.normal.recv_x +
                                           static_cast<std::size_t>(s.row[warp][d]) * row_bytes);
          },
          lane);
    }
  }
}

// 6. arrival; the last CTA (s.last) publishes one signal per destination.
// NOTE: one fence per CTA, not per thread: the barrier orders every thread's stores before thread 0's fence, and the
// fence is cumulative over what thread 0 has observed, so the arrival below publishes the whole CTA's rows.
__device__ __forceinline__ void signal_rows(DispatchParams const& p, DispatchShared& s, uint64_t seq) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  __syncthreads();
  if (tid == 0) {
    device::arch::fence_acq_rel_sys();  // the CTA's rows reach the destinations before the arrival
    unsigned long long const old =
        atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.dispatch_done), 1ull);
    s.last = old == static_cast<unsigned long long>(p.num_ctas - 1);
    if (s.last) {
      // every CTA's rows (ordered by their fences and arrivals) before the signals, sent in a loop not unrolled (as
      // the count exchange's)
      device::arch::fence_acq_rel_sys();
#pragma unroll 1
      for (int d = 0; d < world; ++d) p.net.store_signal(d, p.layout.normal.data_signal + rank * sizeof(uint64_t), seq);
    }
  }
  __syncthreads();
}

// 6b. every source's rows (thread s waits for source s's signal; acquire). False (for the whole CTA) when a source
//     did not arrive or is out of step (recorded). (The hierarchical dispatch's too: Shared has ok.)
template <class Shared>
__device__ __forceinline__ bool wait_rows(DispatchParams const& p, Shared& s, uint64_t seq) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  if (tid < world) {
    uint64_t observed = 0;
    if (!device::wait_signal_geq_value(
            p.view, reinterpret_cast<uint64_t const*>(p.net.window(rank) + p.layout.normal.data_signal) + tid, seq, tid,
            WaitPhase::dispatch_data, &observed)) {
      s.ok = 0;
    } else if (observed != seq) {
      // the source's next call signals only after this rank's next count row: a later one means it is out of step
      device::record_out_of_step(p.view, tid, WaitPhase::dispatch_data, seq, observed);
      s.ok = 0;
    }
  }
  __syncthreads();
  return s.ok != 0;
}

// 7. the local pass over the received rows (every source's rows have landed: acquired by wait_rows), spread over the
//    grid: num_recv from the count rows first. (The hierarchical dispatch's too: Shared has ok and num_recv.)
template <WireFormat kFormat, class Shared>
__device__ __forceinline__ void run_recv_pass(DispatchParams const& p, Shared& s, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  if (tid == 0) {
    int32_t total = 0;
    for (int src = 0; src < world; ++src)
      total += count_value(
          device::arch::load_relaxed_sys_u64(count_word(p.net.window(rank), p.layout, parity, world, src, 1 + rank)));
    s.num_recv = total < p.recv_capacity ? total : p.recv_capacity;
  }
  __syncthreads();
  dispatch_recv_pass<kFormat>(p, s.num_recv);
}

template <typename IdxT, WireFormat kFormat, int kUnitElems>
__global__ void __launch_bounds__(kThreads, 1) dispatch_kernel(DispatchParams const p) {
  static_assert(sizeof(IdxT) == 4 || sizeof(IdxT) == 8, "topk_idx is int32 or int64");
  static_assert((kFormat == WireFormat::bf16) == (kUnitElems == 0), "bf16 rows are copied; quantized rows need a unit");
  extern __shared__ int32_t s_cnt[];  // [world] rows per destination, then [num_experts] entries per expert
  __shared__ DispatchShared s;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  CtaTokens const tokens = cta_tokens(p, cta);
  FERRY_TRACE_WARP(trace, p.trace);

  // 0. this call's sequence number (written by the previous call's last CTA; stream order makes it visible): loaded
  //    here and published to the CTA after the layout, whose loads and barriers cover its round trip (the layout
  //    waited for it behind a barrier)
  uint64_t const previous_seq = tid == 0 ? p.state->normal.dispatch_seq : 0;
  if (tid == 0) {
    s.ok = 1;
    s.bad = 0;
    s.aborted = 0;
  }
  for (int i = tid; i < world + p.num_experts; i += kThreads) s_cnt[i] = 0;
  __syncthreads();

  FERRY_TRACE_BEGIN(trace, dispatch_layout);
  dispatch_layout<IdxT>(p, s, s_cnt, tokens);  // 1.
  if (tid == 0) s.seq = previous_seq + 1;
  __syncthreads();
  uint64_t const seq = s.seq;
  int const parity = static_cast<int>(seq & 1);
  FERRY_TRACE_END(trace, dispatch_layout);

  FERRY_TRACE_BEGIN(trace, dispatch_grid_arrival);
  dispatch_grid_arrival(p, s, s_cnt);  // 2.
  FERRY_TRACE_END(trace, dispatch_grid_arrival);

  if (s.last_arrival) {
    FERRY_TRACE_BEGIN(trace, dispatch_count_exchange);
    send_count_row(p, s, s_cnt, seq, parity);  // 3.
    FERRY_TRACE_END(trace, dispatch_count_exchange);
  }

  // nvfp4: the token scales of this CTA's tokens, while the peers' counts are in flight
  if constexpr (kFormat == WireFormat::nvfp4) {
    if (p.x_scales == nullptr) nvfp4_token_scales(p, tokens.t0, tokens.t1, warp, lane);
  }

  FERRY_TRACE_BEGIN(trace, dispatch_wait_counts);
  if (!wait_count_rows(p, s, seq, parity)) return;  // 4.
  bool const aborted = s.aborted != 0;  // the same on every CTA of every rank: every rank read the same words
  destination_bases(p, s, parity, aborted);
  FERRY_TRACE_END(trace, dispatch_wait_counts);

  FERRY_TRACE_BEGIN(trace, dispatch_push);
  push_rows<IdxT, kFormat, kUnitElems>(p, s, tokens, aborted);  // 5.
  FERRY_TRACE_END(trace, dispatch_push);

  FERRY_TRACE_BEGIN(trace, dispatch_signal);
  signal_rows(p, s, seq);  // 6.
  FERRY_TRACE_END(trace, dispatch_signal);
  // without a receiver pass only the last CTA waits; with one, every CTA waits for every source's rows
  bool const recv_pass = kFormat != WireFormat::bf16 && p.recv_pass != RecvPass::none && !aborted;
  if (!s.last && !recv_pass) return;
  FERRY_TRACE_BEGIN(trace, dispatch_wait_data);
  if (!wait_rows(p, s, seq)) return;
  FERRY_TRACE_END(trace, dispatch_wait_data);

  if (recv_pass) {
    if constexpr (kFormat != WireFormat::bf16) run_recv_pass<kFormat>(p, s, parity);  // 7.
    if (!s.last) return;
    __syncthreads();
  }

  // 8. outputs: rows per source, num_recv, expert counts
  FERRY_TRACE_BEGIN(trace, dispatch_outputs);
  write_dispatch_outputs(p, p.net.window(rank), parity, aborted, s_cnt, s.total);
  __syncthreads();
  if (tid == 0) {
    // every CTA has passed both grid counters (it arrived at dispatch_done after dispatch_arrive): reset them
    p.state->normal.dispatch_arrive = 0;
    p.state->normal.dispatch_done = 0;
    p.state->normal.dispatch_seq = seq;
  }
  FERRY_TRACE_END(trace, dispatch_outputs);
}

}  // namespace ferry::cuda_ep
