// Normal-mode combine over NVLink: push, pipelined by token tiles.
//
// The grid splits in two roles that run at the same time:
//  - push CTAs take items (tile j of source s): the rows this rank received from s for s's tokens of tile j (found by
//    a 32-ary warp search: a source's rows are contiguous and in token order). Each row is reduced on the spot
//    (expert-major: acc = fmaf(w, x, acc) over k ascending, rounded to bf16; rank-major: the caller's row) and stored
//    straight into s's landing zone at [this rank][token] over NVLink. After the tile, one release flag on s.
//  - sum CTAs take this rank's tiles in order, wait for the flag of every rank, and write
//    y[t] = bf16(sum over d ascending of float(landing[d][t])) for the destinations d that hold t. After its first
//    tile a CTA claims the next piece from a per-call counter, and so does every push CTA done with its items
//    (CombineSums): the sums follow whichever side is ahead, and the last wave of tiles (one per sum CTA, whose flags
//    come with the last pushes) is cut into parts (a tile summed by one CTA took 10-13 us after the last push).
// A quantized combine_format changes only what a row is on the wire: the push side quantizes the bf16 partial row in
// registers as it produces it (device_unit_codec.cuh) and stores the wire row (payload, scales, nvfp4 token scale);
// the sum side dequantizes each rank's row to fp32 (code * scale, one product) and sums ranks in ascending order from
// +0.0f, rounding once to bf16. nvfp4 produces the row twice (its token scale is the row's amax), as its codec reads
// the row twice.
// Items go in tile order on both sides, so a source's first tiles complete while later ones are still in flight:
// the HBM-bound sum overlaps the NVLink-bound push instead of following it.
// Sequence numbers (DeviceState::combine_seq) make flags monotone (a flag is 2 * seq, + 1 when its sender refused the
// call); the landing zone alternates by parity because a fast peer may push call n+1 while this rank still sums call
// n (it cannot be two calls ahead: call n+1 needs this rank's flags of call n+1, so a flag of n+2 or later is an
// out-of-step error).
// Every rank pushes tile 0 to every source (empty when that source has no tokens) and waits every rank's tile 0, so
// a refusal reaches every rank, one with no tokens too. A rank that refuses the call (CombineParams::abort) pushes
// no rows: it writes its abort word (combine_abort, per parity: a flag of call n+1 may overwrite n's before a reader
// sees it, the abort word of n stays) on every peer, then fills every tile its sources wait for with 2 * seq + 1,
// and sums nothing. The reader of tile 0 takes the refusal from the flag, or, when the flag is already call n+1's,
// from the abort word (a load only then), and records it at the end: a refused call's y is not a result.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

#include "comm/device/bf16x8.cuh"
#include "comm/device/memory.cuh"
#include "comm/device/signal.cuh"
#include "ep/cuda/entry_reduce.cuh"
#include "ep/cuda/landing.cuh"  // publish_abort
#include "ep/cuda/normal/params.cuh"
#include "wire/device_unit_codec.cuh"
#include "wire/layout.hpp"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ep {

// 16-byte vectors per lane per step (8 bf16 each): loads in flight per entry before the arithmetic.
inline constexpr int kCombineUnroll = 4;
// Pause between polls of a claimed tile's flags (wait_signal_geq's sleep_ns).
inline constexpr unsigned kClaimPollSleepNs = 200;
// 16-byte bf16 vectors of output per lane per step of a quantized sum (its loads are the wire pieces of those units,
// from every rank of a pair).
inline constexpr int kSumUnroll = 6;

using device::bf16x8_to_float;
using device::float_to_bf16x8;

// Lane k < topk of a warp: entry k of expert-major row `row` (its expert output row in x and its weight), when this
// rank holds that expert and the entry has a slot; the rest of the warp holds none.
struct RowEntry {
  int4 const* entry = nullptr;
  float w = 0.0f;
  bool valid = false;
};

