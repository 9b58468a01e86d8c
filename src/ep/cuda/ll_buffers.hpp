// Host-side description of one low-latency EpBuffer's device memory on the cuda backend, shared by the LL launchers
// (ll_dispatch.cu, ll_combine.cu), the LL backend (ll_ep.cu) and the virtual-rank test (tests/gpu/test_ll_virtual.cu,
// several ranks' buffers on one GPU). Included by .cu files only (ll_params.cuh is CUDA).
#pragma once

#include <cuda_runtime.h>

#include "ep/cuda/ll_params.cuh"
#include "ferry/ep.hpp"
#include "trace/cuda/recorder.hpp"

namespace ferry::cuda_ll {

struct LlBuffers {
  EpConfig config;  // resolved (expert_capacity set)
  int world = 0;
  int rank = 0;
  int num_local_experts = 0;
  int expert_slots = 0;
  int num_ctas = 0;  // the same on every rank (agreed at construction)
  // Launch the grids cooperatively (the runtime refuses a grid that cannot be co-resident). Only the virtual-rank
  // tests turn it off: they run several ranks' grids side by side on one GPU, sized so that all of them fit.
  bool cooperative = true;
  // bf16 dispatch: the send half copies this rank's own rows from x into their slots (FERRY_LL_OWN_ROWS=direct)
  // instead of staging them in the landing zone.
  bool own_direct = false;
  DeviceView view{};
  SymmetricView sym{};
  LlLayout layout;
  LlState* state = nullptr;
  uint32_t* token_mask = nullptr;     // [max_tokens]
  int32_t* recv_src = nullptr;        // [world * max_tokens, 2]
  int32_t* recv_idx = nullptr;        // [world * max_tokens, topk]
  float* recv_w = nullptr;            // [world * max_tokens, topk]
  int32_t* recv_slot = nullptr;       // [world * max_tokens, topk]
  int32_t* expert_counts = nullptr;   // [num_local_experts]
  void* expert_x = nullptr;           // [num_local_experts, expert_slots, config.recv_row_bytes()]
  int32_t* expert_src_row = nullptr;  // [num_local_experts, expert_slots]
  int32_t* own_slot = nullptr;        // [max_tokens, topk]
  // Quantized delivery (config.delivers_quantized()): one scale tensor per local expert, scale_tensor_bytes each
  // (zeroed once: padding entries stay zero), and nvfp4's per-token scales [num_local_experts, expert_slots].
  std::size_t scale_tensor_bytes = 0;
  void* expert_scales = nullptr;
  float* expert_token_scales = nullptr;
  trace::DeviceRecorder* trace = nullptr;  // in-kernel trace buffers (src/trace/), owned by the backend
};

// The symmetric region's layout for a config (the same on every rank).
LlLayout make_ll_layout(EpConfig const& config, int world);

// Allocates a rank's local device buffers (state, token_mask, recv_*, expert_*, quantized delivery's scales, nvfp4
// combine's scratch) for b.config, b.world, b.num_local_experts, b.expert_slots and b.num_ctas, which must be set;
// zeroes the state, the expert counts and the scale tensors, on the current device with cudaMemset (the default
// stream: synchronize the device before another stream uses them). Throws CudaError; then nothing stays allocated.
void allocate_ll_buffers(LlBuffers& b);
// Frees what allocate_ll_buffers allocated and nulls the pointers (again: a no-op). Never throws.
void free_ll_buffers(LlBuffers& b) noexcept;
// The views a dispatch returns (device pointers into b; num_recv_host not set): what EpBuffer::dispatch hands out.
DispatchResult ll_dispatch_result(LlBuffers const& b);

// Which halves a launch runs: both (one kernel per leg), or one of them (return_recv_hook).
enum class Half { both, send, recv };

// Each launcher validates its arguments (to_params), picks the template instance and launches on `stream`.
// refuse: this rank refuses the call (EpBackendImpl::refuse_dispatch / refuse_combine): the halves join the exchange
// with its abort word and move no rows of its own (args: no tokens, no x or y).
void launch_ll_dispatch(LlBuffers const& buffers, DispatchArgs const& args, Half half, cudaStream_t stream,
                        bool refuse = false);
// num_tokens: this rank's tokens in the last dispatch (host copy, for the checks only).
void launch_ll_combine(LlBuffers const& buffers, CombineArgs const& args, int num_tokens, Half half,
                       cudaStream_t stream, bool refuse = false);

// Most local experts of an LL EpBuffer on the cuda backend: the dispatch kernels keep two counters per local
// expert in shared memory (expand_smem_bytes), next to ~12 KiB of its own, under the 48 KiB a launch gets by default.
inline constexpr int kMaxLlLocalExperts = 4096;

}  // namespace ferry::cuda_ll
