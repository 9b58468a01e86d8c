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

#include "ep/cuda/ll/combine_common.cuh"
#include "ep/cuda/ll/combine_network.cuh"
#include "trace/device_trace.cuh"

namespace ferry::cuda_ll {

// Rank masking, the receive half's warp of token t's first chunk: counts its entries whose rank is masked now (y
// misses their expert outputs), from the ranks the dispatch kept (LlMaskWords::entry_rank).
__device__ __forceinline__ void count_combine_misses(LlCombineParams const& p, int t, int lane) {
  LiveRanks<true> const live = live_ranks<true>(p);
  int const d = lane < p.topk ? p.state->ll.mask.entry_rank[static_cast<std::size_t>(t) * p.topk + lane] : -1;
  unsigned const n = __popc(__ballot_sync(0xffffffffu, d >= 0 && !live.has(d)));
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
  bool const refused = combine_refused(p);
  // 1. the rows, into each source's landing zone (none when this rank refuses the call)
  FERRY_TRACE_BEGIN(trace, ll_combine_send);
  if (!refused) {
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
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);  // rank masking: nothing to a masked rank
  if constexpr (kNet) {
    // this node's ranks, thread l its l-th (the abort word first: the same thread's release add publishes it)
    if (tid < p.local && live.has(node_first(p) + tid)) {
      if (refused && blockIdx.x == 0)
        reinterpret_cast<uint64_t volatile*>(p.net.window(tid) + p.layout.ll.combine_abort)[parity * world + rank] =
            seq;
      p.net.add_signal(tid, p.layout.ll.combine_arrivals + rank * sizeof(uint64_t), 1);
    }
  } else {
    if (refused && blockIdx.x == 0)
      landing::publish_abort<!kMasking>(p.net, p.layout.ll.combine_abort, parity, world, rank, seq, live.word);
    if (tid < world && live.has(tid)) p.net.add_signal(tid, p.layout.ll.combine_arrivals + rank * sizeof(uint64_t), 1);
  }
  if constexpr (kNet && kMasking) {
    // rank masking across nodes runs the direct route (the backend refuses the forward one)
    ll_combine_send_network<kFormat, true>(p, network, parity, seq, refused);
  } else if constexpr (kNet) {
    if (p.forward) {
      // this rank's rows for the rails of its node are in (the same barrier orders them)
      if (tid < p.local) p.net.add_signal(tid, p.layout.ll.partial_arrivals + rank * sizeof(uint64_t), 1);
      ll_combine_rail<kFormat>(p, network, parity, seq, refused);
    } else {
      ll_combine_send_network<kFormat, false>(p, network, parity, seq, refused);
    }
  }
  FERRY_TRACE_END(trace, ll_combine_send_arrival);
}

// Sources (ranks) each thread of a receive half answers for: one on one node, two where a world across nodes has more
// ranks than a CTA has threads (kMaxWorld over kThreads).
template <bool kNet>
inline constexpr int kSourcesPerThread = (kMaxSources<kNet> + kThreads - 1) / kThreads;

// The abort words a thread of CTA 0 loaded in step 3 (its sources' of this parity), checked after the sum.
template <bool kNet>
struct AbortsSeen {
  uint64_t word[kSourcesPerThread<kNet>] = {};
};

// 3. every rank's send CTAs of this call (thread d waits for rank d, and d + kThreads; acquire, bounded). seen: CTA 0,
//    the abort words of the thread's sources, checked after the sum. False (the whole CTA) when a rank did not arrive
//    or is out of step (recorded).
template <bool kMasking, class Net>
__device__ __forceinline__ bool wait_combine_rows(LlCombineParams const& p, Net const& network, int& s_ok,
                                                  LiveRanks<kMasking> const& live, uint64_t seq, int parity,
                                                  AbortsSeen<kAcrossNodes<Net>>& seen) {
  constexpr bool kNet = kAcrossNodes<Net>;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  auto const own = [&] { return own_window<kNet>(p); };  // read where used (a register held across the wait costs)
  auto const abort_word = [&](int d) {
    return reinterpret_cast<uint64_t const volatile*>(own() + p.layout.ll.combine_abort)[parity * world + d];
  };
  if (tid == 0) s_ok = 1;
  __syncthreads();
  uint64_t const per_call = static_cast<uint64_t>(p.num_ctas);
  wait_stats::Slot* const stats = wait_stats::row(p.wait_stats, wait_stats::kCombine, world);
#pragma unroll
  for (int i = 0; i < kSourcesPerThread<kNet>; ++i) {
    int const d = tid + i * kThreads;
    if (d >= world || !live.has(d)) continue;
    auto const* arrivals = reinterpret_cast<uint64_t const*>(own() + p.layout.ll.combine_arrivals);
    uint64_t observed = 0;
    bool remote = false;
    if constexpr (kNet) remote = !same_node(p, d);
    if (remote) {
      // a rank of another node: through the network (no out-of-step check: its counter is the transport's); the
      // forward route hears only from each node's rail for this rank, which relays its node's refusals
      if constexpr (kNet) {
        if (!p.forward || d % p.local == rank % p.local) {
          if (!wait_stats::timed(stats, d, [&] {
                return wait_network(p, network, p.layout.ll.combine_arrivals, d, seq * per_call, WaitPhase::ll_combine);
              }))
            s_ok = 0;
          else if (cta == 0)
            seen.word[i] = abort_word(d);
        }
      }
    } else if (!wait_stats::timed(stats, d, [&] {
                 return device::wait_signal_geq_value(p.view, arrivals + d, seq * per_call, d, WaitPhase::ll_combine,
                                                      &observed);
               })) {
      s_ok = 0;
    } else if (observed > (seq + 1) * per_call) {
      device::record_out_of_step(p.view, d, WaitPhase::ll_combine, seq, observed / per_call);
      s_ok = 0;
    } else if (cta == 0) {
      // after the acquire; not waited for here (the barrier does not wait for loads in flight)
      seen.word[i] = abort_word(d);
    }
  }
  __syncthreads();
  if constexpr (kNet) {
    // the forward route: a rank of another node that is no rail here refused through its rail (relayed, after the
    // rail's wait above)
#pragma unroll
    for (int i = 0; i < kSourcesPerThread<kNet>; ++i) {
      int const d = tid + i * kThreads;
      if (p.forward && cta == 0 && d < world && !same_node(p, d) && d % p.local != rank % p.local)
        seen.word[i] = abort_word(d);
    }
  }
  return s_ok != 0;
}

// 4. the sum of a token's rows (a warp's chunk of them), destination ranks ascending, in fp32.
template <WireFormat kFormat, bool kMasking, bool kNet>
struct RowSum {
  LlCombineParams const& p;
  char const* landing;  // this call's landing zone
  WireRowLayout wl;
  LiveRanks<kMasking> live;
  int num_vec;

