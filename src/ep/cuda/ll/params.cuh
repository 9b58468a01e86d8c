// Low-latency mode of the cuda backend: its constants and its kernels' parts of the one Params family (params.cuh:
// the state words, the symmetric layout and KernelParams are shared with the normal-mode kernels), built and
// validated on the host by the launchers' to_params().
//
// Protocol (one kernel per leg; the send and receive halves are the same code compiled apart for the hook):
//  - Every rank launches the same fixed grid (num_ctas, agreed at construction), so a call adds exactly num_ctas to
//    each destination's arrival counter of this source. Counters only grow (seq * num_ctas after call seq), so a
//    captured graph replays with no reset, and a wait for call seq is satisfied by nothing older.
//  - Sequence numbers are per CTA (each CTA only touches its own word): no grid-wide step decides when a call ends.
//  - Landing zones alternate by parity (seq & 1): a fast peer may send call n+1 while this rank still reads call n,
//    never call n+2 (that needs this rank's send of n+1, which stream order puts after its receive of n). So an
//    arrival counter past (n + 1) * num_ctas while this rank waits for call n is an out-of-step error.
//  - Refusal: a source that refuses a leg (a bad or repeated id, or its host's refusal: no rows of its own) writes
//    the call's seq into its abort word on every rank (dispatch_abort / combine_abort, per parity, as the landing
//    zones) before its arrival; every receiver reads the abort words after its wait. A refused dispatch lands nothing
//    on any rank (no rows, no tokens left for the combine); a refused combine's y is no result. Each rank records the
//    refusal of every other rank that refused.
#pragma once

#include <cuda_bf16.h>

#include <cstddef>
#include <cstdint>
#include <type_traits>

#include "comm/device/bf16x8.cuh"
#include "comm/transport/group.cuh"
#include "core/rank_words.hpp"
#include "core/row_divider.hpp"
#include "ep/cuda/params.cuh"
#include "ep/cuda/wait_stats.cuh"
#include "ferry/device_view.hpp"
#include "ferry/ep.hpp"
#include "trace/trace_format.hpp"

