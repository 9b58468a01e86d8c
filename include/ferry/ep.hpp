// Expert-parallel dispatch and combine. See docs/design.md "Semantics": one contract for every backend and mode.
//
// Threading and streams: an EpBuffer belongs to one host thread. On the cuda backend every call is enqueued on the
// given stream (work is asynchronous unless `eager`); on the cpu backend calls run synchronously and stream must be
// null. Outputs are views of buffers the EpBuffer owns; they stay valid until the next dispatch on the same buffer.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "ferry/communicator.hpp"
#include "ferry/limits.hpp"
#include "ferry/mode.hpp"
#include "ferry/trace.hpp"
#include "ferry/tuning.hpp"
#include "ferry/wire_format.hpp"

namespace ferry {

// How low-latency rows reach the ranks of other nodes (docs/internode.md): forward: once per destination node, to
// the rank of the source's local index there, which forwards them over NVLink (and combine reduces each node's rows
// first, as normal mode always does); direct: one put per (token, remote rank), combine summing the ranks as on one
// node; automatic: direct when max_tokens_per_rank <= kDirectRouteTokens, else forward (the cost model's rule).
enum class InternodeRoute { automatic, forward, direct };
char const* internode_route_name(InternodeRoute route);
InternodeRoute parse_internode_route(std::string const& name);  // "automatic" | "forward" | "direct"
inline constexpr int kDirectRouteTokens = 2;

// The most tokens per rank low-latency mode accepts: its buffers are sized for the worst case (every token of every
// rank to every local expert), which past this is better served by normal mode.
inline constexpr int kMaxLowLatencyTokens = 1024;

// The shape of one MoE layer's communication. Validated once by validate(); EpBuffer's constructor calls it.
struct EpConfig {
  int hidden = 7168;               // elements per row
  int num_experts = 256;           // global experts, split evenly over ranks
  int topk = 8;                    // experts per token (columns of topk_idx)
  int max_tokens_per_rank = 4096;  // most tokens any rank passes to one dispatch
  // How rows travel (include/ferry/wire_format.hpp, docs/quant.md). A quantized dispatch_format quantizes on send
  // (or forwards pre-quantized input, DispatchArgs::x_scales) and delivers the quantized rows with their scales, or,
  // with dispatch_dequantize, bf16 rows. A quantized combine_format sends the partial sums quantized; the source
  // dequantizes them and accumulates in fp32. Every format is accepted for both legs.
  WireFormat dispatch_format = WireFormat::bf16;
  WireFormat combine_format = WireFormat::bf16;
  // Quantized dispatch_format only: deliver bf16 rows (dequantized by the receiver) instead of payload + scales.
  bool dispatch_dequantize = false;
  // Quantized delivery only: the layout of recv_scales / expert_scales (scale_layout_supported must hold).
  ScaleLayout recv_scale_layout = ScaleLayout::row_major;
  Mode mode = Mode::normal;
  std::optional<Geometry> dispatch_geometry;  // pins the dispatch CTA count (mode=ll: the one grid of both legs)
  std::optional<Geometry> combine_geometry;   // pins the combine CTA count (normal mode; mode=ll refuses it)
  // Cap on rows one rank can receive (default world * max_tokens_per_rank). Rows past it are dropped and reported.
  // Normal mode only: low-latency mode always receives every row (ConfigError if set there).
  std::optional<int> max_recv_tokens;
  // Rows per local expert of the expert-major layout (DispatchArgs::expand). Unset: normal mode allocates no
  // expert-major buffers and refuses expand (the worst case, world * max_tokens_per_rank rows for every local expert,
  // is rarely affordable in normal mode; size it for the routing you expect); low-latency mode uses that worst case
  // (see resolved()). Slots past it are dropped and reported.
  std::optional<int> expert_capacity;
  // Across nodes, low-latency mode: how rows reach other nodes (InternodeRoute). Normal mode always forwards
  // (hierarchical); direct is refused there.
  InternodeRoute internode_route = InternodeRoute::automatic;
  // forward or direct: the route a call across nodes takes (automatic resolved by the rule above).
  InternodeRoute route() const;
  // Rank masking (docs/internode.md "Rank masking"), mode=ll only, opt-in; every rank must set the same value. Off
  // (the default): a rank that does not arrive within FERRY_TIMEOUT_S fails the call on every rank (TimeoutError
  // naming it) and the communicator with it. On: the ranks that arrived agree to leave it out ("mask" it), and later
  // calls skip it (no row goes to it, no rank waits for it); what it would have contributed is counted
  // (EpBuffer::mask_status). Both backends, one node and across nodes; the cuda backend up to 32 ranks and, across
  // nodes, on the direct route (docs/internode.md, "Rank masking").
  bool rank_masking = false;
  // Per-source wait statistics of the low-latency receive halves (EpBuffer::wait_stats), mode=ll only, opt-in; every
  // rank must set the same value. Off, the kernels pay one predictable branch per wait and record nothing.
  bool wait_stats = false;

