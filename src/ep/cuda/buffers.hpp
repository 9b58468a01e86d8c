// Host-side description of one EpBuffer's device memory on the cuda backend, every protocol's (normal push, normal
// landing, low-latency), shared by the launchers (normal/dispatch.cu, normal/expand.cu, normal/combine.cu,
// ll/dispatch.cu, ll/combine.cu), the backend (cuda_ep.cu) and the virtual-rank tests (several ranks' buffers on one
// GPU). One allocator, one symmetric-layout builder, one Params prologue (buffers.cu). Included by .cu files only
// (params.cuh is CUDA).
#pragma once

#include <cuda_runtime.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/transport/emulated.cuh"
#include "comm/transport/gin.cuh"
#include "ep/cuda/layout.hpp"
#include "ep/cuda/ll/params.cuh"
#include "ep/cuda/normal/params.cuh"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/run_record.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "trace/cuda/recorder.hpp"
#include "tuning/choose.hpp"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

using detail::Protocol;

struct Buffers {
  EpConfig config;  // resolved (EpConfig::resolved)
  Protocol protocol = Protocol::push;
  int world = 0;
  int rank = 0;
  int num_local_experts = 0;
  int recv_capacity = 0;  // rows of the rank-major receive buffers (low-latency: world * max_tokens_per_rank)
  int expert_slots = 0;
  int num_sms = 0;
  // Launch the persistent grids cooperatively: the runtime refuses a grid that cannot be co-resident. Only the
  // virtual-rank tests turn it off: they run several ranks' grids side by side on one GPU, sized so that all fit.
  bool cooperative = true;
  DeviceView view{};
  SymmetricView sym{};
  SymLayout layout;
  DeviceState* state = nullptr;
  uint32_t* token_mask = nullptr;     // [max_tokens][ceil(world / 32)] destination ranks of each token (for combine)
  int32_t* expert_counts = nullptr;   // [num_local_experts]
  int32_t* recv_slot = nullptr;       // [recv_capacity, topk] slot within its expert or -1
  std::size_t recv_row_bytes = 0;     // EpConfig::recv_row_bytes(): bf16 row or quantized payload
  void* expert_x = nullptr;           // [num_local_experts, expert_slots, recv_row_bytes] (expert_capacity set)
  int32_t* expert_src_row = nullptr;  // [num_local_experts, expert_slots]
  // Quantized delivery with expert slots: one scale tensor of expert_slots rows per local expert (zeroed once:
  // padding entries stay zero), and nvfp4's token scales [num_local_experts, expert_slots].
  std::size_t expert_scale_bytes = 0;  // scale_tensor_bytes(dispatch_format, recv_scale_layout, expert_slots, hidden)
  void* expert_scales = nullptr;
  float* expert_token_scales = nullptr;
  trace::DeviceRecorder* trace = nullptr;  // in-kernel trace buffers (src/trace/), owned by the backend
  // EpConfig::wait_stats (low-latency): [wait_stats::kLegs][world] per-source waits, zeroed; null when off
  wait_stats::Slot* wait_stats = nullptr;

  // Normal mode (push and landing).
  int32_t* token_pos = nullptr;     // [max_tokens, world]
  int32_t* block_counts = nullptr;  // [max_dispatch_ctas, world] rows per destination of each dispatch CTA
  int32_t* count_totals = nullptr;  // [world + num_experts + 1] the dispatch's running totals (zero between calls)
  float* token_scales = nullptr;    // [max_tokens] nvfp4 dispatch_format: per-token scales of the call's tokens
  int max_dispatch_ctas = 0;
  int land_ctas = 0;  // landing: the dispatch grid on every call (per-CTA sequence words)
  // Quantized delivery in a scale layout other than row_major: the scale tensor of recv_capacity rows the receiver
  // pass fills from the row-major recv_scales (zeroed once: padding entries stay zero). Null otherwise (the
  // symmetric recv_scales is the output).
  void* recv_scales_final = nullptr;
  // Launch geometry inputs fixed at construction: the EpConfig pin and the tuning table rows of this GPU model and
  // shape (plan_dispatch / plan_combine add the env pins and the analytic default per call).
  tuning::LegTuning dispatch_tuning;
  tuning::LegTuning combine_tuning;