  // acc += the row of `token` from rank d (fp32; a quantized row dequantized first); weighted (std::true_type):
  // acc += w * row, the product rounded before the sum (CombineArgs::group)
  template <typename Weighted>
  __device__ __forceinline__ void add_row(int d, int token, int v0, float (&acc)[kUnroll][8], Weighted, float w) const {
    std::size_t const row_bytes = p.layout.ll.combine_row_bytes;
    char const* const row = landing + (static_cast<std::size_t>(d) * p.max_tokens + token) * row_bytes;
    if constexpr (kFormat == WireFormat::bf16 && !Weighted::value) {
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
        for (int j = 0; j < 8; ++j) acc[u][j] = __fadd_rn(acc[u][j], Weighted::value ? __fmul_rn(w, f[j]) : f[j]);
      }
    }
  }

  // The rows of `token` that come back, ranks ascending: on one node the ranks of `mask` (its destinations, live
  // ones); across nodes the words of its token_mask, where the forward route hears once from each other node that
  // holds it (from that node's rail for this rank) and from this node's ranks one by one.
  template <typename Weighted>
  __device__ __forceinline__ void add_rows(uint32_t mask, int token, int v0, float (&acc)[kUnroll][8],
                                           Weighted weighted, float w) const {
    if constexpr (kNet) {
      int const world = p.view.world;
      int const rank = p.view.rank;
      int const words = ferry::detail::rank_words(world);
      uint32_t const* const dests = p.token_mask + static_cast<std::size_t>(token) * words;
      auto const word = [&](int i) { return i < words ? dests[i] & live.words(i) : 0u; };
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
  }

  __device__ __forceinline__ void store_y(int row, int v0, float const (&acc)[kUnroll][8]) const {
    auto* y = static_cast<int4*>(p.y) + static_cast<std::size_t>(row) * num_vec;
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
      if (v0 + u * 32 < num_vec) device::arch::store_na_v4(y + v0 + u * 32, float_to_bf16x8(acc[u]));
  }
};

// 4, one row per token: items (token, chunk) over the grid. The first item's mask was loaded before the wait.
template <WireFormat kFormat, bool kMasking, bool kNet>
__device__ __forceinline__ void sum_tokens(RowSum<kFormat, kMasking, kNet> const& sum, int items, int num_chunks,
                                           int first_item, uint32_t first_mask) {
  LlCombineParams const& p = sum.p;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
  for (int item = cta * kWarps + warp; item < items; item += p.num_ctas * kWarps) {
    int const token = item / num_chunks;
    int const v0 = (item % num_chunks) * kChunkVecs + lane;
    uint32_t const mask = kNet ? 0u : item == first_item ? first_mask : p.token_mask[token] & sum.live.word;
    if constexpr (kMasking)
      if (item % num_chunks == 0) count_combine_misses(p, token, lane);
    float acc[kUnroll][8];
    device::zero_acc(acc);
    sum.add_rows(mask, token, v0, acc, std::false_type{}, 1.0f);
    sum.store_y(token, v0, acc);
  }
}

// 4, grouped (CombineArgs::group): y[u] = sum over j ascending of w(u * group + j) * (that token's row), no fma. The
// buffer has topk 1 (EpBuffer refuses a group otherwise), so a token's row comes from one rank (or its node's rail).
template <WireFormat kFormat, bool kMasking, bool kNet>
__device__ __forceinline__ void sum_groups(RowSum<kFormat, kMasking, kNet> const& sum, int num_tokens, int num_chunks) {
  LlCombineParams const& p = sum.p;
  auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);
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
      uint32_t const mask = kNet ? 0u : p.token_mask[token] & sum.live.word;
      if (!kNet && mask == 0) continue;  // went nowhere (or to a rank masked since): adds nothing, whatever its weight
      sum.add_rows(mask, token, v0, acc, std::true_type{}, __ldg(p.group_weights + token));
    }
    sum.store_y(out, v0, acc);
  }
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

  // The token count and the mask of this warp's first token, loaded before the wait (both written by the dispatch,
  // earlier on the stream): the sum then starts with its row loads, one round trip sooner.
  int const num_tokens = p.state->num_tokens;
  int const items = num_tokens * num_chunks;
  int const first_item = cta * kWarps + warp;
  // rank masking: a masked rank is not waited for, its rows not summed
  LiveRanks<kMasking> const live = live_ranks<kMasking>(p);
  // (across nodes a token's mask is several words, read where it is summed)
  uint32_t const first_mask = !kNet && first_item < items ? p.token_mask[first_item / num_chunks] & live.word : 0u;

  FERRY_TRACE_BEGIN(trace, ll_combine_wait_arrivals);
  AbortsSeen<kNet> seen;
  bool const arrived = wait_combine_rows<kMasking>(p, network, s_ok, live, seq, parity, seen);  // 3.
  if (!arrived || combine_refused(p)) return;  // a refusing rank has no y
  FERRY_TRACE_END(trace, ll_combine_wait_arrivals);

  FERRY_TRACE_BEGIN(trace, ll_combine_sum);
  std::size_t const row_bytes = p.layout.ll.combine_row_bytes;
  RowSum<kFormat, kMasking, kNet> const sum{p,
                                            own_window<kNet>(p) + p.layout.ll.combine_rows +
                                                static_cast<std::size_t>(parity) * world * p.max_tokens * row_bytes,
                                            wire::make_row_layout(kFormat, p.hidden), live, num_vec};
  if constexpr (!kGrouped)
    sum_tokens(sum, items, num_chunks, first_item, first_mask);  // 4.
  else
    sum_groups(sum, num_tokens, num_chunks);
  FERRY_TRACE_END(trace, ll_combine_sum);