__device__ __forceinline__ RowEntry expert_entry(CombineParams const& p, int row, int lane, int num_vec) {
  RowEntry out;
  int const topk = p.topk;
  if (lane < topk) {
    int32_t const el = reinterpret_cast<int32_t const*>(p.net.local() + p.layout.normal.recv_idx)[row * topk + lane];
    int32_t const slot = p.recv_slot[row * topk + lane];
    out.valid = el >= 0 && slot >= 0;
    if (out.valid) {
      // dispatch_backward: the gradient of a dispatched row is summed unweighted
      out.w =
          p.unit_weights ? 1.0f : reinterpret_cast<float const*>(p.net.local() + p.layout.normal.recv_w)[row * topk + lane];
      out.entry = static_cast<int4 const*>(p.x) + (static_cast<std::size_t>(el) * p.expert_slots + slot) * num_vec;
    }
  }
  return out;
}

// Receiver side of vectors [v_begin, v_end) of one row, expert-major: the canonical fmaf chain over the row's local
// entries (k ascending). The step loop is the same on every lane (the reduction's shuffles need the whole warp).
__device__ __forceinline__ void reduce_expert_row(CombineParams const& p, int row, int4* dst, int lane, int v_begin,
                                                  int v_end) {
  int const num_vec = p.hidden / 8;
  auto const [entry, w, valid] = expert_entry(p, row, lane, num_vec);
  uint32_t const entries = __ballot_sync(0xffffffffu, valid);
  for (int i0 = v_begin; i0 < v_end; i0 += 32 * kCombineUnroll) {
    int const i = i0 + lane;
    float acc[kCombineUnroll][8];
    device::reduce_entries_step<kCombineUnroll>(entries, w, entry, i, v_end, acc);
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u)
      if (i + u * 32 < v_end) device::arch::store_na_v4(dst + i + u * 32, float_to_bf16x8(acc[u]));
  }
}