  // Throws ConfigError naming the field, the value and the rule for the first rule broken.
  // Low-latency mode also needs max_tokens_per_rank <= kMaxLowLatencyTokens and max_recv_tokens unset.
  void validate(int world) const;
  // The config with the mode's defaults filled in for `world` ranks: in low-latency mode an unset expert_capacity
  // becomes world * max_tokens_per_rank (no slot can be dropped unless a token names one expert twice). Normal mode
  // is returned unchanged. EpBuffer::config() is the resolved config; pass it to ref:: to get the same layout.
  EpConfig resolved(int world) const;

  int num_local_experts(int world) const { return num_experts / world; }
  // Whether dispatch delivers quantized rows + scales (a quantized dispatch_format without dispatch_dequantize).
  bool delivers_quantized() const { return dispatch_format != WireFormat::bf16 && !dispatch_dequantize; }
  // Bytes of one delivered row of recv_x / expert_x: hidden * 2 (bf16), or the quantized payload.
  std::size_t recv_row_bytes() const;
  int recv_capacity(int world) const;                               // rows of the rank-major receive buffers
  int expert_slots() const { return expert_capacity.value_or(0); }  // rows per expert (0: no expert-major)
};

enum class IndexType { int32, int64 };

namespace detail {
struct HandleState;
}

// The routing layout of one normal-mode dispatch, kept for later calls (docs/training.md): the rank-major metadata
// (local expert ids, weights and source of every received row), the expert-major slots, the per-source offsets and
// counts, and the source's own ids, weights and destination masks, all in the handle's storage (device memory on
// the cuda backend). Made by EpBuffer::make_handle; filled by a dispatch with DispatchArgs::save_handle; used by a
// cached dispatch (DispatchArgs::handle), a combine (CombineArgs::handle) and the backward passes.
// Lifetime: a handle owns its storage (or borrows the caller's, see make_handle) and may outlive the EpBuffer that
// made it; it fits every normal-mode EpBuffer on the same communicator with the same layout shape (num_experts,
// topk, max_tokens_per_rank, recv_capacity, expert_capacity), whatever their hidden size and formats. A call that
// reads it must be ordered after the dispatch that filled it (same stream, or an event); a dispatch that saves into
// it must not run while a call that reads it is still running on the device. Copies share the same storage.
class DispatchHandle {
 public:
  DispatchHandle();
  ~DispatchHandle();
  DispatchHandle(DispatchHandle const&);
  DispatchHandle& operator=(DispatchHandle const&);
  DispatchHandle(DispatchHandle&&) noexcept;
  DispatchHandle& operator=(DispatchHandle&&) noexcept;

  bool empty() const;         // made by no EpBuffer (default-constructed)
  bool saved() const;         // a dispatch has saved its layout into it
  int num_tokens() const;     // the saved dispatch's tokens (0 before)
  bool expanded() const;      // the saved dispatch filled the expert-major layout
  std::size_t bytes() const;  // device storage (0 on the cpu backend)