#pragma unroll
  for (int i = 0; i < kSourcesPerThread<kNet>; ++i) {
    int const d = tid + i * kThreads;
    if (cta == 0 && d < world && d != rank && seen.word[i] == seq)
      device::record_refusal(p.view, d, WaitPhase::ll_combine);
  }
}

// kFormat: the combine_format.
// Net: OneNode, or the network to the ranks of other nodes (NetParams).
// kMasking: rank masking (leg::dispatch's rules; across nodes the direct route): a rank masked since the
// dispatch gets no rows and adds none to y, and the entries y misses are counted.
// kGrouped: the receive half sums groups of tokens with weights (CombineArgs::group; p.group_weights set).
// The symbol is ferry::cuda_ll::leg::combine<...> (leg::dispatch says why).
namespace leg {
template <bool kExpertMajor, WireFormat kFormat, class Net = OneNode, bool kMasking = false, bool kGrouped = false>
__global__ void __launch_bounds__(kThreads, 1) combine(NetParams<LlCombineParams, Net> const p) {
  __shared__ uint64_t s_seq[2];
  next_sequences(p.halves, p.state->ll.combine_send_seq, p.state->ll.combine_recv_seq, s_seq);
  if (masked_out<kMasking>(p)) return;
  FERRY_TRACE_WARP(trace, p.trace);
  decltype(auto) network = network_in<Net>(p);
  if (p.halves & kSendHalf)
    ll_combine_send<kExpertMajor, kFormat, kMasking>(p, network, s_seq[0] FERRY_TRACE_ARG(trace));
  if (p.halves & kRecvHalf) ll_combine_recv<kFormat, kMasking, kGrouped>(p, network, s_seq[1] FERRY_TRACE_ARG(trace));
}
}  // namespace leg

}  // namespace ferry::cuda_ll
