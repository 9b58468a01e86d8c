// The send side of a landing-zone dispatch, shared by low-latency mode (ll/dispatch.cuh) and normal mode's small
// batches (normal/land_dispatch.cuh): every source owns a fixed slot per token on every destination, so a sender needs no
// count exchange before its first NVLink write.
//  - a token's metadata record (its local expert ids on that rank, -1 elsewhere, and the weights) goes to EVERY rank,
//    so a receiver can scan a source's tokens in order and tell which rows it holds;
//  - its row goes only to the ranks holding one of its experts (wire de-duplication).
// The receiver reads a record's ids as 16-byte vectors into registers (load_record_ids): every CTA of a receive half
// reads every record, and 4-byte loads made those scans bound by L2 requests.
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/device/arch_sm90.cuh"
#include "comm/device/bits.cuh"
#include "comm/device/signal.cuh"
#include "comm/transport/lsa.cuh"
#include "ep/cuda/layout.hpp"
#include "ep/cuda/params.cuh"
#include "ep/cuda/wait_stats.cuh"
#include "ferry/device_view.hpp"
#include "ferry/ep.hpp"

namespace ferry::landing {

// 16-byte vectors per lane in flight when a receiver copies landed rows out of its landing zone (normal small
// batches, LL dispatch): such a copy moves a few rows per CTA, so its loads' round trips set its pace.
inline constexpr int kCopyUnroll = 8;

// Index of landing slot (source, token) in parity `parity` of a [2][world][max_tokens] area.
__device__ __forceinline__ std::size_t slot_index(int parity, int world, int source, int max_tokens, int token) {
  return (static_cast<std::size_t>(parity) * world + source) * static_cast<std::size_t>(max_tokens) + token;
}

// Bytes of one metadata record: topk int32 local ids, then topk float weights, 16-byte aligned (the ids are read as
// 16-byte vectors).
__host__ __device__ constexpr std::size_t record_bytes(int topk) {
  return cuda_ep::landing_record_bytes(topk);
}

// What a token's routing needs from the caller's inputs.
struct Routing {
  DeviceView view;
  void const* topk_idx;  // [num_tokens, topk] IdxT
  float const* topk_weights;
  int topk;
  int num_experts;
  int num_local_experts;
};

// Lane k < topk: the rank holding token t's k-th expert (-1 for a masked or bad id), its id in e and weight in w
// (warp-wide). A bad id (outside [-1, num_experts)) is dropped, and a valid id that a lower lane of the row holds too
// is a repeat; either sets `refused` on that lane (the caller refuses the call: its abort flag into the exchange)
// and, with `report`, is counted (input_errors: InputError at the next check).
template <typename IdxT>
__device__ __forceinline__ int token_destination(Routing const& r, int t, int lane, bool report, int64_t& e, float& w,
                                                 bool& refused) {
  auto const* topk_idx = static_cast<IdxT const*>(r.topk_idx);
  e = -1;
  w = 0.0f;
  bool bad = false;
  if (lane < r.topk) {
    e = static_cast<int64_t>(topk_idx[static_cast<std::size_t>(t) * r.topk + lane]);
    w = r.topk_weights[static_cast<std::size_t>(t) * r.topk + lane];
    bad = e < -1 || e >= r.num_experts;
  }
  int64_t const id = e;
  if (bad) e = -1;
  // a repeat: a valid id that a lower lane of the row holds too. Shuffles, not __match_any_sync: that takes one pass
  // per distinct key (32 here), about 1 us on the send's critical path at small batches.
  int32_t const key = e >= 0 ? static_cast<int32_t>(e) : -1;  // e < num_experts <= INT32_MAX
  bool repeat = false;
#pragma unroll
  for (int j = 1; j < kMaxTopk; ++j) {
    int32_t const lower = __shfl_up_sync(0xffffffffu, key, j);
    repeat |= lane >= j && key >= 0 && lower == key;
  }
  if (report && (bad || repeat)) device::record_bad_expert_id(r.view, id);
  refused = bad || repeat;
  return e >= 0 ? static_cast<int>(e) / r.num_local_experts : -1;
}

// The token's record to the ranks d in [begin, end) that keep(d) names, at record_at(d) (a char*) (warp-wide; dest,
// e, w as token_destination left them): lanes [0, topk) write the local ids, lanes [topk, 2 topk) the weights.
template <typename Keep, typename RecordAt>
__device__ __forceinline__ void write_records_where(int begin, int end, int topk, int num_local, int dest, int64_t e,
                                                    float w, int lane, Keep keep, RecordAt record_at) {
  int const k = (lane < topk ? lane : lane - topk) & 31;
  int const dest_k = __shfl_sync(0xffffffffu, dest, k);
  int const e_k = static_cast<int>(__shfl_sync(0xffffffffu, static_cast<long long>(e), k));
  float const w_k = __shfl_sync(0xffffffffu, w, k);
  for (int d = begin; d < end; ++d) {
    if (!keep(d)) continue;
    char* at = record_at(d);
    if (lane < topk)
      reinterpret_cast<int32_t*>(at)[lane] = dest_k == d ? e_k - d * num_local : -1;
    else if (lane < 2 * topk)
      reinterpret_cast<float*>(at)[lane] = dest_k == d ? w_k : 0.0f;
  }
}

// The token's record into every rank of a world of at most 32 (into slot `slot` of its record area at byte offset
// `meta`: write_records). to: the ranks that get it (rank masking: not the masked ones).
template <typename RecordAt>
__device__ __forceinline__ void write_records_at(int world, int topk, int num_local, int dest, int64_t e, float w,
                                                 int lane, RecordAt record_at, uint32_t to = 0xffffffffu) {
  write_records_where(
      0, world, topk, num_local, dest, e, w, lane, [&](int d) { return ((to >> d) & 1u) != 0; }, record_at);
}

__device__ __forceinline__ void write_records(transport::Lsa const& net, int world, std::size_t meta, std::size_t slot,
                                              std::size_t record, int topk, int num_local, int dest, int64_t e, float w,
                                              int lane, uint32_t to = 0xffffffffu) {
  write_records_at(
      world, topk, num_local, dest, e, w, lane, [&](int d) { return net.window(d) + meta + slot * record; }, to);
}

// Vectors [v_begin, v_end) of a bf16 row (src) to every destination d in `mask` (a 32- or 64-bit set,
// device/bits.cuh), at dst_of(d) (an int4* to the row's first vector there), warp-wide: kUnroll loads in flight per
// lane, then the stores to every destination.
template <int kUnroll, typename DstOf, typename Set>
__device__ __forceinline__ void send_row_chunk(int4 const* src, int v_begin, int v_end, Set mask, DstOf dst_of,
                                               int lane) {
  for (int i = v_begin + lane; i < v_end; i += 32 * kUnroll) {
    int4 v[kUnroll];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (i + u * 32 < v_end) v[u] = device::arch::load_nc_v4(src + i + u * 32);
    for (Set m = mask; m != 0; m &= m - 1) {
      int4* const dst = dst_of(device::lowest(m));
#pragma unroll
      for (int u = 0; u < kUnroll; ++u)
        if (i + u * 32 < v_end) device::arch::store_na_v4(dst + i + u * 32, v[u]);
    }
  }
}

// Receive side, every thread of the CTA: thread s < world waits until source s's arrival counter reaches
// seq * per_call (acquire, bounded; a counter past (seq + 1) * per_call holds a call this rank has not reached: the
// source is out of step, recorded), and reads its token count from tokens[s] and its abort word from aborts[s] (this
// call's parity; a source that refuses call seq writes seq there before its arrival). Then s_base[s] = the first
// landed record of source s (s_base[world] = all of them). Returns that total; 0 when a source refused the call (its
// bit in *s_aborted: every rank reads the same words, so every rank lands nothing; CTA 0 records each refusing peer
// in the error block, unless this rank refused the call itself); -1 for the whole CTA when a wait failed (recorded).
// *s_ok must be 1 and every word of s_aborted 0 on entry, set before a barrier. stats: the leg's row of the wait
// statistics (wait_stats.cuh; null: off). Sources of other nodes (low-latency mode across nodes): `remote.of(s)` says
// which, and their wait is `remote.wait(s, least)` (the network's), without the out-of-step check (a network counter is
// read only by the transport's wait). NoRemoteSources: every source is on this node. `remote.skip(s)`: source s is
// masked (rank masking): no wait, no rows, no abort word read.
struct NoRemoteSources {
  __device__ __forceinline__ bool of(int) const { return false; }
  __device__ __forceinline__ bool wait(int, uint64_t) const { return true; }
  __device__ __forceinline__ bool skip(int) const { return false; }
};
// Every source on this node, the masked ones skipped (rank masking: `live` has a bit per rank still in the calls).
struct LiveSources : NoRemoteSources {
  uint32_t live;
  __device__ __forceinline__ bool skip(int s) const { return ((live >> s) & 1u) == 0; }
};

// kMaxSources: the most sources (world ranks) the caller's shared arrays hold: s_base[kMaxSources + 1] and
// s_aborted[kMaxSources / 32] (a bit per source; one word for one node's kernels, kMaxWorld / 32 across nodes).
template <class Remote = NoRemoteSources, int kMaxSources = kMaxCudaWorld>
__device__ __forceinline__ int wait_sources(DeviceView const& view, uint64_t const* arrivals, uint64_t seq,
                                            uint64_t per_call, uint64_t const volatile* tokens,
                                            uint64_t const volatile* aborts, WaitPhase phase, int32_t* s_base,
                                            uint32_t* s_aborted, int* s_ok, wait_stats::Slot* stats = nullptr,
                                            Remote const& remote = {}) {
  static_assert(kMaxSources % 32 == 0, "a bit per source in whole words");
  constexpr int kWords = kMaxSources / 32;
  int const tid = static_cast<int>(threadIdx.x);
  int const world = view.world;
  // source s: its wait, token count and abort word (a thread per source; past kThreads sources, several each)
  auto const wait_source = [&](int s) {
    if (remote.skip(s)) {
      s_base[s + 1] = 0;
      return;
    }
    uint64_t observed = 0;
    if (remote.of(s)) {
      if (!wait_stats::timed(stats, s, [&] { return remote.wait(s, seq * per_call); })) *s_ok = 0;
    } else if (!wait_stats::timed(stats, s, [&] {
                 return device::wait_signal_geq_value(view, arrivals + s, seq * per_call, s, phase, &observed);
               })) {
      *s_ok = 0;
    } else if (observed > (seq + 1) * per_call) {
      device::record_out_of_step(view, s, phase, seq, observed / per_call);
      *s_ok = 0;
    }
    // both loads after the acquire and before either value is used: one round trip, not two
    uint64_t const num_tokens = tokens[s];
    uint64_t const abort_seq = aborts[s];
    s_base[s + 1] = static_cast<int32_t>(num_tokens);
    if (abort_seq == seq) {
      if constexpr (kWords == 1)
        atomicOr(s_aborted, 1u << s);
      else
        atomicOr(s_aborted + (s >> 5), 1u << (s & 31));
    }
  };
  if constexpr (kMaxSources <= cuda_ep::kThreads) {
    if (tid < world) wait_source(tid);
  } else {
    for (int s = tid; s < world; s += cuda_ep::kThreads) wait_source(s);
  }
  __syncthreads();
  if (!*s_ok) return -1;
  // once per call and refusing peer; a rank that refused the call itself records none (its own input error, or its
  // host's InputError, is the call's error: a peer's record would surface as a refusal of a later call)
  auto const bases = [&](bool aborted) {
    s_base[0] = 0;
    for (int s = 0; s < world; ++s) s_base[s + 1] = aborted ? 0 : s_base[s + 1] + s_base[s];
  };
  if constexpr (kWords == 1) {  // one node's kernels: one word, the code they compiled to before the wide path
    uint32_t const aborted_mask = *s_aborted;
    if (blockIdx.x == 0 && tid < world && tid != view.rank && ((aborted_mask >> tid) & 1u) != 0 &&
        ((aborted_mask >> view.rank) & 1u) == 0)
      device::record_refusal(view, tid, phase);
    if (tid == 0) bases(aborted_mask != 0);
  } else {
    auto const refused = [&](int s) { return ((s_aborted[s >> 5] >> (s & 31)) & 1u) != 0; };
    if (blockIdx.x == 0 && !refused(view.rank))
      for (int s = tid; s < world; s += cuda_ep::kThreads)
        if (s != view.rank && refused(s)) device::record_refusal(view, s, phase);
    if (tid == 0) {
      bool aborted = false;
      for (int w = 0; w < (world + 31) / 32; ++w) aborted |= s_aborted[w] != 0;
      bases(aborted);
    }
  }
  __syncthreads();
  return s_base[world];
}

// A sender's abort flag for call seq (a bad or repeated id in this CTA's tokens, or the host's refusal): thread
// d < world writes seq into destination d's abort word of this source and parity, before its arrival (whose release
// publishes it). Any CTA of the sender may write it: the receiver reads it once every CTA has arrived.
// kEvery false: only to the destinations of `to` (across nodes: this node's ranks; the network leg puts the word to
// the others).
template <bool kEvery = true>
__device__ __forceinline__ void publish_abort(transport::Lsa const& net, std::size_t aborts, int parity, int world,
                                              int rank, uint64_t seq, uint32_t to = 0xffffffffu) {
  int const tid = static_cast<int>(threadIdx.x);
  if (tid < world && (kEvery || ((to >> tid) & 1u) != 0))
    *(reinterpret_cast<uint64_t volatile*>(net.window(tid) + aborts) + parity * world + rank) = seq;
}

// A landed record's ids into registers, -1 past topk: 16-byte loads, all issued before any id is used (the record is
// 16-byte aligned and written by a peer during this kernel: coherent loads).
__device__ __forceinline__ void load_record_ids(int32_t const* record, int topk, int32_t (&ids)[kMaxTopk]) {
  static_assert(kMaxTopk % 4 == 0, "ids are loaded 4 at a time");
#pragma unroll
  for (int k = 0; k < kMaxTopk; ++k) ids[k] = -1;
#pragma unroll
  for (int q = 0; q < kMaxTopk / 4; ++q) {
    if (4 * q >= topk) break;
    int4 const v = device::arch::load_v4(reinterpret_cast<int4 const*>(record) + q);
    ids[4 * q] = v.x;
    ids[4 * q + 1] = 4 * q + 1 < topk ? v.y : -1;
    ids[4 * q + 2] = 4 * q + 2 < topk ? v.z : -1;
    ids[4 * q + 3] = 4 * q + 3 < topk ? v.w : -1;
  }
}

// Shared memory of scan_step: per-warp offsets, then the step's totals.
template <int kWarpsPerCta>
struct ScanShared {
  int32_t warp_rows[kWarpsPerCta];
  int32_t warp_hits[kWarpsPerCta];
  int32_t step_rows;
  int32_t step_hits;
};

// A thread's place in one step of a receiver's ordered scan (record base + thread, in (source, token) order).
struct ScanOffsets {
  int row;        // its row among the step's present records (meaningful when its record is present)
  int first_hit;  // the index of its first hit among the step's hits (kHits)
  int rows;       // the step's present records
  int hits;       // the step's hits (kHits)
};

// One step of the CTA-wide exclusive scan of (present, hits) in thread order that the receive halves run over the
// landed records: warp ballots (rows) and an inclusive warp scan (hits: the entries of the caller's expert, kHits),
// then one thread over the warps. Every thread of the CTA calls it (two barriers); the caller needs a barrier before
// the next step reuses `shared`.
template <bool kHits, int kWarpsPerCta>
__device__ __forceinline__ ScanOffsets scan_step(bool present, int hits, ScanShared<kWarpsPerCta>& shared, int warp,
                                                 int lane) {
  uint32_t const bits = __ballot_sync(0xffffffffu, present);
  int hits_incl = hits;
  if constexpr (kHits) {
#pragma unroll
    for (int offset = 1; offset < 32; offset <<= 1) {
      int const other = __shfl_up_sync(0xffffffffu, hits_incl, offset);
      if (lane >= offset) hits_incl += other;
    }
  }
  if (lane == 31) {
    shared.warp_rows[warp] = __popc(bits);
    shared.warp_hits[warp] = hits_incl;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    int rows = 0;
    int hit_sum = 0;
    for (int w = 0; w < kWarpsPerCta; ++w) {
      int const wr = shared.warp_rows[w];
      shared.warp_rows[w] = rows;
      rows += wr;
      if constexpr (kHits) {
        int const wh = shared.warp_hits[w];
        shared.warp_hits[w] = hit_sum;
        hit_sum += wh;
      }
    }
    shared.step_rows = rows;
    shared.step_hits = hit_sum;
  }
  __syncthreads();
  uint32_t const lower = (1u << lane) - 1u;
  return {shared.warp_rows[warp] + __popc(bits & lower), kHits ? shared.warp_hits[warp] + hits_incl - hits : 0,
          shared.step_rows, shared.step_hits};
}

}  // namespace ferry::landing