 private:
  friend class EpBuffer;
  std::shared_ptr<detail::HandleState> state_;
};

struct DispatchArgs {
  // [num_tokens, hidden] bf16, row-major, contiguous; or, pre-quantized (x_scales set), the dispatch_format payload
  // [num_tokens, wire_payload_bytes(dispatch_format, hidden)] (fp8: one byte per element; fp4: two per byte, element
  // 2i in the low nibble), which dispatch forwards as is.
  void const* x = nullptr;
  // Pre-quantized input (a quantized dispatch_format only; InputError otherwise): the block scales of x, row-major
  // [num_tokens, hidden / wire_block_elems] (fp32 for fp8_e4m3, one byte for the others: UE8M0 or e4m3).
  void const* x_scales = nullptr;
  float const* x_token_scales = nullptr;  // pre-quantized nvfp4: [num_tokens] per-token fp32 scales (required there)
  int num_tokens = 0;                     // 0 <= num_tokens <= max_tokens_per_rank
  void const* topk_idx = nullptr;         // [num_tokens, topk] global expert ids in [-1, num_experts)
  IndexType topk_idx_type = IndexType::int64;
  float const* topk_weights = nullptr;  // [num_tokens, topk]
  bool expand = false;                  // also fill the expert-major layout (always filled in low-latency mode)
  // Eager: synchronise after the call, set num_recv_host and raise device-side errors now. Not graph-capturable.
  // With return_recv_hook, this applies to complete_dispatch (the send half never synchronises).
  bool eager = true;
  // Low-latency mode only (InputError otherwise): return after the send half (the rows are on their way, nothing of
  // this rank's inputs is read afterwards) and leave the receive half to EpBuffer::complete_dispatch, so the caller
  // can run other work on the stream in between. The returned views are valid only after complete_dispatch.
  bool return_recv_hook = false;
  // Normal mode only. Save this dispatch's routing layout into the handle (made by make_handle for this buffer's
  // shape), replacing what it held. Enqueued on the stream with the dispatch, so it can be captured in a graph.
  DispatchHandle* save_handle = nullptr;
  // Normal mode only. Cached dispatch: route by the layout the handle saved instead of topk_idx / topk_weights (both
  // must be null; num_tokens must be the handle's). The rows land exactly where the saved dispatch put them: the
  // layout is deterministic, and the ids and weights come from the handle's storage on the device, with no host sync.
  DispatchHandle const* handle = nullptr;
  // Low-latency mode only (InputError otherwise). Token i's row is row i / x_repeat of x (and of x_scales and
  // x_token_scales): x holds num_tokens / x_repeat rows, and num_tokens must be a multiple of x_repeat. A caller that
  // sends every (token, k) entry as a token of its own (topk 1, num_tokens = T * k, the ids of token t's entries
  // consecutive) passes x unexpanded with x_repeat = k, instead of copying each row k times first. With topk 1 a group
  // of x_repeat tokens is one token's entries: their ids must differ (a repeat is refused on every rank, as within a
  // token's topk), so one rank's call sends an expert at most ceil(max_tokens_per_rank / x_repeat) entries, and a lazy
  // call on cuda needs expert_capacity >= world * that (docs/errors.md, "Capacities").
  int x_repeat = 1;
  // Eager calls only (InputError otherwise): also copy the expert counts (DispatchResult::expert_counts) into this
  // host memory of num_local_experts int32, within the call's one synchronisation (no second round trip).
  int32_t* expert_counts_host = nullptr;
};

// Views of the buffers the dispatch filled. Rows ordered by (source rank, source token).
// Low-latency mode fills the expert-major layout, num_recv, expert_counts and the rank-major metadata (recv_topk_idx,
// recv_topk_weights, recv_src: what combine needs per row) but not recv_x (null there): the rows land per source and
// are copied once, into expert_x.
struct DispatchResult {
  // [recv_capacity, recv_row_bytes] (normal mode only): bf16 rows, or the quantized payload (delivers_quantized()).
  void* recv_x = nullptr;
  std::size_t recv_row_bytes = 0;  // EpConfig::recv_row_bytes()
  // Quantized delivery (normal mode only): the block scales of recv_x, a scale tensor of recv_capacity rows in
  // recv_scale_layout (scale_tensor_bytes / scale_byte_offset of wire_format.hpp), and nvfp4's per-token scales.
  // Entries of rows at or past num_recv are unspecified.
  void* recv_scales = nullptr;
  float* recv_token_scales = nullptr;  // nvfp4: [recv_capacity]
  int32_t* recv_topk_idx = nullptr;    // [recv_capacity, topk] local expert index, -1 where not on this rank
  float* recv_topk_weights = nullptr;  // [recv_capacity, topk]
  int32_t* recv_src = nullptr;         // [recv_capacity, 2] (source rank, source token)
  int32_t* num_recv = nullptr;         // device (cpu: host) scalar: rows received
  int64_t num_recv_host = -1;          // eager only (the cpu backend, being synchronous, always sets it)
  int32_t* expert_counts = nullptr;    // [num_local_experts] valid (row, k) entries per local expert (not capped by
                                       // expert_capacity: min(count, expert_slots) slots are filled)
  int recv_capacity = 0;
  // expert-major (expand only). An expert's slots follow the rank-major rows starting at this rank's own first row
  // (its own tokens, then sources rank + 1, ..., world - 1, 0, ..., rank - 1), k ascending: deterministic.
  void* expert_x = nullptr;           // [num_local_experts, expert_slots, recv_row_bytes] (bf16 or payload)
  int32_t* expert_src_row = nullptr;  // [num_local_experts, expert_slots] rank-major row of each slot
  int expert_slots = 0;
  // Quantized delivery: one scale tensor of expert_slots rows per local expert, back to back (each
  // scale_tensor_bytes(dispatch_format, recv_scale_layout, expert_slots, hidden) long), and nvfp4's per-token
  // scales [num_local_experts, expert_slots]. Entries of unfilled slots are unspecified.
  void* expert_scales = nullptr;
  float* expert_token_scales = nullptr;
  // Rank masking (EpConfig::rank_masking): this call's (token, k) entries of this rank's tokens that were not sent
  // because their expert's rank is masked (0 without masking). Cumulative counts: EpBuffer::mask_status. On the cuda
  // backend the count is on the device: an eager call returns it, a lazy one -1 (mask_status has it).
  int64_t masked_entries = 0;
  // Rows this call did not deliver, over every rank of the call (the same number on every rank): rank-major rows past
  // a rank's receive capacity (max_recv_tokens) and, on ranks that expanded, entries past expert_capacity. A call
  // that drops is an error on every rank (docs/errors.md, "Capacities"): an eager call throws InputError instead of
  // returning; a lazy one returns this count, its drop is raised by the next check on every rank, and no combine,
  // cached dispatch or backward pass over its layout runs (InputError on every rank). -1: known on the device only
  // (cuda, lazy): the next check reports it.
  int64_t dropped_rows = 0;
};

enum class CombineLayout { rank_major, expert_major };

// Combine always refers to the most recent dispatch on the same EpBuffer.
struct CombineArgs {
  CombineLayout layout = CombineLayout::expert_major;
  // rank_major: [num_recv, hidden] rows already reduced over this rank's experts (weights applied by the caller).
  // expert_major: [num_local_experts, expert_slots, hidden]: expert outputs; weights applied by combine.
  void const* x = nullptr;
  void* y = nullptr;  // [num_tokens of that dispatch, hidden] bf16
  bool eager = true;  // with return_recv_hook, applies to complete_combine
  // Low-latency mode only (InputError otherwise): return after the send half (x has been read and this rank's rows
  // are on their way back) and leave the receive half (the sum into y) to EpBuffer::complete_combine.
  bool return_recv_hook = false;
  // Normal mode only. Combine the rows of the dispatch this handle saved instead of the most recent dispatch (y has
  // the handle's num_tokens rows). The handle's layout then becomes this buffer's current one: a later combine without
  // a handle refers to it, and the rank-major metadata views of the last DispatchResult show it.
  DispatchHandle const* handle = nullptr;
  // Low-latency mode with topk 1 only (InputError otherwise): a weighted sum over groups of `group` consecutive
  // tokens, the weights given here, at combine (an entry-per-token dispatch, see DispatchArgs::x_repeat, combined
  // back into its tokens). y then has num_tokens / group rows (num_tokens of the dispatch, a multiple of group):
  // y[u] = bf16(sum over j < group ascending of group_weights[u * group + j] * v(u * group + j)), in fp32, each
  // product rounded before its sum (no fused multiply-add), from +0.0f; v(i) is token i's row as it came back (its
  // fp32 value, dequantized for a quantized combine_format). A token that went nowhere (id -1, or a rank masked since)
  // adds nothing, whatever its weight. group_weights: [num_tokens] fp32, required when group > 1.
  int group = 1;
  float const* group_weights = nullptr;
};

// Where EpBuffer::copy_received copies the rank-major outputs of the last dispatch (normal mode): memory of the
// caller's on the buffer's GPU (host memory on the cpu backend), rows [0, rows) of each; a null field is skipped.
// For a caller that hands out outputs of its own (ferry.deep_ep: DeepEP returns fresh tensors) in one launch.
struct ReceivedCopy {
  int rows = 0;                        // 0 <= rows <= recv_capacity; rows at or past num_recv are unspecified
  void* recv_x = nullptr;              // [rows, recv_row_bytes], 16-byte aligned
  void* recv_scales = nullptr;         // [rows, hidden / wire_block_elems] scale entries (recv_scale_layout row_major)
  float* recv_token_scales = nullptr;  // nvfp4: [rows]
  float* recv_topk_weights = nullptr;  // [rows, topk]
  void* recv_topk_idx = nullptr;       // [rows, topk] of recv_topk_idx_type: int32, or int64 (sign-extended)
  IndexType recv_topk_idx_type = IndexType::int32;
  int32_t* recv_src = nullptr;  // [rows, 2] (source rank, source token)
};

// The backward pass of a dispatch (docs/training.md): a combine of the gradients of the rows the dispatch delivered,
// without weights. grad_x[t] = the sum over every rank that received token t (and, expert-major, over its slots of
// t) of the gradients of t's copies, accumulated in fp32 in the canonical combine order (ref::dispatch_backward).
// The gradient of topk_weights is 0 (dispatch does not use the weights); the caller supplies it.
struct DispatchBackwardArgs {
  DispatchHandle const* handle = nullptr;  // the forward dispatch's layout (required)
  // Which output of the forward dispatch `grad` is the gradient of: rank_major, recv_x [num_recv, hidden]; or
  // expert_major, expert_x [num_local_experts, expert_slots, hidden] (the handle must be expanded).
  CombineLayout layout = CombineLayout::rank_major;
  void const* grad = nullptr;  // bf16, in that layout
  void* grad_x = nullptr;      // [num_tokens, hidden]: bf16, or fp32 with grad_x_fp32
  bool grad_x_fp32 = false;    // fp32 output: the source's fp32 sum, not rounded to bf16
  bool eager = true;
};

// The backward pass of a combine (docs/training.md): a cached dispatch of grad_y in the handle's layout.
// rank_major (the caller applied the weights): the gradient of the combine's x row of (source s, token t) is
// grad_y[t] of s, delivered as recv_x. expert_major: the gradient of slot (e, j) holding entry (t, k) is
// bf16(w[t,k] * grad_y[t]), delivered as expert_x; and grad_topk_weights[t,k] = <grad_y[t], x(e, j)> in fp32
// (computed on the rank that holds the expert, in the order of ref::combine_backward, and sent back; 0 for an
// id of -1 and for entries without a slot). Needs a delivered row in bf16 (dispatch_format bf16, or
// dispatch_dequantize).
struct CombineBackwardArgs {
  DispatchHandle const* handle = nullptr;              // the forward dispatch's layout (required)
  CombineLayout layout = CombineLayout::expert_major;  // the forward combine's layout
  void const* grad_y = nullptr;                        // [num_tokens, hidden] bf16
  // expert_major: the forward combine's x, [num_local_experts, expert_slots, hidden] bf16 (the expert outputs)
  void const* x = nullptr;
  float* grad_topk_weights = nullptr;  // expert_major: [num_tokens, topk] fp32 output (null: not computed)
  bool eager = true;
};

// Bytes one rank sent in one call, by link: over the network (to ranks on other nodes) and over NVLink (to other
// ranks of its node, load/store); a rank's rows to itself cross no link. network_messages counts the puts that
// carried rows (one per row and destination node).
struct LinkBytes {
  uint64_t network_bytes = 0;
  uint64_t nvlink_bytes = 0;
  uint64_t network_messages = 0;
};
struct CallLinkBytes {
  LinkBytes dispatch;
  LinkBytes combine;
};

// Where rank masking (EpConfig::rank_masking) stands on one rank. The entry counts are (token, k) entries of this
// rank's tokens with a valid id whose expert lives on a masked rank, since the EpBuffer was made or clear_mask ran.
struct MaskStatus {
  bool enabled = false;               // EpConfig::rank_masking
  std::vector<int> ranks;             // the masked ranks, ascending (this rank too, once its peers masked it)
  bool self = false;                  // this rank is masked: its calls on this EpBuffer throw Error until clear_mask
  int64_t dispatch_entries = 0;       // not sent by a dispatch (their rank was masked before its rows moved)
  int64_t combine_entries = 0;        // whose expert output is missing from a combine's y
  int64_t last_dispatch_entries = 0;  // ...of the last dispatch / combine alone
  int64_t last_combine_entries = 0;
};

// The waits of one source rank in one low-latency leg's receive half (EpConfig::wait_stats): how many, and for how
// long, in ns (cuda: %globaltimer read by the thread of CTA 0 that waits for that source; cpu: steady_clock around
// the wait for that source's signal). A wait that found the signal already there counts with 0 ns.
struct PeerWaitStats {
  uint64_t waits = 0;
  uint64_t total_ns = 0;
  uint64_t max_ns = 0;
};
// Per leg, indexed by source rank ([world]; a masked source gets no more waits), since the EpBuffer was made or
// reset_wait_stats ran. One wait per source per call of the leg (with the hook: per receive half).
struct WaitStats {
  std::vector<PeerWaitStats> dispatch;
  std::vector<PeerWaitStats> combine;
};

// The memory an EpBuffer of `config` holds on each rank of a world of `topology` on `backend`: the one formula its
// constructor checks against the free memory before anything is allocated, for callers that size a config to a
// budget (ferry.deep_ep sizes its buffers to DeepEP's num_nvl_bytes / num_bytes so). Not collective; ConfigError
// for a config the constructor would refuse (EpConfig::validate).
struct BufferFootprint {
  uint64_t symmetric = 0;   // the region every rank maps (cpu: a shared-memory segment; cuda: device memory)
  uint64_t local = 0;       // the rank's own buffers
  std::string description;  // "7.2 GiB (7747721216 bytes): combine landing zone 7.2 GiB, ..." (the largest areas)
  uint64_t total() const { return symmetric + local; }
};
BufferFootprint buffer_footprint(EpConfig const& config, Topology const& topology, Backend backend);

namespace detail {
class EpBackendImpl;
struct EpBufferAccess;
}  // namespace detail

class EpBuffer {
 public:
  // Collective: allocates the symmetric buffers. Throws ConfigError for an invalid config, on every rank: the ranks
  // compare their configs first, and a field that differs between ranks (or a rank whose config is invalid) is named
  // in the error every rank raises.
  EpBuffer(std::shared_ptr<Communicator> comm, EpConfig const& config);
  ~EpBuffer();
  EpBuffer(EpBuffer const&) = delete;
  EpBuffer& operator=(EpBuffer const&) = delete;

