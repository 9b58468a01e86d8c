// The Params family of the cuda backend's kernels (every protocol: normal push, normal landing, low-latency): the
// device state word block, the layout of the symmetric region, the part every kernel's Params shares (KernelParams,
// filled by one prologue, common_params in buffers.cu) and the normal-mode kernels' own parts. The low-latency parts
// derive from the same KernelParams in ll/params.cuh. Built and validated on the host by the launchers' to_params().
#pragma once

#include <cstddef>
#include <cstdint>

#include "comm/transport/lsa.cuh"
#include "ep/combine_tiles.hpp"
#include "ep/ll_mask_words.hpp"
#include "ferry/device_view.hpp"
#include "ferry/wire_format.hpp"
#include "trace/trace_format.hpp"

namespace ferry::cuda_ep {

// Threads per CTA of every kernel: 16 warps, enough 16-byte accesses in flight per SM for NVLink and HBM.
inline constexpr int kThreads = 512;
inline constexpr int kWarps = kThreads / 32;
// 16-byte vectors per lane loaded before the stores of one dispatch step (loads in flight per warp).
inline constexpr int kDispatchUnroll = 4;

// Dynamic shared memory of the dispatch kernel: one counter per destination and per global expert.
inline constexpr std::size_t kMaxDispatchSmem = 200 * 1024;
__host__ __device__ inline std::size_t dispatch_smem_bytes(int world, int num_experts) {
  return static_cast<std::size_t>(world + num_experts) * sizeof(int32_t);
}

// Small-batch dispatch (normal/land_dispatch.cuh): most CTAs of its grid (per-CTA sequence words), and what the CTAs of one
// source add to a destination's arrival counter per call, whatever the source's grid: CTA 0 adds
// kLandArrivalsPerCall - (ctas - 1), every other CTA 1.
inline constexpr int kMaxLandCtas = 256;
inline constexpr uint64_t kLandArrivalsPerCall = 1ull << 20;
// Most CTAs of a low-latency grid (its per-CTA sequence words are sized for it).
inline constexpr int kMaxLlCtas = 256;
// combine_backward's weight step (normal/weight_grad.cuh): what the CTAs of one rank add to a source's arrival counter per
// call, whatever the grid (CTA 0 adds kWeightGradArrivalsPerCall - (ctas - 1), every other CTA 1), and the CTAs of
// its wait kernel (few: 8 virtual ranks' waits on one GPU must leave SMs to the ranks still sending).
inline constexpr uint64_t kWeightGradArrivalsPerCall = kLandArrivalsPerCall;
inline constexpr int kWeightGradWaitCtas = 4;

// Device words of one EpBuffer (local memory, zeroed at construction), every protocol's. Sequence numbers live here,
// not on the host, so a captured graph replays with increasing sequence numbers and no reset kernel.
struct DeviceState {
  uint64_t dispatch_seq;              // sequence number of the last finished dispatch (the next one uses +1)
  uint64_t combine_seq;               // same for combine
  uint64_t dispatch_arrive;           // CTAs of the running dispatch that finished their layout (reset by the last CTA)
  uint64_t dispatch_done;             // CTAs of the running dispatch that finished pushing (reset by the last CTA)
  uint64_t combine_done;              // CTAs of the running combine that finished (reset by the last CTA)
  unsigned int combine_claim;         // the combine's sum pieces claimed so far (CombineSums; reset by the last CTA)
  int32_t num_recv;                   // rows received by the last dispatch (clipped to recv_capacity)
  int32_t num_tokens;                 // this rank's tokens in the last dispatch
  int32_t src_offset[kMaxCudaWorld];  // first row of source s in the receive buffers
  int32_t src_count[kMaxCudaWorld];   // rows of source s that were delivered
  int32_t src_tokens[kMaxCudaWorld];  // tokens source s passed to the last dispatch
  uint64_t land_seq[kMaxLandCtas];    // small-batch dispatch: calls this CTA ran (each CTA only touches its own)
  // Low-latency mode (ll/params.cuh), per CTA: calls whose send / receive half this CTA ran (num_tokens is written by
  // the send half's CTA 0, num_recv by the receive half's CTA of expert 0).
  uint64_t dispatch_send_seq[kMaxLlCtas];
  uint64_t dispatch_recv_seq[kMaxLlCtas];
  uint64_t combine_send_seq[kMaxLlCtas];
  uint64_t combine_recv_seq[kMaxLlCtas];
  // Normal mode, combine_backward's weight step (normal/weight_grad.cuh): the last call whose weight gradients this rank
  // collected (its wait kernel's last CTA advances it), and the CTAs of the running wait kernel that finished.
  uint64_t weight_grad_seq;
  uint64_t weight_grad_done;
  // Hierarchical normal mode: the records this rank (a rail) received from each source node in the last dispatch
  // (hier/dispatch.cuh; its combine sends one row back per record).
  int32_t hier_fwd_count[kMaxCudaWorld];
  // Hierarchical normal mode: what this rank sent to other ranks (EpBuffer::link_bytes, docs/internode.md "Counting
  // the bytes": rows and their metadata, not the control words), [leg: 0 dispatch, 1 combine][0 network bytes,
  // 1 NVLink bytes, 2 network puts of rows]: the running call's sums (its kernels add, its last kernel's last CTA
  // moves them) and the last finished call's.
  unsigned long long hier_bytes_running[2][3];
  unsigned long long hier_bytes[2][3];
  // Low-latency mode with rank masking (EpConfig::rank_masking; ll/mask.cuh): the mask and its counts (last: the
  // kernels without masking never read it, and every word above keeps its place).
  detail::LlMaskWords ll_mask;
};

// The words of DeviceState a normal-mode combine (and expand) reads of its dispatch, in their order there: what a
// dispatch handle keeps of them (normal/handle.cu). num_recv, num_tokens, src_offset, src_count, src_tokens.
inline constexpr int kHandleStateWords = 2 + 3 * kMaxCudaWorld;
static_assert(offsetof(DeviceState, num_tokens) == offsetof(DeviceState, num_recv) + 4 &&
                  offsetof(DeviceState, src_offset) == offsetof(DeviceState, num_recv) + 8 &&
                  offsetof(DeviceState, src_count) == offsetof(DeviceState, src_offset) + 4 * kMaxCudaWorld &&
                  offsetof(DeviceState, src_tokens) == offsetof(DeviceState, src_count) + 4 * kMaxCudaWorld,
              "a handle copies the layout words of DeviceState as one run of kHandleStateWords int32 words");

// Word 0 of a source's count row: its token count, and this bit when the source refuses the call (a bad or repeated
// id, or its host's refusal). A token count is below 2^31, so the bit never collides with one.
inline constexpr uint64_t kCountAbort = 1ull << 31;

// The hierarchical protocol (hier/dispatch.cuh): what the CTAs of one rank add to a rail's (or a source's) arrival
// counter per call, whatever the grid: warp 0 of the grid adds kHierArrivalsPerCall - (warps - 1), every other warp 1.
inline constexpr uint64_t kHierArrivalsPerCall = 1ull << 20;
// Most count-matrix columns of the hierarchical layout (world destination ranks + nodes).
inline constexpr int kMaxHierColumns = 64;

// A forwarded token's record (hier/dispatch.cuh), next to its row: int32 token, int32 rows[local] (its final row on
// each rank of the rail's node, -1: none), int32 ids[topk] (global, -1: none), float weights[topk]; 16-byte multiple.
__host__ __device__ inline std::size_t hier_record_bytes(int local, int topk) {
  return (static_cast<std::size_t>(1 + local + 2 * topk) * 4 + 15) / 16 * 16;
}

// Byte offsets inside the symmetric region (the same on every rank; make_sym_layout in buffers.cu). Each protocol takes
// its own areas; the areas of the other protocols stay empty (0).
struct SymLayout {
  // Normal mode (push and landing):
  std::size_t recv_x = 0;             // [recv_capacity, recv_row_bytes]: bf16 rows, or the quantized payload
  std::size_t recv_scales = 0;        // quantized delivery: [recv_capacity][num_scales] scale elements, row-major
  std::size_t recv_token_scales = 0;  // quantized nvfp4 delivery: [recv_capacity] float
  std::size_t recv_wire = 0;          // dispatch_dequantize: [recv_capacity, wire_row_bytes] wire rows landing
  std::size_t recv_idx = 0;           // [recv_capacity, topk] int32
  std::size_t recv_w = 0;             // [recv_capacity, topk] float
  std::size_t recv_src = 0;           // [recv_capacity, 2] int32
  std::size_t counts = 0;             // [2 parities][world sources][count_words] uint64, (seq << 32 | value);
                                      // word 0 also carries the source's abort flag (kCountAbort)
  std::size_t data_signal = 0;        // [world sources] uint64 = seq of the dispatch whose rows from that source landed
  std::size_t landing = 0;        // [2 parities][world senders][max_tokens, combine wire row]: combine rows coming back
  std::size_t combine_abort = 0;  // [2 parities][world senders] u64: seq of the sender's last refused combine (every
                                  // protocol)
  std::size_t tile_flags = 0;     // [world senders][kMaxCombineTiles] uint64 = 2 * seq of the combine that filled the
                                  // tile (+1: that sender refused the call and filled nothing)
  // Small-batch dispatch only (normal/land_dispatch.cuh; empty otherwise): every source's rows land in fixed slots
  // (parity, source, token) and the receiver compacts them into recv_x.
  std::size_t land_arrivals = 0;  // [world sources] u64: sum over calls of kLandArrivalsPerCall
  std::size_t land_tokens = 0;    // [2 parities][world sources] u64: tokens of the source's call
  std::size_t land_abort = 0;     // [2 parities][world sources] u64: seq of the source's last refused call (abort)
  std::size_t land_meta = 0;      // [2][world][max_tokens] records (landing::record_bytes(topk) each)
  std::size_t land_rows = 0;      // [2][world][max_tokens] bf16 rows
  // combine_backward's weight step (normal/weight_grad.cuh), normal mode: the dots of this rank's entries come back from the
  // ranks holding their experts (each entry has one such rank, so no sender dimension).
  std::size_t weight_grad = 0;           // [2 parities][max_tokens][topk] u64: (seq << 32 | fp32 bits)
  std::size_t weight_grad_arrivals = 0;  // [world senders] u64: sum over calls of kWeightGradArrivalsPerCall
  int count_words = 0;  // 1 (tokens) + world (rows per destination) + num_local_experts (entries per expert)
                        // (+ nodes: tokens per node, rounded up to an even count, in the hierarchical protocol)
  // Hierarchical normal mode only (hier/dispatch.cuh, hier/combine.cuh; empty otherwise). The rail of node n for a
  // rank s of another node is rank n * local + local_of(s). Counters only grow (the network has no remote "set").
  std::size_t hier_count_send = 0;    // [world destinations][count_words] u64: this rank's count rows (put sources)
  std::size_t hier_count_signal = 0;  // [world sources] u64 counter: +1 per dispatch (its count row is in `counts`)
  std::size_t hier_send_rows = 0;     // [max_tokens] wire rows of this rank's tokens bound for another node
  std::size_t hier_send_meta = 0;     // [nodes][max_tokens] forward records (HierRecord) per destination node
  std::size_t hier_fwd_rows = 0;      // [nodes sources][max_tokens] rows the rail received, compact per source node
  std::size_t hier_fwd_meta = 0;      // [nodes sources][max_tokens] their records (kept for the combine)
  std::size_t hier_fwd_signal = 0;    // [nodes sources] u64 counter: kHierArrivalsPerCall per dispatch
  std::size_t hier_partials = 0;      // [2 parities][nodes sources][local][max_tokens] bf16 rows to the rail
  std::size_t hier_combine_send = 0;  // [nodes][max_tokens] combine wire rows the rail puts (sources)
  std::size_t hier_arrive = 0;        // [world senders] u64 counter: +1 per combine (rows and abort word are in)
  std::size_t hier_abort = 0;         // [2 parities][world senders] u64: seq if the sender refused that call, else 0
  std::size_t hier_rail_signal = 0;   // [world rails] u64 counter: kHierArrivalsPerCall per combine
  // The counters above that the network signals (count, fwd, arrive, rail: adjacent, in that order), the GIN
  // transport's signal range; the own node's sources signal the same words by NVLink stores.
  std::size_t hier_signals = 0;
  uint32_t hier_num_signals = 0;
  std::size_t hier_meta_bytes = 0;  // one forward record (hier_record_bytes)
  int nodes = 1;
  int local = 0;  // ranks per node (the hierarchical protocol; 0 otherwise)
  // Low-latency mode (ll/params.cuh); "source" is the sending rank:
  std::size_t dispatch_arrivals = 0;   // [world sources] u64: send CTAs of that source finished, over all calls
  std::size_t combine_arrivals = 0;    // [world sources] u64
  std::size_t dispatch_tokens = 0;     // [2 parities][world sources] u64: tokens of the source's call
  std::size_t dispatch_abort = 0;      // [2 parities][world sources] u64: seq of the source's last refused dispatch
  std::size_t dispatch_meta = 0;       // [2][world][max_tokens] records: topk int32 local ids, topk float weights
  std::size_t dispatch_rows = 0;       // [2][world][max_tokens] dispatch wire rows, row t of source s at (s, t)
  std::size_t combine_rows = 0;        // [2][world][max_tokens] combine wire rows, the row rank d sends back at (d, t)
  std::size_t meta_bytes = 0;          // bytes of one record (topk * 8, 16-byte aligned)
  std::size_t dispatch_row_bytes = 0;  // wire_row_bytes(dispatch_format, hidden) (bf16: hidden * 2)
  std::size_t combine_row_bytes = 0;   // wire_row_bytes(combine_format, hidden)
  // Low-latency mode across nodes only (nodes > 1; empty otherwise): what the ranks of other nodes get is written
  // here first and put from here (the network reads its sources from the window), by parity as the landing zones.
  std::size_t ll_send_rows = 0;     // [2][max_tokens] dispatch wire rows of this rank's tokens bound for other nodes
  std::size_t ll_send_meta = 0;     // [2][world destinations][max_tokens] records for the ranks of other nodes
  std::size_t ll_combine_send = 0;  // [2][world * max_tokens] combine wire rows, by rank-major row, for other nodes
  // The forward route (EpConfig::route() == forward): a row crosses the network once per node, to the rank of the
  // source's local index there (its rail), which places it over NVLink; the combine reduces per node at the rail.
  std::size_t ll_fwd_rows = 0;          // [2][nodes sources][max_tokens] dispatch wire rows the rail received
  std::size_t ll_fwd_meta = 0;          // [2][nodes][max_tokens] their records: topk global ids, topk weights
  std::size_t ll_fwd_tokens = 0;        // [2][nodes] u64: tokens of that node's source of the call
  std::size_t ll_fwd_abort = 0;         // [2][nodes] u64: seq of that source's last refused dispatch
  std::size_t ll_fwd_arrivals = 0;      // [nodes] u64 counter: num_ctas per call from that node's source
  std::size_t ll_partials = 0;          // [2][nodes][local senders][max_tokens] bf16 combine rows to this rail
  std::size_t ll_partial_arrivals = 0;  // [world senders] u64 counter: num_ctas per combine from each node-mate
  std::size_t ll_rail_send = 0;         // [2][nodes][max_tokens] the rail's reduced combine wire rows (put sources)
  // dispatch_arrivals, combine_arrivals, ll_fwd_arrivals, adjacent (the GIN transport's signal range); the words the
  // own node signals by NVLink stores are window words there.
  std::size_t ll_signals = 0;
  uint32_t ll_num_signals = 0;
  std::size_t total = 0;
};

// Who a thread of an EP kernel is: its rank's place in the world, and its own in the grid (every kernel starts with
// these six numbers; `auto const [world, rank, tid, lane, warp, cta] = thread_ids(p.view);`).
struct ThreadIds {
  int world;
  int rank;
  int tid;
  int lane;
  int warp;
  int cta;
};

__device__ __forceinline__ ThreadIds thread_ids(DeviceView const& view) {
  int const tid = static_cast<int>(threadIdx.x);
  return ThreadIds{view.world, view.rank, tid, tid & 31, tid >> 5, static_cast<int>(blockIdx.x)};
}

// What every kernel's Params holds (one prologue fills it: common_params in buffers.cu).
struct KernelParams {
  DeviceView view;     // rank, world, the wait bound, the error block
  transport::Lsa net;  // every rank's symmetric region, reached through the transport seam
  SymLayout layout;
  DeviceState* state;
  // This rank refuses the call (EpBackendImpl::refuse_dispatch / refuse_combine): it joins the exchange with its
  // abort flag and moves no rows of its own (a refused dispatch has num_tokens 0; a refused combine reads no x or y).
  bool abort;
  int hidden;
  int topk;
  int max_tokens;          // max_tokens_per_rank
  int num_ctas;            // the launch's grid
  trace::TraceView trace;  // in-kernel trace of this launch (empty unless a FERRY_TRACE build has tracing enabled)
};

// Where the pieces of a quantized dispatch row land on its destination: byte offsets inside the symmetric region of
// row 0 and strides per row. Quantized delivery: the payload in recv_x, the scales in recv_scales (row-major), the
// token scale in recv_token_scales; dispatch_dequantize: all three inside the wire row of recv_wire.
struct QuantDst {
  std::size_t payload = 0;
  std::size_t payload_stride = 0;
  std::size_t scales = 0;
  std::size_t scales_stride = 0;
  std::size_t token = 0;
  std::size_t token_stride = 0;
};

// What the dispatch receiver does after every row has landed (a local pass, inside the dispatch kernel).
enum class RecvPass : int {
  none,        // bf16, or quantized delivery with row-major scales: the senders wrote the final places
  relayout,    // quantized delivery in another scale layout: row-major scales -> recv_scale_layout
  dequantize,  // dispatch_dequantize: wire rows -> bf16 recv_x
};

struct DispatchParams : KernelParams {
  void const* x;  // bf16 rows, or (pre-quantized) the payload rows [num_tokens, payload_bytes]
  // Quantized dispatch_format (the kernel's kFormat) only:
  void const* x_scales;         // pre-quantized: [num_tokens][num_scales] scale elements (null: quantize x)
  float const* x_token_scales;  // pre-quantized nvfp4: [num_tokens]
  float* token_scales;          // nvfp4 quantized here: [max_tokens] each token's scale (written and read by its CTA)
  QuantDst qdst;
  RecvPass recv_pass;
  ScaleLayout scale_layout;  // of recv_scales_final (relayout)
  void* recv_scales_final;   // relayout: the scale tensor of recv_capacity rows in scale_layout (local memory)
  void const* topk_idx;
  float const* topk_weights;
  int num_tokens;
  int num_experts;
  int num_local_experts;
  int recv_capacity;
  uint32_t* token_mask;    // [max_tokens] destinations of each token (kept for combine)
  int32_t* token_pos;      // [max_tokens, world] position of the token within this CTA's rows for a destination
  int32_t* block_counts;   // [num_ctas, world] per-CTA rows per destination
  int32_t* count_totals;   // [world + num_experts + 1] rows per destination, entries per expert, and CTAs whose layout
                           // found a bad or repeated id: the CTAs add theirs, the last to arrive reads and zeroes them
  int32_t* expert_counts;  // [num_local_experts] output
};

struct ExpandParams : KernelParams {
  char* sym_local;        // this rank's symmetric region (expand reads only local memory)
  std::size_t row_bytes;  // bytes of one row of recv_x / expert_x (EpConfig::recv_row_bytes)
  // Quantized delivery (format != bf16): the scales and nvfp4 token scales of each slot, from the row-major
  // recv_scales and recv_token_scales into one scale tensor of expert_slots rows per expert.
  WireFormat format;
  ScaleLayout scale_layout;
  std::size_t expert_scale_bytes;  // scale_tensor_bytes(format, scale_layout, expert_slots, hidden)
  void* expert_scales;             // [num_local_experts] tensors of expert_scale_bytes
  float* expert_token_scales;      // nvfp4: [num_local_experts, expert_slots]
  int num_local_experts;
  int expert_slots;
  int32_t* recv_slot;  // [recv_capacity, topk]
  void* expert_x;      // [num_local_experts, expert_slots, row_bytes] (copy only)
  // copy only: fill expert_src_row but leave the rows to combine_backward's weight step (normal/weight_grad.cuh), which writes
  // each slot scaled from its row in recv_x: one pass over the slots instead of a copy and a pass in place
  bool skip_rows;
  int32_t* expert_src_row;  // [num_local_experts, expert_slots] (copy only)
};

// A refused combine (abort) pushes no rows and fills every tile its sources wait for with its abort flag.
struct CombineParams : KernelParams {
  void const* x;  // expert-major [num_local_experts, expert_slots, hidden] or rank-major [num_recv, hidden]
  void* y;        // [num_tokens, hidden]
  std::size_t landing_row_bytes;  // wire_row_bytes(combine_format, hidden): one row of the landing zone (max_tokens
                                  // rows per sender)
  int expert_slots;
  int num_push_ctas;
  uint32_t const* token_mask;
  int32_t const* recv_slot;
  // dispatch_backward (combine_unweighted): expert-major entries take the weight 1 instead of recv_w
  // (fmaf(1, g, acc) == acc + g), and y is fp32 [num_tokens, hidden] (the source's sum, not rounded).
  bool unit_weights;
  bool y_fp32;
};

// The copy of a dispatch's layout into a handle's storage or back (normal/handle.cuh): areas of 4-byte words (7 of the
// one-node layout, the saved weights, 3 of the hierarchical protocol; room to spare).
inline constexpr int kMaxHandleAreas = 12;
struct HandleArea {
  void const* src;
  void* dst;
  int words_per_row;
  int rows;      // fixed rows, or (counted) at most this many
  bool counted;  // rows = min(*p.num_rows, rows): the received rows of the layout
};
struct HandleCopyParams {
  HandleArea areas[kMaxHandleAreas];
  int num_areas;
  int32_t const* num_rows;  // the layout's received rows: DeviceState::num_recv (save) or the handle's copy (restore)
  // save: the dispatch's ids [num_ids] (int32, or int64 with ids_64) into the handle as int32; widen (copy_received):
  // int32 ids into int64 ones
  void const* ids;
  bool ids_64;
  bool widen;
  void* ids_dst;
  int num_ids;
};

// combine_backward's weight step (normal/weight_grad.cuh), after the cached expert-major dispatch of grad_y.
struct WeightGradParams : KernelParams {
  void const* x;             // the forward combine's expert outputs [num_local_experts, expert_slots, hidden] (null:
                             // no dots: every entry sends 0)
  void* expert_x;            // out: bf16_rn(w * grad_y) per filled slot (grad_y read from the row in recv_x)
  int32_t const* recv_slot;  // [recv_capacity, topk]
  int num_local_experts;
  int expert_slots;
  float* grad_w;   // [num_tokens, topk] this rank's weight gradients (null: none written)
  int num_tokens;  // this rank's tokens in the handle's dispatch
};

}  // namespace ferry::cuda_ep