// Receiver side of one row with a quantized combine_format: the bf16 partial row (expert-major: the fmaf chain over
// the row's local entries, k ascending, rounded to bf16; rank-major: the caller's row) quantized unit by unit into its
// wire row at dst (padding not written: no one reads it).
template <bool kExpertMajor, WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void push_quantized_partial(CombineParams const& p, int row, uint8_t* dst, int lane) {
  using Codec = device::UnitCodec<kFormat, kUnitElems>;
  constexpr int kInFlight = kCombineUnroll / Codec::kVecs;  // units per lane per step: 4 vectors in flight per entry
  static_assert(kInFlight >= 1, "a unit is at most kCombineUnroll vectors");
  int const num_units = p.hidden / kUnitElems;
  int const num_vec = p.hidden / 8;
  WireRowLayout const wire = wire::make_row_layout(kFormat, p.hidden);

  // expert-major: lane k holds entry k's row and weight
  RowEntry const mine = kExpertMajor ? expert_entry(p, row, lane, num_vec) : RowEntry{};
  int4 const* const entry = mine.entry;
  float const w = mine.w;
  uint32_t const entries = __ballot_sync(0xffffffffu, mine.valid);
  auto const* const src_row = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec;

  // Rank-major: the caller's bf16 row, units base + f * 32 + lane (zeros past the row, not loaded).
  auto load_row = [&](int base, int4(&v)[kInFlight][Codec::kVecs]) {
    Codec::template load_units<kInFlight>(src_row, base, num_units, lane, v);
  };
  // The values of units base + f * 32 + lane (zeros past the row): the bf16 partial row, in fp32.
  auto values = [&](int base, float(&x)[kInFlight][kUnitElems]) {
    if constexpr (kExpertMajor) {
#pragma unroll
      for (int f = 0; f < kInFlight; ++f)
#pragma unroll
        for (int i = 0; i < kUnitElems; ++i) x[f][i] = 0.0f;
      // pipelined over the entries as reduce_expert_row: entry k+1's loads before entry k's arithmetic
      auto fetch = [&](uint32_t& m, float& wk, int4(&v)[kInFlight][Codec::kVecs]) {
        Codec::template load_units<kInFlight>(device::next_entry(m, w, entry, wk), base, num_units, lane, v);
      };
      uint32_t m = entries;
      if (m != 0) {
        float wk;
        int4 v[kInFlight][Codec::kVecs];
        fetch(m, wk, v);
        while (true) {
          bool const more = m != 0;  // the same for every lane
          float next_w = 0.0f;
          int4 next[kInFlight][Codec::kVecs];
          if (more) fetch(m, next_w, next);
#pragma unroll
          for (int f = 0; f < kInFlight; ++f) {
            float e[kUnitElems];
            Codec::unpack_bf16(v[f], e);
#pragma unroll
            for (int i = 0; i < kUnitElems; ++i) x[f][i] = __fmaf_rn(wk, e[i], x[f][i]);
          }
          if (!more) break;
          wk = next_w;
#pragma unroll
          for (int f = 0; f < kInFlight; ++f)
#pragma unroll
            for (int i = 0; i < Codec::kVecs; ++i) v[f][i] = next[f][i];
        }
      }
      // the partial row is bf16 (as with a bf16 combine_format), then quantized
#pragma unroll
      for (int f = 0; f < kInFlight; ++f)
#pragma unroll
        for (int i = 0; i < kUnitElems; ++i) x[f][i] = __bfloat162float(__float2bfloat16_rn(x[f][i]));
    } else {
      int4 v[kInFlight][Codec::kVecs];
      load_row(base, v);
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) Codec::unpack_bf16(v[f], x[f]);
    }
  };

  float token_scale = 0.0f;
  if constexpr (kFormat == WireFormat::nvfp4) {
    // first pass: the row's amax (the per-token scale enters every block scale)
    float amax = 0.0f;
    for (int base = 0; base < num_units; base += 32 * kInFlight) {
      float x[kInFlight][kUnitElems];
      values(base, x);
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) amax = fmaxf(amax, Codec::finite_amax(x[f]));
    }
    token_scale = Codec::token_scale_from_lane_amax(amax);
    if (lane == 0) *reinterpret_cast<float*>(dst + wire.token_scale_offset) = token_scale;
  }
  // scales of blocks that span several lanes go out 32 at a time (ScaleWindow), else each leader stores its own
  constexpr bool kWindowed = Codec::kLanesPerBlock > 1;
  auto store_scales = [&](std::size_t block, uint32_t scales) {
    Codec::store_scales(dst + wire.scales_offset + block * Codec::kTraits.scale_bytes, scales);
  };
  std::size_t const end_block = Codec::block_of(static_cast<std::size_t>(num_units));
  device::ScaleWindowFor<Codec, kInFlight> window(0);
  // rank-major: a software pipeline, the next step's loads issued before this step's conversions and stores (a warp
  // walking a row otherwise waited one memory round trip per step with nothing to do)
  int4 raw[kInFlight][Codec::kVecs];
  if constexpr (!kExpertMajor) load_row(0, raw);
  for (int base = 0; base < num_units; base += 32 * kInFlight) {
    float x[kInFlight][kUnitElems];
    if constexpr (kExpertMajor) {
      values(base, x);
    } else {
      int4 next[kInFlight][Codec::kVecs];
      load_row(base + 32 * kInFlight, next);  // past the row: no loads (zeros)
#pragma unroll
      for (int f = 0; f < kInFlight; ++f) Codec::unpack_bf16(raw[f], x[f]);
#pragma unroll
      for (int f = 0; f < kInFlight; ++f)
#pragma unroll
        for (int i = 0; i < Codec::kVecs; ++i) raw[f][i] = next[f][i];
    }
    uint32_t scales[kInFlight];
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      uint32_t payload[4];
      Codec::quantize(x[f], token_scale, payload, scales[f]);  // every lane: block reductions are shuffles
      int const u = base + f * 32 + lane;
      if (u < num_units) {
        Codec::store_piece(dst + static_cast<std::size_t>(u) * Codec::kPieceBytes, payload);
        if (!kWindowed && Codec::leader(lane)) store_scales(Codec::block_of(u), scales[f]);
      }
    }
    if constexpr (kWindowed) {
      if (window.take(base, scales, lane)) {
        window.flush(end_block, lane, store_scales);
        window.next();
      }
    }
  }
  if constexpr (kWindowed) window.flush(end_block, lane, store_scales);
}