  EpConfig const& config() const { return config_; }  // resolved for the communicator's world (EpConfig::resolved)
  Communicator& communicator() const { return *comm_; }

  // Collective. Throws InputError for bad arguments (before anything is written), TimeoutError when a peer does
  // not arrive, Error when the communicator already failed.
  // Collective consistency (docs/errors.md): a call that any rank refuses on input is refused on every rank. The
  // refusing rank still joins the call's exchange with an abort flag and throws its own InputError; every peer's same
  // call throws InputError naming the refusing rank and its reason (cpu: from the call; cuda: at the call in eager
  // mode, otherwise at the next check, and the views of that call must not be read). Nothing pairs up with another
  // call and nothing waits past FERRY_TIMEOUT_S. The buffer and the communicator stay usable afterwards.
  DispatchResult dispatch(DispatchArgs const& args, cudaStream_t stream = nullptr);
  void combine(CombineArgs const& args, cudaStream_t stream = nullptr);
  // Copies the last dispatch's rank-major outputs into the caller's memory (ReceivedCopy), enqueued on `stream` (one
  // kernel on cuda). Local, not collective; normal mode only. InputError for a field its dispatch does not have
  // (scales of an unquantized delivery, a scale layout other than row_major), rows outside [0, recv_capacity], or no
  // dispatch to copy from.
  void copy_received(ReceivedCopy const& to, cudaStream_t stream = nullptr);
  // For a caller that checks arguments itself before calling (a binding's shape and dtype checks): joins this
  // rank's next dispatch / combine as a refusal with `reason` (as above), then throws InputError(reason). Collective.
  [[noreturn]] void refuse_dispatch(std::string const& reason, cudaStream_t stream = nullptr);
  [[noreturn]] void refuse_combine(std::string const& reason, cudaStream_t stream = nullptr);