namespace ferry::cuda_ll {

// The shared part of the family (params.cuh). 16 warps per CTA: one token (dispatch) or one row chunk (combine) per
// warp.
using cuda_ep::DeviceState;
using cuda_ep::KernelParams;
using cuda_ep::kThreads;
using cuda_ep::kWarps;
using cuda_ep::SymLayout;
using cuda_ep::thread_ids;
// Most CTAs of an LL grid (per-CTA sequence words are sized for it).
inline constexpr int kMaxCtas = cuda_ep::kMaxLlCtas;
// 16-byte vectors per lane in flight before the stores; a combine work item is one such step of a row.
inline constexpr int kUnroll = 4;
inline constexpr int kChunkVecs = 32 * kUnroll;

static_assert(kMaxTopk * 2 <= 32, "dispatch metadata is written by one warp: topk ids + topk weights, one per lane");
static_assert(kMaxCudaWorld <= 32, "one node's destination masks are one 32-bit word");
static_assert(kMaxWorld % kThreads == 0 || kThreads % kMaxWorld == 0,
              "a receive half's threads answer for whole rounds of sources");
static_assert(kMaxLsaTeam <= 32, "a node's ranks are one 32-bit word (the forward route's fwd_mask, the send sets)");

// What both low-latency legs share past KernelParams: the rank-major metadata the dispatch writes and the combine
// reads (local memory).
struct LlParams : KernelParams {
  int expert_slots;
  // [max_tokens][rank_words(world)] destination ranks of each token (for combine): rank d is bit d % 32 of word
  // d / 32 (one word on one node)
  uint32_t* token_mask;
  int32_t* recv_src;   // [world * max_tokens, 2] (source rank, source token), rank-major
  int32_t* recv_idx;   // [world * max_tokens, topk] local expert or -1
  float* recv_w;       // [world * max_tokens, topk]
  int32_t* recv_slot;  // [world * max_tokens, topk] slot within its expert or -1
  int local;           // ranks per node (world on one node): ranks of other nodes only through the network leg
  int nodes;           // 1 on one node
  bool forward;        // across nodes: the forward route (rows once per node, to the rail); else direct
  int32_t* fwd_num;    // forward: [nodes] tokens of each node's source this rail placed (Buffers::ll_fwd_num)
  uint32_t* fwd_mask;  // forward: [nodes, max_tokens] their local ranks here (Buffers::ll_fwd_mask)
  wait_stats::Slot*
      wait_stats;  // [kLegs][world] per-source waits of the receive halves (null: EpConfig::wait_stats off)
  // The halves this launch runs (kSendHalf | kRecvHalf: the one-kernel leg; one of them: the hook's). A runtime value,
  // so that a leg is one kernel symbol whether it runs once or as two launches (profilers find a leg by its name).
  uint32_t halves;
};

inline constexpr uint32_t kSendHalf = 1;
inline constexpr uint32_t kRecvHalf = 2;

// The areas of the symmetric region are SymLayout's low-latency part; the state words DeviceState's.
struct LlDispatchParams : LlParams {
  void const* x;  // bf16 rows, or the pre-quantized payload (x_scales set)
  // Pre-quantized input (a quantized dispatch_format): block scales [num_tokens, num_scales] row-major, nvfp4's
  // per-token scales [num_tokens]; null when x is bf16 (quantized by the send half).
  void const* x_scales;
  float const* x_token_scales;
  void const* topk_idx;
  float const* topk_weights;
  // token t reads row x_row(t) = t / x_repeat of x, x_scales and x_token_scales (DispatchArgs::x_repeat)
  ferry::detail::RowDivider x_row;
  // entry_group (capacity.hpp): x_repeat with topk 1, a group's entries one token's (ids distinct: group_repeat)
  int x_group;
  int num_tokens;
  int num_experts;
  int num_local_experts;
  int32_t* expert_counts;   // [num_local_experts]
  void* expert_x;           // [num_local_experts, expert_slots, expert_row_bytes] bf16 rows or wire payloads
  int32_t* expert_src_row;  // [num_local_experts, expert_slots] rank-major row, -1 past the count
  // bf16: [max_tokens, topk] the slot of this rank's own (token, k) entries (written by the send half's own
  // expansion, read by the receive half for their metadata; -1 past expert_capacity or not a local expert)
  int32_t* own_slot;
  bool own_direct;               // Buffers::own_direct
  std::size_t expert_row_bytes;  // EpConfig::recv_row_bytes(): hidden * 2, or the payload (quantized delivery)
  // Quantized dispatch_format: deliver bf16 rows dequantized from the wire (else payload + scales).
  bool dequantize;
  // Quantized delivery: one scale tensor of expert_slots rows per local expert in scale_layout, scale_tensor_bytes
  // apart (padding entries zeroed at construction, never written), and nvfp4's [num_local_experts, expert_slots]
  // per-token scales.
  ScaleLayout scale_layout;
  std::size_t scale_tensor_bytes;
  void* expert_scales;
  float* expert_token_scales;
};

struct LlCombineParams : LlParams {
  void const* x;  // expert-major [num_local_experts, expert_slots, hidden] or rank-major [num_recv, hidden]
  void* y;        // [num_tokens / group, hidden]
  // CombineArgs::group: y[u] is the weighted sum of tokens u * group + j (group_weights null: group 1, y[t] is t's)
  int group;
  float const* group_weights;
  // Refuse (as abort) when this rank's dispatch dropped an entry past expert_capacity (LlState::dropped_seq): set by
  // EpBuffer (Buffers::refuse_combine_after_drop); the kernel tests of the drops' sums leave it off.
  bool refuse_after_drop;
};

// This rank refuses the combine: its host said so (abort), or its dispatch dropped an entry past expert_capacity. A
// drop is seen by its receiver alone, and a lazy dispatch (a graph, the hook) returns before any host could know, so
// this refusal is what makes every rank's combine fail instead of summing without the entry (docs/errors.md,
// "Capacities"). Both words were written by the dispatch, earlier on the stream.
__device__ __forceinline__ bool combine_refused(LlCombineParams const& p) {
  return p.abort || (p.refuse_after_drop && p.state->ll.dropped_seq == p.state->ll.dispatch_recv_seq[0]);
}

// The ranks of other nodes. On one node the kernels take their Params alone (OneNode: nothing across nodes is
// compiled); across nodes, WithNetwork adds the network transport (Emulated on one host, Gin on a cluster) that
// reaches them. Through it a leg's send half puts what it staged in its own window (SymLayout::ll_send_*) and
// signals the same arrival counters as over NVLink, num_ctas per call and source, so the receive halves count alike.
struct OneNode {};
template <class Net>
inline constexpr bool kAcrossNodes = !std::is_same_v<Net, OneNode>;
template <class Base, class Net>
struct WithNetwork : Base {
  Net network;
};
template <class Base, class Net>
using NetParams = std::conditional_t<kAcrossNodes<Net>, WithNetwork<Base, Net>, Base>;
template <class Net, class P>
__device__ __forceinline__ decltype(auto) network_in(P const& p) {
  if constexpr (kAcrossNodes<Net>)
    return (p.network);
  else
    return OneNode{};
}

// Rank d is on this rank's node (reached by NVLink stores).
__device__ __forceinline__ bool same_node(LlParams const& p, int d) {
  return d / p.local == p.view.rank / p.local;
}

// Wider worlds. One node's kernels address at most kMaxCudaWorld ranks: a set of ranks is one 32-bit word and
// p.net (Lsa) holds every rank's window by world rank. Across nodes a world has up to kMaxWorld ranks, so there
//  - p.net holds this node's windows by local index (make_node_lsa): this node's rank d is window(d - first), with
//    first = view.rank - net.rank (near_window); this rank's own window is net.local();
//  - sets of this node's ranks are one word by local index (bit d - first), and what goes to the other nodes is
//    staged once (bit kStagedRow of the 64-bit send sets);
//  - a token's destinations (token_mask) are rank_words(world) words; shared arrays by source hold kMaxWorld.
// Rank masking's sets are words of 32 ranks too (LiveRanks, LlMaskWords::masked).
template <bool kNet>
inline constexpr int kMaxSources = kNet ? kMaxWorld : kMaxCudaWorld;
// The first rank of this rank's node (across nodes).
__device__ __forceinline__ int node_first(LlParams const& p) {
  return p.view.rank - p.net.rank;
}
template <bool kNet>
__device__ __forceinline__ char* near_window(LlParams const& p, int d) {
  if constexpr (kNet)
    return p.net.window(d - node_first(p));
  else
    return p.net.window(d);
}
template <bool kNet>
__device__ __forceinline__ char* own_window(LlParams const& p) {
  if constexpr (kNet)
    return p.net.local();
  else
    return p.net.window(p.view.rank);
}
// The j-th rank of the other nodes, j in [0, world - local).
__device__ __forceinline__ int remote_rank(LlParams const& p, int j) {
  int const first = p.view.rank / p.local * p.local;
  return j < first ? j : j + p.local;
}

// The receive halves' wait for the arrivals of a source of another node: through the network (a Gin's counters are
// GIN signals, not window words). Thread `s` of the CTA calls it for source s; the endpoint is the CTA's first
// warp's, idle by then (its send half closed it, or this is the hook's receive half).
template <class Net>
__device__ __forceinline__ bool wait_network(LlParams const& p, Net const& network, std::size_t counters, int s,
                                             uint64_t least, WaitPhase phase) {
  auto ep = network.open(transport::Thread{}, static_cast<int>(blockIdx.x) * kWarps);
  return ep.wait(p.view, counters + static_cast<std::size_t>(s) * sizeof(uint64_t), least, s, phase);
}

// Rank masking (EpConfig::rank_masking; ll/mask.cuh runs the agreement at each leg's entry, before its kernel): the
// ranks still in the calls, as the masked instances (kMasking) read them: ranks 0..31 from a register (one node's
// whole world), the others from the state's words. Without masking every rank is live and nothing is read.
template <bool kMasking>
struct LiveRanks {
  uint32_t word;           // ranks 0..31 still in the calls
  uint32_t const* masked;  // kMasking: LlMaskWords::masked
  __device__ __forceinline__ bool has(int d) const {
    if constexpr (kMasking)
      return d < 32 ? ((word >> d) & 1u) != 0 : ((masked[d >> 5] >> (d & 31)) & 1u) == 0;
    else
      return true;
  }
  // ranks 32 k .. 32 k + 31 still in the calls
  __device__ __forceinline__ uint32_t words(int k) const {
    if constexpr (kMasking)
      return k == 0 ? word : ~masked[k];
    else
      return 0xffffffffu;
  }
};
template <bool kMasking>
__device__ __forceinline__ LiveRanks<kMasking> live_ranks(KernelParams const& p) {
  if constexpr (kMasking)
    return LiveRanks<kMasking>{~p.state->ll.mask.masked[0], p.state->ll.mask.masked};
  else
    return LiveRanks<kMasking>{0xffffffffu, nullptr};
}
// This rank is masked: a masked instance returns at once (no row, no wait, no arrival; its peers skip it alike).
template <bool kMasking>
__device__ __forceinline__ bool masked_out(KernelParams const& p) {
  if constexpr (kMasking)
    return p.state->ll.mask.self != 0;
  else
    return false;
}
// Adds n entries of this rank's tokens whose expert's rank is masked to a leg's counts (this call's, and since the
// buffer was made or cleared). One thread per warp, only when n > 0: off the path of a call that masks nothing.
__device__ __forceinline__ void count_masked_entries(KernelParams const& p, detail::LlMaskLeg leg, unsigned n) {
  detail::LlMaskWords& m = p.state->ll.mask;
  bool const dispatch = leg == detail::LlMaskLeg::dispatch;
  atomicAdd(dispatch ? &m.last_dispatch_entries : &m.last_combine_entries, static_cast<unsigned long long>(n));
  atomicAdd(dispatch ? &m.dispatch_entries : &m.combine_entries, static_cast<unsigned long long>(n));
}

using device::bf16x8_to_float;
using device::float_to_bf16x8;

// 0. of an LL kernel: this CTA's sequence numbers of the halves it runs (LlParams::halves), into s_seq[0] (send) and
// s_seq[1] (receive), from its own words (no other CTA touches them; stream order carries them across calls). Every
// thread calls it.
__device__ __forceinline__ void next_sequences(uint32_t halves, uint64_t* send_seq, uint64_t* recv_seq,
                                               uint64_t (&s_seq)[2]) {
  int const cta = static_cast<int>(blockIdx.x);
  if (threadIdx.x == 0) {
    if (halves & kSendHalf) s_seq[0] = ++send_seq[cta];
    if (halves & kRecvHalf) s_seq[1] = ++recv_seq[cta];
  }
  __syncthreads();
}

}  // namespace ferry::cuda_ll