// Stores the fp32 sums of elements [8 v, 8 v + 8) of a y row: rounded once to bf16, or (kFp32Out, dispatch_backward's
// fp32 gradient) as they are.
template <bool kFp32Out>
__device__ __forceinline__ void store_y_vector(void* y_row, std::size_t v, float const* acc) {
  if constexpr (kFp32Out) {
    auto* const dst = static_cast<int4*>(y_row) + 2 * v;
    device::arch::store_na_v4(
        dst, make_int4(__float_as_int(acc[0]), __float_as_int(acc[1]), __float_as_int(acc[2]), __float_as_int(acc[3])));
    device::arch::store_na_v4(dst + 1, make_int4(__float_as_int(acc[4]), __float_as_int(acc[5]), __float_as_int(acc[6]),
                                                 __float_as_int(acc[7])));
  } else {
    device::arch::store_na_v4(static_cast<int4*>(y_row) + v, float_to_bf16x8(acc));
  }
}

// Source side of one token with a quantized combine_format: y[t] = bf16(sum over d ascending in mask of
// dequantize(row_d)), the sum in fp32 from +0.0f. rows: the landing row of rank 0 for this token; rank d's is
// d * rank_stride bytes further; units [u_begin, u_end) of the row. Ranks go in pairs: both rows' pieces are loaded
// before either is added (one memory round trip per step and pair, where a rank at a time waited for each rank's loads
// in turn), and added in ascending rank order.
template <WireFormat kFormat, int kUnitElems, bool kFp32Out>
__device__ __forceinline__ void sum_quantized_token(CombineParams const& p, uint32_t mask, char const* rows,
                                                    std::size_t rank_stride, void* y, int u_begin, int u_end,
                                                    int lane) {
  using Codec = device::UnitCodec<kFormat, kUnitElems>;
  constexpr int kInFlight = kSumUnroll / Codec::kVecs;
  static_assert(kInFlight >= 1, "a unit is at most kSumUnroll vectors");
  WireRowLayout const wire = wire::make_row_layout(kFormat, p.hidden);
  // The pieces of units base + f * 32 of rank d's row (zeros past the row), and its nvfp4 token scale.
  auto load = [&](int d, int base, uint32_t(&payload)[kInFlight][4], uint32_t(&scales)[kInFlight], float& token_scale) {
    char const* const src = rows + static_cast<std::size_t>(d) * rank_stride;
    token_scale = 0.0f;
    if constexpr (kFormat == WireFormat::nvfp4)
      token_scale = *reinterpret_cast<float const*>(src + wire.token_scale_offset);
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const u = base + f * 32;
      scales[f] = 0;
      payload[f][0] = payload[f][1] = payload[f][2] = payload[f][3] = 0;
      if (u < u_end) {  // coherent loads: a peer wrote the row
        Codec::template load_piece<false>(src + static_cast<std::size_t>(u) * Codec::kPieceBytes, payload[f]);
        scales[f] = Codec::load_scales(src + wire.scales_offset + Codec::block_of(u) * Codec::kTraits.scale_bytes);
      }
    }
  };
  auto add = [&](int base, uint32_t const(&payload)[kInFlight][4], uint32_t const(&scales)[kInFlight],
                 float token_scale, float(&acc)[kInFlight][kUnitElems]) {
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      if (base + f * 32 >= u_end) continue;
      float v[kUnitElems];
      Codec::dequantize(payload[f], scales[f], token_scale, v);
#pragma unroll
      for (int i = 0; i < kUnitElems; ++i) acc[f][i] = __fadd_rn(acc[f][i], v[i]);
    }
  };
  for (int base = u_begin + lane; base < u_end; base += 32 * kInFlight) {
    float acc[kInFlight][kUnitElems];
#pragma unroll
    for (int f = 0; f < kInFlight; ++f)
#pragma unroll
      for (int i = 0; i < kUnitElems; ++i) acc[f][i] = 0.0f;
    for (uint32_t m = mask; m != 0;) {
      int const d0 = __ffs(m) - 1;
      m &= m - 1;
      int const d1 = m != 0 ? __ffs(m) - 1 : -1;
      if (d1 >= 0) m &= m - 1;
      uint32_t payload[2][kInFlight][4];
      uint32_t scales[2][kInFlight];
      float token_scale[2];
      load(d0, base, payload[0], scales[0], token_scale[0]);
      if (d1 >= 0) load(d1, base, payload[1], scales[1], token_scale[1]);
      add(base, payload[0], scales[0], token_scale[0], acc);
      if (d1 >= 0) add(base, payload[1], scales[1], token_scale[1], acc);
    }
#pragma unroll
    for (int f = 0; f < kInFlight; ++f) {
      int const u = base + f * 32;
      if (u >= u_end) continue;
#pragma unroll
      for (int i = 0; i < Codec::kVecs; ++i)
        store_y_vector<kFp32Out>(y, static_cast<std::size_t>(u) * Codec::kVecs + i, acc[f] + 8 * i);
    }
  }
}

