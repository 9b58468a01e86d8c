// Host-side description of one low-latency EpBuffer's device memory on the cuda backend, shared by the LL launchers
// (ll_dispatch.cu, ll_combine.cu) and the LL backend (ll_ep.cu). Included by .cu files only (ll_params.cuh is CUDA).
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
  int num_ctas = 0;      // the same on every rank (agreed at construction)
  int expert_parts = 1;  // CTAs per local expert in the dispatch receive half
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
  int32_t* slot_landing = nullptr;    // [num_local_experts, expert_slots]
  // Quantized delivery (config.delivers_quantized()): one scale tensor per local expert, scale_tensor_bytes each
  // (zeroed once: padding entries stay zero), and nvfp4's per-token scales [num_local_experts, expert_slots].
  std::size_t scale_tensor_bytes = 0;
  void* expert_scales = nullptr;
  float* expert_token_scales = nullptr;
  // combine_format nvfp4: one bf16 row per warp of the grid (LlCombineParams::scratch).
  void* combine_scratch = nullptr;
  trace::DeviceRecorder* trace = nullptr;  // in-kernel trace buffers (src/trace/), owned by the backend
};

// The symmetric region's layout for a config (the same on every rank).
LlLayout make_ll_layout(EpConfig const& config, int world);

// Which halves a launch runs: both (one kernel per leg), or one of them (return_recv_hook).
enum class Half { both, send, recv };

// Each launcher validates its arguments (to_params), picks the template instance and launches on `stream`.
void launch_ll_dispatch(LlBuffers const& buffers, DispatchArgs const& args, Half half, cudaStream_t stream);
// num_tokens: this rank's tokens in the last dispatch (host copy, for the checks only).
void launch_ll_combine(LlBuffers const& buffers, CombineArgs const& args, int num_tokens, Half half,
                       cudaStream_t stream);

// Cooperative launch of an LL grid: the one-kernel legs wait inside the grid for this rank's own send CTAs, so the
// grid must be co-resident; the runtime refuses one that cannot be instead of letting it deadlock until the timeout.
template <typename Params>
void launch_ll_grid(void (*kernel)(Params), Params const& params, int ctas, cudaStream_t stream);

}  // namespace ferry::cuda_ll