  // Hierarchical normal mode (nodes > 1; hier/dispatch.cuh, hier/combine.cuh). The caller sets topology and the
  // network: GIN (gin, from the communicator), or the emulated transport (its fields: windows, rank, world, seed,
  // delays; allocate_buffers its endpoints' areas). with_network (hier/params.cuh) hands the kernels the one in use.
  Topology topology{};
  transport::Kind network_kind = transport::Kind::emulated;
  transport::Emulated network{};
  transport::Gin gin{};
  int32_t* node_pos = nullptr;        // [max_tokens, nodes] position among this rank's tokens bound for that node
  uint32_t* hier_mask = nullptr;      // [max_tokens] who sends a token's combine row back: own-node ranks, rails
  uint16_t* rail_partials = nullptr;  // quantized combine_format: [nodes, max_tokens, hidden] the rail's bf16 sums
  // TEST ONLY: the rail reads forwarded rows without waiting for the network's signal (the test must then fail).
  bool test_skip_rail_wait = false;
  // TEST ONLY (rank masking): the legs' launches leave out the agreement, which the test launches itself. Virtual
  // ranks share one GPU's hardware queues (CUDA_DEVICE_MAX_CONNECTIONS, 8 by default): one host thread launching
  // agreement then leg rank by rank queues a rank's agreement behind another rank's leg, which waits for its own
  // agreement, which waits for the first: every rank's agreement must be launched before any leg.
  bool test_agreement_apart = false;

  // Low-latency mode.
  // A combine refuses on the device when its dispatch dropped an entry past expert_capacity
  // (LlCombineParams::refuse_after_drop): EpBuffer's buffers; the kernel tests of what a sum without the dropped
  // entries gives leave it off.
  bool refuse_combine_after_drop = false;
  int num_ctas = 0;  // the grid of both legs, the same on every rank (agreed at construction)
  // bf16 dispatch: the send half copies this rank's own rows from x into their slots (FERRY_LL_OWN_ROWS=direct)
  // instead of staging them in the landing zone.
  bool own_direct = false;
  int32_t* recv_src = nullptr;  // [recv_capacity, 2] (source rank, source token)
  int32_t* recv_idx = nullptr;  // [recv_capacity, topk]
  float* recv_w = nullptr;      // [recv_capacity, topk]
  int32_t* own_slot = nullptr;  // [max_tokens, topk]
  // Across nodes, the forward route: per source node, the tokens its source sent this rail in the last dispatch and,
  // per token, the local ranks here that hold it (written by the dispatch's forward, read by the combine's reduction).
  int32_t* ll_fwd_num = nullptr;    // [nodes]
  uint32_t* ll_fwd_mask = nullptr;  // [nodes, max_tokens]
  // Rank masking (EpConfig::rank_masking; ll/mask.cuh): the request and this rank's verdict in mapped host memory
  // (mask_host: the host's address, mask_host_device: the kernels'), and the entries' ranks of the last dispatch
  // (DeviceState::ll_mask.entry_rank points here). Null when off.
  detail::LlMaskHost* mask_host = nullptr;
  detail::LlMaskHost* mask_host_device = nullptr;
  // What an eager call reads after its one synchronisation, copied there by async copies enqueued before it (pinned
  // memory): num_recv, then the expert counts (DispatchArgs::expert_counts_host).
  int32_t* host_words = nullptr;     // [1 + num_local_experts]
  int16_t* ll_entry_rank = nullptr;  // [max_tokens, topk]
  // across nodes: what clear_mask's realignment adds to each rank's counters of this one
  // ([kLlMaskNetworkCounters][world])
  uint64_t* mask_counter_add = nullptr;
  // Across nodes over GIN: the agreement's own Gin, whose signal range is LlMaskArea's counters (the legs' Gin covers
  // the layout's counters only). Over the emulated network the agreement uses `network` (its counters are window
  // words).
  transport::Gin mask_gin{};
};