// First row in [lo, hi) of the receive buffers whose source token is >= token (rows of one source ascend by token).
// Warp-wide, 32-ary: each step the lanes test 32 evenly spaced rows at once, so a range of n rows takes
// ceil(log32 n) dependent loads (2 at 128 rows) where a binary search took log2 n (7), each a memory round trip
// before the tile's first store.
__device__ __forceinline__ int lower_bound_token_warp(int2 const* recv_src, int lo, int hi, int token, int lane) {
  while (hi - lo > 32) {
    int const stride = (hi - lo + 31) / 32;
    int const i = lo + lane * stride;
    int const below = __popc(__ballot_sync(0xffffffffu, i < hi && recv_src[i].y < token));
    // rows lo + (below - 1) * stride (< token) and lo + below * stride (>= token, or past hi) bracket the answer
    int const next_hi = min(hi, lo + below * stride);
    lo = below == 0 ? lo : lo + (below - 1) * stride + 1;
    hi = next_hi;
  }
  int const i = lo + lane;
  return lo + __popc(__ballot_sync(0xffffffffu, i < hi && recv_src[i].y < token));
}

// Source side of tokens [t_begin, t_begin + tokens) of this rank, once every rank's rows of them have landed:
// y[t] = bf16(sum over the ranks d that hold t, ascending, of the landing row of d), in fp32. (token, chunk) items
// over the CTA's warps, so a few tokens still keep every warp busy. kFp32Out: y is fp32 (CombineParams::y_fp32).
template <WireFormat kFormat, int kUnitElems, bool kFp32Out>
__device__ __forceinline__ void sum_tokens(CombineParams const& p, int t_begin, int tokens, int parity, int warp,
                                           int lane) {
  int const world = p.view.world;
  int const num_vec = p.hidden / 8;
  std::size_t const landing_bytes = p.landing_row_bytes;
  char const* const landing = p.net.window(p.view.rank) + p.layout.normal.landing;
  // bf16 rows split by 16-byte vectors, wire rows by units
  int const row_items = kFormat == WireFormat::bf16 ? num_vec : p.hidden / (kUnitElems > 0 ? kUnitElems : 1);
  int const chunks = device::chunks_per_row(tokens, kWarps, row_items);
  for (int item = warp; item < tokens * chunks; item += kWarps) {
    int const t = t_begin + item % tokens;
    auto const [begin, end] = device::chunk_range(row_items, item / tokens, chunks);
    uint32_t const mask = p.token_mask[t];
    void* const y = static_cast<char*>(p.y) + static_cast<std::size_t>(t) * p.hidden * (kFp32Out ? 4 : 2);
    if constexpr (kFormat != WireFormat::bf16) {
      std::size_t const rank_stride = static_cast<std::size_t>(p.max_tokens) * landing_bytes;
      sum_quantized_token<kFormat, kUnitElems, kFp32Out>(
          p, mask, landing + (static_cast<std::size_t>(parity * world) * p.max_tokens + t) * landing_bytes, rank_stride,
          y, begin, end, lane);
    } else {
      for (int i = begin + lane; i < end; i += 32 * kCombineUnroll) {
        float acc[kCombineUnroll][8];
        device::zero_acc(acc);
        for (uint32_t m = mask; m != 0; m &= m - 1) {
          int const d = __ffs(m) - 1;
          device::add_bf16_vectors(
              reinterpret_cast<int4 const*>(
                  landing + (static_cast<std::size_t>(parity * world + d) * p.max_tokens + t) * landing_bytes),
              i, end, acc);
        }
#pragma unroll
        for (int u = 0; u < kCombineUnroll; ++u)
          if (i + u * 32 < end) store_y_vector<kFp32Out>(y, i + u * 32, acc[u]);
      }
    }
  }
}

