// Host-side description of one EpBuffer's device memory on the cuda backend, shared by the launchers (dispatch.cu,
// expand.cu, combine.cu) and the backend (cuda_ep.cu). Included by .cu files only (params.cuh is CUDA).
#pragma once

#include <cuda_runtime.h>

#include <string>

#include "ep/cuda/params.cuh"
#include "ferry/ep.hpp"
#include "trace/cuda/recorder.hpp"
#include "tuning/choose.hpp"

namespace ferry::cuda_ep {

struct Buffers {
  EpConfig config;
  int world = 0;
  int rank = 0;
  int num_local_experts = 0;
  int recv_capacity = 0;
  int expert_slots = 0;
  int num_sms = 0;
  DeviceView view{};
  SymmetricView sym{};
  SymLayout layout;
  DeviceState* state = nullptr;
  uint32_t* token_mask = nullptr;   // [max_tokens]
  int32_t* token_pos = nullptr;     // [max_tokens, world]
  int32_t* block_counts = nullptr;  // [max_dispatch_ctas, world] rows per destination of each dispatch CTA
  int32_t* count_totals = nullptr;  // [world + num_experts + 1] the dispatch's running totals (zero between calls)
  float* token_scales = nullptr;    // [max_tokens] nvfp4 dispatch_format: per-token scales of the call's tokens
  int max_dispatch_ctas = 0;
  // Launch the persistent grids (dispatch, combine) cooperatively: the runtime refuses a grid that cannot be
  // co-resident. Only the virtual-rank test turns it off: it runs several ranks' grids side by side on one GPU, each of
  // num_sms / world CTAs, so that all of them fit.
  bool cooperative = true;
  // Dispatch protocol, fixed at construction (ep/landing_policy.hpp): the landing zone of small batches
  // (land_dispatch.cuh, a grid of land_ctas CTAs on every call) or the count exchange (dispatch.cuh).
  bool landing = false;
  int land_ctas = 0;
  std::string landing_why;
  int32_t* expert_counts = nullptr;  // [num_local_experts]
  int32_t* recv_slot = nullptr;      // [recv_capacity, topk]
  std::size_t recv_row_bytes = 0;    // EpConfig::recv_row_bytes(): bf16 row or quantized payload
  // Quantized delivery in a scale layout other than row_major: the scale tensor of recv_capacity rows the receiver
  // pass fills from the row-major recv_scales (zeroed once: padding entries stay zero). Null otherwise (the
  // symmetric recv_scales is the output).
  void* recv_scales_final = nullptr;
  void* expert_x = nullptr;           // [num_local_experts, expert_slots, recv_row_bytes] (expert_capacity set)
  int32_t* expert_src_row = nullptr;  // [num_local_experts, expert_slots]
  // Quantized delivery with expert_capacity: one scale tensor of expert_slots rows per local expert (zeroed once),
  // and nvfp4's token scales [num_local_experts, expert_slots].
  std::size_t expert_scale_bytes = 0;  // scale_tensor_bytes(dispatch_format, recv_scale_layout, expert_slots, hidden)
  void* expert_scales = nullptr;
  float* expert_token_scales = nullptr;
  // Launch geometry inputs fixed at construction: the EpConfig pin and the tuning table rows of this GPU model and
  // shape (plan_dispatch / plan_combine add the env pins and the analytic default per call).
  tuning::LegTuning dispatch_tuning;
  tuning::LegTuning combine_tuning;
  trace::DeviceRecorder* trace = nullptr;  // in-kernel trace buffers (src/trace/), owned by the backend
};

// The symmetric region's layout for a config (the same on every rank); `landing` adds the landing zone's areas.
SymLayout make_sym_layout(EpConfig const& config, int world, bool landing);

// Allocates a rank's local device buffers (state, token mask and positions, the dispatch's counters, recv_slot, the
// scale tensors, the expert-major outputs) for b.config, b.world, b.num_local_experts, b.recv_capacity,
// b.expert_slots and b.num_sms, which must be set; zeroes the state, the counters and the scale tensors with
// cudaMemset (the default stream: synchronize the device before another stream uses them). Throws CudaError; then
// nothing stays allocated.
void allocate_buffers(Buffers& b);
// Frees what allocate_buffers allocated and nulls the pointers (again: a no-op). Never throws.
void free_buffers(Buffers& b) noexcept;
// The views a dispatch returns (device pointers into b; num_recv_host not set): what EpBuffer::dispatch hands out.
// expand: the call laid the rows out expert-major (DispatchArgs::expand).
DispatchResult dispatch_result(Buffers const& b, bool expand);

// Launch geometry chosen for a leg, and the reason (for explain()).
struct LaunchPlan {
  int ctas = 0;
  int push_ctas = 0;  // combine only
  std::string why;
};

// Each launcher validates its arguments (to_params), picks the template instance and launches on `stream`.
// refuse: this rank refuses the call (EpBackendImpl::refuse_dispatch / refuse_combine): the kernel joins the exchange
// with its abort flag and moves no rows of its own (args: no tokens, no x or y).
LaunchPlan plan_dispatch(Buffers const& buffers, int num_tokens);
void launch_dispatch(Buffers const& buffers, DispatchArgs const& args, LaunchPlan const& plan, cudaStream_t stream,
                     bool refuse = false);
void launch_expand(Buffers const& buffers, bool copy_rows, cudaStream_t stream);
LaunchPlan plan_combine(Buffers const& buffers, int num_tokens);
void launch_combine(Buffers const& buffers, CombineArgs const& args, LaunchPlan const& plan, int num_tokens,
                    cudaStream_t stream, bool refuse = false);

}  // namespace ferry::cuda_ep