// Sets the fields every allocation and launch reads from the config, the world, this rank, the protocol and the SMs a
// grid may take (the backend at construction, and each virtual rank of the tests); the grids, view, sym, layout and
// tuning are the caller's.
void configure_buffers(Buffers& b, EpConfig const& config, int world, int rank, Protocol protocol, int num_sms);

// Allocates a rank's local device buffers for its protocol (configure_buffers set the inputs); zeroes the state, the
// counters and the scale tensors with cudaMemset (the default stream: synchronize the device before another stream
// uses them). Throws CudaError; then nothing stays allocated.
void allocate_buffers(Buffers& b);
// Frees what allocate_buffers allocated and nulls the pointers (again: a no-op). Never throws.
void free_buffers(Buffers& b) noexcept;
// The views a dispatch returns (device pointers into b; num_recv_host not set): what EpBuffer::dispatch hands out.
// expand: the call laid the rows out expert-major (normal mode's DispatchArgs::expand; low-latency mode always does).
DispatchResult dispatch_result(Buffers const& b, bool expand);

// The part of every kernel's Params the buffers give (the prologue of each launcher's to_params): view, peers'
// regions, layout, state, shape, grid, the refusal flag and the trace of this launch (`traced`: the family it records
// as; none for a kernel that records no trace).
KernelParams common_params(Buffers const& b, int ctas, bool refuse, std::optional<TraceKernel> traced);
// The part both low-latency legs' Params share (their prologue): common_params and the rank-major metadata.
cuda_ll::LlParams ll_params(Buffers const& b, bool refuse, TraceKernel traced);

// Low-latency mode: the ranks of one node (the world on one node; the layout's `local` is set across nodes only).
inline int ll_ranks_per_node(Buffers const& b) {
  return b.layout.nodes > 1 ? b.layout.local : b.world;
}

// Sets the inputs every dispatch kernel's Params reads from the call (rows, ids, weights, token count).
template <typename Params>
void set_dispatch_inputs(Params& p, DispatchArgs const& args) {
  p.x = args.x;
  p.topk_idx = args.topk_idx;
  p.topk_weights = args.topk_weights;
  p.num_tokens = args.num_tokens;
}

// The kernel invariants of a dispatch call every protocol relies on (FERRY_CHECK: a failure is a bug).
void check_dispatch_invariants(Buffers const& b, DispatchArgs const& args, bool refuse);

// Launch geometry chosen for a normal-mode leg, and the reason (for explain(): text the plan's owner keeps).
struct LaunchPlan {
  int ctas = 0;
  int push_ctas = 0;  // combine only
  uint8_t fallbacks = detail::kNoFallback;
  std::string why;
};

// Each launcher validates its arguments (to_params), picks the template instance (instances.cuh), launches on
// `stream` and returns the codec unit of the instance that ran (0: bf16) with its fallbacks in `record`.
// refuse: this rank refuses the call (EpBackendImpl::refuse_dispatch / refuse_combine): the kernel joins the exchange
// with its abort flag and moves no rows of its own (args: no tokens, no x or y).
LaunchPlan plan_dispatch(Buffers const& buffers, int num_tokens);
void launch_dispatch(Buffers const& buffers, DispatchArgs const& args, LaunchPlan const& plan, cudaStream_t stream,
                     bool refuse = false, detail::LegRecord* record = nullptr);
// skip_rows (with copy_rows, bf16 rows): fill the slots' layout and expert_src_row but not the rows (combine_backward's
// weight step writes them, scaled).
void launch_expand(Buffers const& buffers, bool copy_rows, cudaStream_t stream, bool skip_rows = false);
LaunchPlan plan_combine(Buffers const& buffers, int num_tokens);
// What a combine computes besides the forward combine (dispatch_backward: EpBackendImpl::combine_unweighted).
struct CombineVariant {
  bool unit_weights = false;  // expert-major entries take the weight 1 instead of recv_topk_weights
  bool y_fp32 = false;        // y is fp32 [num_tokens, hidden], the source's sum not rounded to bf16
};
void launch_combine(Buffers const& buffers, CombineArgs const& args, LaunchPlan const& plan, int num_tokens,
                    cudaStream_t stream, bool refuse = false, detail::LegRecord* record = nullptr,
                    CombineVariant variant = {});