// The sums of one piece of this rank's tokens, into y in its dtype (a uniform branch: each instance keeps its own
// store loop, the bf16 one unchanged).
template <WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void sum_piece(CombineParams const& p, SumPiece const& piece, int parity, int warp,
                                          int lane) {
  if (p.y_fp32)
    sum_tokens<kFormat, kUnitElems, true>(p, piece.begin, piece.end - piece.begin, parity, warp, lane);
  else
    sum_tokens<kFormat, kUnitElems, false>(p, piece.begin, piece.end - piece.begin, parity, warp, lane);
}

// What one CTA of combine_kernel keeps in shared memory.
struct CombineShared {
  uint64_t seq;
  int ok;
  int rows[2];
  int claim;
};

// Tiles rank s waits for from this rank: tile 0 always (every rank hears of a refusal), then one per tile of its
// tokens.
__device__ __forceinline__ int combine_tiles_of(int src_tokens) {
  return max(1, combine_num_tiles(src_tokens));
}

// Every rank's flag of this rank's tile j (acquire: its rows of the tile are visible after the barrier). Thread d of
// tile 0's reader learns whether rank d refused this call (refused_by). False (for the whole CTA) when a rank did not
// arrive or is out of step (recorded).
__device__ __forceinline__ bool wait_tile(CombineParams const& p, CombineShared& s, uint64_t seq, int parity, int j,
                                          unsigned sleep_ns, bool& refused_by) {
  int const world = p.view.world;
  int const rank = p.view.rank;
  int const tid = static_cast<int>(threadIdx.x);
  auto const* flags = reinterpret_cast<uint64_t const*>(p.net.window(rank) + p.layout.normal.tile_flags);
  auto const* aborts =
      reinterpret_cast<uint64_t const*>(p.net.window(rank) + p.layout.normal.combine_abort) + parity * world;
  if (tid < world) {
    uint64_t flag = 0;
    if (!device::wait_signal_geq_value(p.view, flags + tid * kMaxCombineTiles + j, 2 * seq, tid,
                                       WaitPhase::combine_data, &flag, sleep_ns)) {
      s.ok = 0;
    } else if ((flag >> 1) > seq + 1) {
      device::record_out_of_step(p.view, tid, WaitPhase::combine_data, seq, flag >> 1);
      s.ok = 0;
    } else if (j == 0) {
      // a flag of call seq + 1 replaced this call's: the abort word (written before any flag of this call or later,
      // so visible after the acquire) keeps this call's refusal
      refused_by = (flag >> 1) == seq ? (flag & 1) != 0 : device::arch::load_relaxed_sys_u64(aborts + tid) == seq;
    }
  }
  __syncthreads();
  return s.ok != 0;
}

// 1'. refusal (CTA 0): this rank's abort word on every peer (threads d < world), then every tile every source waits
//     for from this rank flagged 2 * seq + 1 (release: the barrier orders those words before every thread's flags)
__device__ __forceinline__ void combine_refuse(CombineParams const& p, uint64_t seq, int parity) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  landing::publish_abort(p.net, p.layout.normal.combine_abort, parity, world, rank, seq);
  __syncthreads();
  for (int src = 0; src < world; ++src)
    for (int j = tid; j < combine_tiles_of(p.state->src_tokens[src]); j += kThreads)
      p.net.store_signal(src, p.layout.normal.tile_flags + (rank * kMaxCombineTiles + j) * sizeof(uint64_t),
                         2 * seq + 1);
}