  // The receive halves of a dispatch / combine called with return_recv_hook (low-latency mode), "the hook".
  // Contract:
  //  - Exactly one completion per hooked call, before any other dispatch or combine on this EpBuffer: a dispatch or
  //    combine while a hook is pending, a completion without a pending hooked call of that leg (never started, or
  //    already completed: a second call), all throw InputError before anything is enqueued.
  //  - cuda: enqueued on `stream`; use the stream of the send half, or order it after that one yourself (an event).
  //    What runs between the halves must not write the call's inputs (the send half may still be reading them on the
  //    device until it finishes) nor read its outputs. cpu: runs now; stream must be null.
  //  - complete_dispatch returns the same views as the send half, with num_recv_host set when the call was eager.
  //  - A hook that is never completed leaves the EpBuffer refusing every later call; the peers' receive halves of
  //    the next call then wait for this rank and end in TimeoutError (FERRY_TIMEOUT_S), never hang.
  // Collective like the calls themselves. Throws TimeoutError when a peer does not arrive (eager: now; otherwise at
  // the next check).
  DispatchResult complete_dispatch(cudaStream_t stream = nullptr);
  void complete_combine(cudaStream_t stream = nullptr);
  // Training (docs/training.md). Normal mode only: mode=ll throws ConfigError (train with mode=normal).
  // make_handle: a handle for this buffer's layout shape. storage null: the handle allocates handle_bytes() of device
  // memory (cuda), freed when its last copy goes; else caller-owned device memory of at least handle_bytes() bytes,
  // 16-byte aligned, on this communicator's device, which must outlive the handle (a binding passes a tensor's).
  // Not collective; allocates, so make handles before capturing a graph.
  DispatchHandle make_handle(void* storage = nullptr, std::size_t storage_bytes = 0) const;
  std::size_t handle_bytes() const;  // 0 on the cpu backend (its handles live in host memory)
  // The count matrix of the dispatch the handle saved: out[s * world + d] = the rows rank s sent to rank d (int32,
  // world * world, 4-byte aligned memory of this communicator's device; host memory on cpu), enqueued on `stream`.
  // What a caller needs for per-source offsets (DeepEP's rank_prefix_matrix is its prefix sum over s). Local, not
  // collective. InputError for a handle that does not fit or holds no layout; ConfigError where the dispatch
  // exchanged no count matrix (cuda's landing zone for small batches: FERRY_NORMAL_LANDING=off keeps it).
  void copy_rank_counts(DispatchHandle const& handle, int32_t* out, cudaStream_t stream = nullptr) const;
  // Collective, like dispatch and combine (their refusal rules apply). dispatch_backward is a combine leg (it uses
  // combine_format on the wire); combine_backward is a dispatch leg (dispatch_format) and returns its views: recv_x
  // (rank_major) or expert_x (expert_major) hold the gradient rows, valid until the next dispatch on this buffer.
  // Both make the handle's layout the buffer's current one (as CombineArgs::handle).
  void dispatch_backward(DispatchBackwardArgs const& args, cudaStream_t stream = nullptr);
  DispatchResult combine_backward(CombineBackwardArgs const& args, cudaStream_t stream = nullptr);
  // For a binding that checks a backward call's arguments itself: joins this rank's next combine_backward of
  // `layout` as a refusal with `reason` (every rank must pass the same layout), then throws InputError(reason).
  // dispatch_backward's refusal is refuse_combine (it is a combine leg). Collective.
  [[noreturn]] void refuse_combine_backward(CombineLayout layout, std::string const& reason,
                                            cudaStream_t stream = nullptr);