// Calls launch(net) with the network transport the hierarchical protocol of `b` runs over (network_kind): Gin, or
// Emulated, whose endpoints (one per warp) must cover the leg's grid of `num_ctas` CTAs. The launchers instantiate
// their kernels for both.
template <class Launch>
void with_network(Buffers const& b, int num_ctas, char const* leg, Launch&& launch) {
  if (b.network_kind == transport::Kind::gin) {
    launch(b.gin);
    return;
  }
  FERRY_CHECK(b.network.areas != nullptr && num_ctas * kWarps <= b.network.num_areas, leg, " of ", num_ctas,
              " CTAs needs ", num_ctas * kWarps, " emulated network endpoints, the buffers have ", b.network.num_areas);
  launch(b.network);
}

// Rank masking across nodes (ll/mask.cu): calls launch(legs, agreement) with the networks its kernels reach the other
// nodes' ranks by: over GIN the legs' Gin and the agreement's own (each with its signal range), else the emulated
// network for both (its counters are window words). Thread s of those kernels (a thread per rank) opens endpoint s.
template <class Launch>
void with_mask_networks(Buffers const& b, char const* what, Launch&& launch) {
  if (b.network_kind == transport::Kind::gin) {
    launch(b.gin, b.mask_gin);
    return;
  }
  FERRY_CHECK(b.network.areas != nullptr && b.network.num_areas >= b.world, what,
              " needs an emulated network endpoint per rank (", b.world, "), the buffers have ", b.network.num_areas);
  launch(b.network, b.network);
}

// The Params of a hierarchical leg (hier/params.cuh): the one-node leg's `base` plus the network, the topology and the
// last dispatch's senders per token; the leg's launcher adds its own fields.
template <template <class> class HierParams, class Base, class Net>
HierParams<Net> hier_params(Buffers const& b, Base const& base, Net const& network) {
  HierParams<Net> p{};
  static_cast<Base&>(p) = base;
  p.network = network;
  p.nodes = b.topology.nodes;
  p.local = b.topology.local;
  p.hier_mask = b.hier_mask;
  return p;
}

// The hierarchical protocol (nodes > 1): launch_dispatch / launch_combine hand their Params here (hier/dispatch.cu,
// hier/combine.cu), which add the network transport and the topology and launch the two kernels of the leg.
void launch_hier_dispatch(Buffers const& buffers, DispatchParams const& params, IndexType ids, cudaStream_t stream,
                          detail::LegRecord* record);
void launch_hier_combine(Buffers const& buffers, CombineParams const& params, CombineLayout layout, cudaStream_t stream,
                         detail::LegRecord* record);

// What the last hierarchical leg of a rank sent to other ranks (EpBuffer::link_bytes: rows and their metadata, not
// the control words), counted by its kernels on the device. Reads the device words after synchronising `stream`
// (the stream of the leg). Zero before the first call and for the one-node protocols (which do not count).
enum class LinkLeg { dispatch = 0, combine = 1 };
LinkBytes hier_link_bytes(Buffers const& buffers, LinkLeg leg, cudaStream_t stream);