// 1. push role: items (tile j, source s) in tile order; sources rotated so ranks start on different peers. Each tile's
//    rows go into the source's landing zone, then its flag (release).
template <bool kExpertMajor, WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void combine_push_tiles(CombineParams const& p, CombineShared& s, uint64_t seq, int parity
                                                   FERRY_TRACE_PARAM(trace)) {
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  int const num_vec = p.hidden / 8;
  std::size_t const landing_bytes = p.landing_row_bytes;  // a row of the landing zone (the wire row)
  int max_tiles = 0;
  for (int src = 0; src < world; ++src) max_tiles = max(max_tiles, combine_tiles_of(p.state->src_tokens[src]));
  auto const* recv_src = reinterpret_cast<int2 const*>(p.net.window(rank) + p.layout.normal.recv_src);
  for (int q = cta; q < max_tiles * world; q += p.num_push_ctas) {
    int const j = q / world;
    int const src = (rank + 1 + q % world) % world;
    int const src_tokens = p.state->src_tokens[src];
    if (j >= combine_tiles_of(src_tokens)) continue;  // tile 0 of a source without tokens: no rows, only its flag
    FERRY_TRACE_BEGIN(trace, combine_push);
    int const tile = combine_tile_tokens(src_tokens);
    if (warp < 2) {  // warp 0: the tile's first row, warp 1: the row past its last
      int const first = p.state->src_offset[src];
      int const token = warp == 0 ? j * tile : min((j + 1) * tile, src_tokens);
      int const row = lower_bound_token_warp(recv_src, first, first + p.state->src_count[src], token, lane);
      if (lane == 0) s.rows[warp] = row;
    }
    __syncthreads();
    char* landing = p.net.window(src) + p.layout.normal.landing +
                    static_cast<std::size_t>(parity * world + rank) * p.max_tokens * landing_bytes;
    // items (row, chunk): a tile with fewer rows than warps splits each bf16 row into chunks, so every warp has bytes
    // in flight (a small batch is latency-bound: a warp per row left most of the CTA idle); quantized rows stay whole
    // (their codec works on whole rows)
    int const rows = s.rows[1] - s.rows[0];
    int const chunks = kFormat == WireFormat::bf16 ? device::chunks_per_row(rows, kWarps, num_vec) : 1;
    for (int item = warp; item < rows * chunks; item += kWarps) {
      int const row = s.rows[0] + item % rows;
      int const chunk = item / rows;
      auto const [v_begin, v_end] = device::chunk_range(num_vec, chunk, chunks);
      int const t = recv_src[row].y;
      auto* dst = reinterpret_cast<int4*>(landing + static_cast<std::size_t>(t) * landing_bytes);
      if constexpr (kFormat != WireFormat::bf16) {
        push_quantized_partial<kExpertMajor, kFormat, kUnitElems>(p, row, reinterpret_cast<uint8_t*>(dst), lane);
      } else if constexpr (kExpertMajor) {
        reduce_expert_row(p, row, dst, lane, v_begin, v_end);
      } else {
        auto const* x_row = static_cast<int4 const*>(p.x) + static_cast<std::size_t>(row) * num_vec;
        device::copy_16B<true, kCombineUnroll>(dst + v_begin, x_row + v_begin,
                                               static_cast<std::size_t>(v_end - v_begin) * 16, lane, 32);
      }
    }
    // NOTE: no per-thread fence (it would drain every thread's NVLink stores after each tile and stall the
    // pipeline): the barrier orders every thread's rows before thread 0's release, which is cumulative.
    __syncthreads();
    // release: every row of the tile (all threads, ordered by the barrier) before the flag
    if (tid == 0)
      p.net.store_signal(src, p.layout.normal.tile_flags + (rank * kMaxCombineTiles + j) * sizeof(uint64_t), 2 * seq);
    FERRY_TRACE_END(trace, combine_push);
  }
}

// 3. the rest of the sums, claimed in order by every CTA done with its own items, sum CTAs and push CTAs alike
//    (CombineSums): whole tiles, then the last wave in parts. Push CTAs whose items end early sum the tiles the sum
//    CTAs have not reached, and the last wave, whose flags come with the last pushes, is summed by many SMs at once
//    instead of by one CTA per tile. A claim ahead of the pushes polls its flags with pauses, so that dozens of
//    waiting CTAs do not load the memory system the pushes go through.
template <WireFormat kFormat, int kUnitElems>
__device__ __forceinline__ void sum_claimed_pieces(CombineParams const& p, CombineShared& s, CombineSums const& sums,
                                                   uint64_t seq, int parity,
                                                   bool& refused_by FERRY_TRACE_PARAM(trace)) {
  int const warp = static_cast<int>(threadIdx.x) >> 5;
  int const lane = static_cast<int>(threadIdx.x) & 31;
  while (s.ok && !p.abort && sums.num_claims() > 0) {
    if (threadIdx.x == 0) s.claim = static_cast<int>(atomicAdd(&p.state->normal.combine_claim, 1u));
    __syncthreads();
    int const claim = s.claim;
    if (claim >= sums.num_claims()) break;
    SumPiece const piece = combine_claimed(sums, claim);
    FERRY_TRACE_BEGIN(trace, combine_wait_tile);
    if (!wait_tile(p, s, seq, parity, piece.tile, kClaimPollSleepNs, refused_by)) break;
    FERRY_TRACE_END(trace, combine_wait_tile);
    FERRY_TRACE_BEGIN(trace, combine_sum);
    sum_piece<kFormat, kUnitElems>(p, piece, parity, warp, lane);
    __syncthreads();  // s.claim is rewritten only after every warp is done with this piece
    FERRY_TRACE_END(trace, combine_sum);
  }
}