  // The leg whose receive half is pending ("" when none).
  char const* pending_hook() const;

  // Name of the kernel path the last call of each leg took, and why (for `ferry bench --explain`).
  std::string explain() const;

  // The bytes this rank sent in its last dispatch and its last combine, by link (docs/internode.md "Counting the
  // bytes"): the rows and their metadata, not the control words (counts, signals). What `ferry bench --topology`
  // compares with `ferry model`. On the cuda backend it synchronises `stream` first.
  CallLinkBytes link_bytes(cudaStream_t stream = nullptr) const;

  // Rank masking (EpConfig::rank_masking; docs/internode.md "Rank masking" has the whole contract). A rank is masked
  // when a rank that took part in a call's exchange gave up waiting for it (FERRY_TIMEOUT_S) or asked for it
  // (mask_ranks); every rank that took part computes the same set, from the same words, at the same exchange, so
  // the ranks never disagree. A call whose entry exchange masks a rank finishes without it; a rank lost later in a
  // call fails that call with TimeoutError on every rank still in it (the buffer and communicator stay usable, and
  // the next call skips it). A masked rank's own calls throw Error (naming the call it was masked at) until clear_mask.
  // mask_status / masked_ranks: local, no communication (never throw; disabled: empty).
  MaskStatus mask_status() const;
  std::vector<int> masked_ranks() const;
  // Local: asks that `ranks` be masked from this rank's next dispatch or combine on (its entry exchange carries the
  // request; every rank of that call applies the union of the requests). A rank may name itself: it then leaves
  // without a timeout. Throws ConfigError when masking is off, InputError for a rank outside [0, world).
  void mask_ranks(std::vector<int> const& ranks);
  // Collective over EVERY rank of the world, masked ones included (through the bootstrap, so ranks whose calls are
  // out of step meet again): unmasks every rank, puts every rank's protocol state back in step, and zeroes the
  // counts. The dispatch before it is forgotten (a combine must follow a new dispatch). Call it with no hook
  // pending. Throws ConfigError when masking is off, InputError while a hook is pending, BootstrapError when a rank
  // does not come (a rank that is gone cannot be cleared: make a new communicator).
  void clear_mask();