// A dispatch handle's device storage (EpBuffer::make_handle; normal/handle.cu): byte offsets of its areas, each
// 256-byte aligned. What the normal-mode combine and expand read of their dispatch (the rank-major metadata of this
// rank's symmetric region, recv_slot, token_mask, the layout words of DeviceState, expert_counts) and the source's own
// ids (int32) and weights, for a cached dispatch.
struct HandleLayout {
  std::size_t recv_idx = 0;       // [recv_capacity, topk] int32
  std::size_t recv_w = 0;         // [recv_capacity, topk] float
  std::size_t recv_src = 0;       // [recv_capacity, 2] int32
  std::size_t recv_slot = 0;      // [recv_capacity, topk] int32 (kept only when the dispatch expanded)
  std::size_t token_mask = 0;     // [max_tokens] uint32
  std::size_t state_words = 0;    // [kHandleStateWords] int32: num_recv, num_tokens, src_offset, src_count, src_tokens
  std::size_t expert_counts = 0;  // [num_local_experts] int32
  std::size_t topk_idx = 0;       // [max_tokens, topk] int32
  std::size_t topk_weights = 0;   // [max_tokens, topk] float
  std::size_t rank_counts = 0;    // [world, world] int32: the count matrix (count exchange only: not the landing zone)
  // hierarchical protocol only (what its combine reads of its dispatch, hier/combine.cuh): the senders of each token,
  // the records this rank received as a rail per source node, and their forward records
  std::size_t hier_mask = 0;       // [max_tokens] uint32
  std::size_t hier_fwd_count = 0;  // [kMaxCudaWorld] int32
  std::size_t hier_fwd_meta = 0;   // [nodes, max_tokens] records (SymLayout::hier_meta_bytes each)
  std::size_t total = 0;
};
// The storage of a normal-mode handle of a buffer whose symmetric layout is `layout` (the hierarchical areas when it
// has nodes > 1).
HandleLayout make_handle_layout(EpConfig const& config, int world, SymLayout const& layout);
// Enqueued after a normal-mode dispatch on the same stream (no host sync, graph-capturable): its layout and
// args.topk_idx / topk_weights (args.num_tokens tokens) into the handle storage at `storage` (make_handle_layout).
// expanded: the dispatch wrote recv_slot (expand); else recv_slot is not kept (it holds an older dispatch's slots).
void launch_save_handle(Buffers const& buffers, void* storage, DispatchArgs const& args, bool expanded,
                        cudaStream_t stream);
// The reverse: the handle's layout becomes the one combine reads (num_tokens: the handle's; expanded: its recv_slot
// was kept). Safe between calls: peers write this rank's receive areas only during a dispatch it joined.
void launch_restore_handle(Buffers const& buffers, void const* storage, int num_tokens, bool expanded,
                           cudaStream_t stream);
// EpBuffer::copy_received's copies (the handle copy kernel: whole words, int32 ids widened to int64 with ids_64).
void launch_received_copy(Buffers const& buffers, detail::EpBackendImpl::CopyPlan const& plan, cudaStream_t stream);

// combine_backward's weight step (normal/weight_grad.cuh), after the cached expert-major dispatch of grad_y (expert_x
// holds grad_y per filled slot): two kernels. The first (the grid, never waits): per filled slot of entry (row, k) the
// dot of expert_x with x (skipped with x null: 0) goes back to its source's weight_grad word (token, k), and expert_x
// becomes bf16(w * grad_y); then an arrival on every rank. The second (kWeightGradWaitCtas CTAs): waits for every
// rank's arrival (bounded) and writes grad_w [num_tokens, topk] (null: writes nothing). refuse: a refused
// combine_backward joins with no stores of its own (x, grad_w null).
void launch_weight_grad(Buffers const& buffers, void const* x, float* grad_w, int num_tokens, bool refuse,
                        cudaStream_t stream);

// Low-latency mode's grid, fixed per EpBuffer: `asked` CTAs by the tuning choice (`source` its reason), `agreed` the
// smallest any rank can run (at most one CTA per SM, kMaxCtas). Fewer CTAs than asked is a fallback
// (kFallbackGridClamped); a forced test fallback (force_fallback_for_test) halves the grid.
struct GridChoice {
  int ctas = 0;
  uint8_t fallbacks = detail::kNoFallback;
  std::string why;
};
GridChoice ll_grid(int asked, std::string source, int agreed);

// Low-latency mode: which halves a launch runs: both (one kernel per leg), or one of them (return_recv_hook).
enum class Half { both, send, recv };
void launch_ll_dispatch(Buffers const& buffers, DispatchArgs const& args, Half half, cudaStream_t stream,
                        bool refuse = false, detail::LegRecord* record = nullptr);