template <bool kExpertMajor, WireFormat kFormat, int kUnitElems>
__global__ void __launch_bounds__(kThreads, 1) combine_kernel(CombineParams const p) {
  static_assert((kFormat == WireFormat::bf16) == (kUnitElems == 0), "bf16 rows are copied; quantized rows need a unit");
  __shared__ CombineShared s;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  FERRY_TRACE_WARP(trace, p.trace);

  // 0. this call's sequence number (written by the previous call's last CTA; stream order makes it visible)
  if (tid == 0) {
    s.seq = p.state->normal.combine_seq + 1;
    s.ok = 1;
  }
  __syncthreads();
  uint64_t const seq = s.seq;
  int const parity = static_cast<int>(seq & 1);
  CombineSums const sums = combine_sums(p.state->num_tokens, p.num_ctas - p.num_push_ctas);
  bool refused_by = false;  // thread d of tile 0's reader: rank d refused this call (recorded in step 4)

  if (p.abort) {
    if (cta == 0) combine_refuse(p, seq, parity);  // 1'.
  } else if (cta < p.num_push_ctas) {
    combine_push_tiles<kExpertMajor, kFormat, kUnitElems>(p, s, seq, parity FERRY_TRACE_ARG(trace));  // 1.
  } else if (int const j = cta - p.num_push_ctas; j < sums.first_claimed || (j == 0 && sums.num_tiles == 0)) {
    // 2. sum role: tile (cta - num_push_ctas) without a claim (a call of one wave of tiles needs none); without
    //    tokens the first sum CTA still waits for every rank's tile 0 (its flag may carry a refusal)
    FERRY_TRACE_BEGIN(trace, combine_wait_tile);
    if (wait_tile(p, s, seq, parity, j, 0, refused_by) && sums.num_tiles > 0) {
      FERRY_TRACE_END(trace, combine_wait_tile);
      FERRY_TRACE_BEGIN(trace, combine_sum);
      SumPiece const piece = combine_sum_tile(sums, j);
      sum_piece<kFormat, kUnitElems>(p, piece, parity, warp, lane);
      __syncthreads();  // the flags of the next piece are waited by tid < world only after every warp is done here
      FERRY_TRACE_END(trace, combine_sum);
    }
  }
  sum_claimed_pieces<kFormat, kUnitElems>(p, s, sums, seq, parity, refused_by FERRY_TRACE_ARG(trace));  // 3.

  // 4. tile 0's reader: the refusals of this call, unless this rank refused it too (its own is its host's InputError,
  //    and a peer's record would surface as a refusal of a later call); the last CTA advances the sequence (every CTA
  //    read it at step 0) and resets the arrival and claim counters
  FERRY_TRACE_BEGIN(trace, combine_finish);
  if (cta == p.num_push_ctas && tid < world && tid != rank && refused_by && !p.abort)
    device::record_refusal(p.view, tid, WaitPhase::combine_data);
  __syncthreads();
  if (tid == 0) {
    unsigned long long const old =
        atomicAdd(reinterpret_cast<unsigned long long*>(&p.state->normal.combine_done), 1ull);
    if (old == static_cast<unsigned long long>(p.num_ctas - 1)) {
      p.state->normal.combine_done = 0;
      p.state->normal.combine_claim = 0;  // every CTA has made its last claim
      p.state->normal.combine_seq = seq;
    }
  }
  FERRY_TRACE_END(trace, combine_finish);
}

}  // namespace ferry::cuda_ep