  // Wait statistics (EpConfig::wait_stats). wait_stats reads them (cuda: synchronises `stream`, then a copy from the
  // device), reset_wait_stats zeroes them (cuda: enqueued on `stream`). Local, off the hot path. Both throw
  // ConfigError when the EpBuffer was made without wait_stats.
  WaitStats wait_stats(cudaStream_t stream = nullptr) const;
  void reset_wait_stats(cudaStream_t stream = nullptr);

  // In-kernel trace (include/ferry/trace.hpp): normal mode on the cuda backend, in builds with -DFERRY_TRACE=ON.
  // enable_trace allocates max_events_per_warp 16-byte events for every warp of each kernel family (0: frees them,
  // tracing off); every later call records its phases. FERRY_TRACE_EVENTS enables it at construction. Not collective.
  // read_trace synchronises `stream` and copies out the last traced call of `kernel`. Both throw ConfigError when
  // tracing is not compiled in (saying to rebuild with -DFERRY_TRACE=ON), for other modes and backends, and (read)
  // when tracing is off or the kernel has not run since it was enabled.
  void enable_trace(int max_events_per_warp);
  TraceBuffer read_trace(TraceKernel kernel, cudaStream_t stream = nullptr) const;

 private:
  enum class Leg { dispatch, combine };
  void agree_on_config(EpConfig const& requested, std::string const& invalid) const;
  void join_refused(Leg leg, std::string const& reason, cudaStream_t stream);
  // The handle's state, checked to fit this buffer (InputError naming `what` and the field otherwise).
  detail::HandleState const& check_handle(DispatchHandle const& handle, char const* what, bool need_saved) const;
  void make_current(std::shared_ptr<detail::HandleState> const& handle);
  // Make the handle's layout the current one (restored only when it is not already).
  void use_handle(std::shared_ptr<detail::HandleState> const& handle, cudaStream_t stream);

  std::shared_ptr<Communicator> comm_;
  EpConfig config_;
  std::unique_ptr<detail::EpBackendImpl> impl_;
  friend struct detail::EpBufferAccess;  // the internal record of what ran (tests of the fast path)
  enum class Pending { none, dispatch, combine };
  Pending pending_ = Pending::none;
  // The last dispatch, as combine refers to it (set only when it succeeded on this rank).
  bool have_dispatch_ = false;
  int64_t last_dropped_ = 0;    // DispatchResult::dropped_rows of the last dispatch (> 0: no combine over it)
  bool last_expand_ = false;    // it filled the expert-major layout
  DispatchResult last_result_;  // its views (copy_received)
  int last_num_tokens_ = 0;
  // The handle whose saved layout is the current one (what combine reads), at which save (HandleState::version).
  std::weak_ptr<detail::HandleState> current_handle_;
  uint64_t current_version_ = 0;
};

}  // namespace ferry