// num_tokens: this rank's tokens in the last dispatch (host copy, for the checks only).
void launch_ll_combine(Buffers const& buffers, CombineArgs const& args, int num_tokens, Half half, cudaStream_t stream,
                       bool refuse = false, detail::LegRecord* record = nullptr);

// Across nodes (layout.nodes > 1): the legs' instances over the buffers' network (ll/dispatch_net.cu,
// ll/combine_net.cu), from the one-node launchers' Params and variant.
void launch_ll_dispatch_net(Buffers const& buffers, cuda_ll::LlDispatchParams const& params, int variant,
                            std::size_t smem, cudaStream_t stream, detail::LegRecord* record);
void launch_ll_combine_net(Buffers const& buffers, cuda_ll::LlCombineParams const& params, int variant,
                           cudaStream_t stream, detail::LegRecord* record);

// Rank masking (EpConfig::rank_masking; ll/mask.cu): the legs' launchers above run the agreement first
// (launch_ll_agreement, on the leg's stream, with every half but the hook's receive half) and then the masked
// instances: one node (ll/masked.cu), across nodes over the buffers' network, the direct route
// (ll/masked_dispatch_net.cu, ll/masked_combine_net.cu).
void launch_ll_masked_dispatch(Buffers const& buffers, cuda_ll::LlDispatchParams const& params, int variant,
                               std::size_t smem, cudaStream_t stream, detail::LegRecord* record);
void launch_ll_masked_combine(Buffers const& buffers, cuda_ll::LlCombineParams const& params, int variant,
                              cudaStream_t stream, detail::LegRecord* record);
void launch_ll_masked_dispatch_net(Buffers const& buffers, cuda_ll::LlDispatchParams const& params, int variant,
                                   std::size_t smem, cudaStream_t stream, detail::LegRecord* record);
void launch_ll_masked_combine_net(Buffers const& buffers, cuda_ll::LlCombineParams const& params, int variant,
                                  cudaStream_t stream, detail::LegRecord* record);
void launch_ll_agreement(Buffers const& buffers, detail::LlMaskLeg leg, cudaStream_t stream);
// The mask words after `stream`'s work (synchronises it).
detail::LlMaskWords read_ll_mask(Buffers const& buffers, cudaStream_t stream);
// This rank's request (EpBuffer::mask_ranks: the ranks it asks for, in [0, world)), carried by its next agreements.
void request_ll_mask(Buffers const& buffers, std::vector<int> const& ranks);
// clear_mask's two steps on one rank (its stream idle): its counters, then (with everyone's merged:
// detail::merge_call_counters) the reset of its counters, its region's arrival counters and its mask, on `stream`.
detail::LlCallCounters ll_call_counters(Buffers const& buffers, cudaStream_t stream);
void reset_ll_mask(Buffers const& buffers, detail::LlCallCounters const& to, cudaStream_t stream);
// clear_mask across nodes (ll/mask.cuh, ll_counters_kernel): the counters the ranks of other nodes add to, put back
// in step through the network. read_network_counters: this rank's counters of each other node's source,
// [kNetworkCounters][world] (synchronises `stream`; zeros on one node). realign_network_counters, with every rank's
// reads (counters[r]: rank r's): adds to each rank of another node what its counters of this rank lack of the
// targets, then waits (bounded) until this rank's counters of the other nodes' sources reach them. Nothing on one
// node. Every rank runs both, with an allgather between, before reset_ll_mask.
std::vector<uint64_t> read_network_counters(Buffers const& buffers, cudaStream_t stream);
void realign_network_counters(Buffers const& buffers, detail::LlCallCounters const& to,
                              std::vector<std::vector<uint64_t>> const& counters, cudaStream_t stream);

// Most local experts of an expert-major layout (a low-latency EpBuffer; a normal-mode one with expert_capacity): the
// kernels that build it (expert_layout.cuh) keep two counters per local expert in shared memory (expand_smem_bytes),
// next to ~12 KiB of their own, under the 48 KiB a launch gets by default.
inline constexpr int kMaxLayoutLocalExperts = 4096;

}  // namespace ferry::cuda_ep
