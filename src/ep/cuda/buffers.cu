// One EpBuffer's device memory on the cuda backend, every protocol's: the symmetric layout, the local buffers, the
// views a dispatch returns and the prologue of every kernel's Params.
#include "ep/cuda/buffers.hpp"

#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda_check.hpp"
#include "ep/cuda/device_memory.hpp"
#include "ep/cuda/landing.cuh"
#include "ferry/error.hpp"
#include "wire/layout.hpp"

namespace ferry::cuda_ep {

using detail::device_alloc;
using detail::device_free;
using detail::device_zeroed;

void configure_buffers(Buffers& b, EpConfig const& config, int world, int rank, Protocol protocol, int num_sms) {
  b.config = config;
  b.protocol = protocol;
  b.world = world;
  b.rank = rank;
  b.num_sms = num_sms;
  b.num_local_experts = config.num_local_experts(world);
  b.expert_slots = config.expert_slots();
  b.recv_row_bytes = config.recv_row_bytes();
  b.recv_capacity = protocol == Protocol::ll ? world * config.max_tokens_per_rank : config.recv_capacity(world);
  b.max_dispatch_ctas = num_sms;
  b.land_ctas = std::min(num_sms, kMaxLandCtas);
}

void allocate_buffers(Buffers& b) {
  EpConfig const& config = b.config;
  std::size_t const max_tokens = static_cast<std::size_t>(config.max_tokens_per_rank);
  std::size_t const topk = static_cast<std::size_t>(config.topk);
  std::size_t const rows = static_cast<std::size_t>(b.recv_capacity);
  bool const ll = b.protocol == Protocol::ll;
  try {
    // 1. every protocol
    b.state = device_zeroed<DeviceState>(1);
    b.token_mask = device_alloc<uint32_t>(max_tokens * static_cast<std::size_t>(ferry::detail::rank_words(b.world)));
    b.expert_counts = device_zeroed<int32_t>(static_cast<std::size_t>(b.num_local_experts));
    FERRY_CHECK_CUDA(cudaHostAlloc(reinterpret_cast<void**>(&b.host_words),
                                   (1 + static_cast<std::size_t>(b.num_local_experts)) * sizeof(int32_t),
                                   cudaHostAllocDefault));
    b.recv_slot = device_alloc<int32_t>(rows * topk);
    if (config.wait_stats)
      b.wait_stats = device_zeroed<wait_stats::Slot>(static_cast<std::size_t>(wait_stats::kLegs) * b.world);
    if (b.expert_slots > 0) {
      std::size_t const slots = static_cast<std::size_t>(b.num_local_experts) * b.expert_slots;
      b.expert_x = device_alloc<uint8_t>(slots * b.recv_row_bytes);
      b.expert_src_row = device_alloc<int32_t>(slots);
      if (config.delivers_quantized()) {
        // NOTE: zeroed once: the kernels write only the entries of (slot, block) pairs, so padding entries stay zero
        // for every later call without a per-call memset.
        b.expert_scale_bytes =
            scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, b.expert_slots, config.hidden);
        b.expert_scales = device_zeroed<uint8_t>(b.expert_scale_bytes * b.num_local_experts);
        if (config.dispatch_format == WireFormat::nvfp4) b.expert_token_scales = device_alloc<float>(slots);
      }
    }
    if (ll) {
      // 2. low-latency mode: the rank-major metadata is local (the rows land in the symmetric landing zone)
      b.recv_src = device_alloc<int32_t>(rows * 2);
      b.recv_idx = device_alloc<int32_t>(rows * topk);
      b.recv_w = device_alloc<float>(rows * topk);
      b.own_slot = device_alloc<int32_t>(max_tokens * topk);
      if (b.layout.ll.fwd_rows != 0) {
        // the forward route: what the rail placed, for its combine (per source node: tokens, their ranks here)
        std::size_t const nodes = static_cast<std::size_t>(b.layout.nodes);
        b.ll_fwd_num = device_zeroed<int32_t>(nodes);
        b.ll_fwd_mask = device_zeroed<uint32_t>(nodes * max_tokens);
      }
      if (config.rank_masking) {
        // rank masking: the mapped words the host and the agreement share, and the entries' ranks for the combine
        FERRY_CHECK_CUDA(
            cudaHostAlloc(reinterpret_cast<void**>(&b.mask_host), sizeof(detail::LlMaskHost), cudaHostAllocMapped));
        *b.mask_host = detail::LlMaskHost{};
        FERRY_CHECK_CUDA(cudaHostGetDevicePointer(reinterpret_cast<void**>(&b.mask_host_device), b.mask_host, 0));
        b.ll_entry_rank = device_alloc<int16_t>(max_tokens * topk);
        FERRY_CHECK_CUDA(cudaMemcpy(&b.state->ll.mask.entry_rank, &b.ll_entry_rank, sizeof(b.ll_entry_rank),
                                    cudaMemcpyHostToDevice));
      }
      if (config.rank_masking && b.layout.nodes > 1)
        b.mask_counter_add = device_zeroed<uint64_t>(kLlMaskNetworkCounters * static_cast<std::size_t>(b.world));
      if (b.layout.nodes > 1 && b.network_kind == transport::Kind::emulated) {
        // across nodes over the emulated network: an endpoint per warp of each leg's grid (dispatch, then combine);
        // rank masking's kernels, a thread per rank, one per rank
        b.network.num_areas = std::max(2 * b.num_ctas * kWarps, config.rank_masking ? b.world : 0);
        b.network.areas = device_zeroed<transport::EmulatedArea>(static_cast<std::size_t>(b.network.num_areas));
      }
      return;
    }
    // 3. normal mode
    b.token_pos = device_alloc<int32_t>(max_tokens * b.world);
    b.block_counts = device_alloc<int32_t>(static_cast<std::size_t>(b.max_dispatch_ctas) * b.world);
    b.count_totals = device_zeroed<int32_t>(static_cast<std::size_t>(b.world + config.num_experts + 1));
    if (config.dispatch_format == WireFormat::nvfp4) b.token_scales = device_alloc<float>(max_tokens);
    if (b.protocol == Protocol::hierarchical) {
      // 4. the hierarchical protocol: its layout words, and the network's endpoints (one per warp of the widest grid)
      std::size_t const nodes = static_cast<std::size_t>(b.topology.nodes);
      b.node_pos = device_alloc<int32_t>(max_tokens * nodes);
      b.hier_mask = device_zeroed<uint32_t>(max_tokens);
      if (config.combine_format != WireFormat::bf16)
        b.rail_partials = device_alloc<uint16_t>(nodes * max_tokens * static_cast<std::size_t>(config.hidden));
      if (b.network_kind == transport::Kind::emulated) {
        b.network.num_areas = std::max(b.max_dispatch_ctas, b.num_sms) * kWarps;
        b.network.areas = device_zeroed<transport::EmulatedArea>(static_cast<std::size_t>(b.network.num_areas));
      }
    }
    // NOTE: scale tensors are zeroed once: calls write every (row, block) entry of the rows they deliver and never the
    // padding entries (rows or blocks past the end), which the layouts define as zero.
    if (config.delivers_quantized() && config.recv_scale_layout != ScaleLayout::row_major)
      b.recv_scales_final = device_zeroed<uint8_t>(
          scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, b.recv_capacity, config.hidden));
  } catch (...) {
    free_buffers(b);
    throw;
  }
}

void free_buffers(Buffers& b) noexcept {
  device_free(b.state);
  device_free(b.token_mask);
  device_free(b.wait_stats);
  device_free(b.expert_counts);
  device_free(b.recv_slot);
  device_free(b.expert_x);
  device_free(b.expert_src_row);
  device_free(b.expert_scales);
  device_free(b.expert_token_scales);
  device_free(b.recv_src);
  device_free(b.recv_idx);
  device_free(b.recv_w);
  device_free(b.own_slot);
  device_free(b.token_pos);
  device_free(b.block_counts);
  device_free(b.count_totals);
  device_free(b.token_scales);
  device_free(b.recv_scales_final);
  device_free(b.node_pos);
  device_free(b.hier_mask);
  device_free(b.rail_partials);
  device_free(b.network.areas);
  device_free(b.ll_fwd_num);
  device_free(b.ll_fwd_mask);
  device_free(b.ll_entry_rank);
  device_free(b.mask_counter_add);
  if (b.mask_host != nullptr) cudaFreeHost(b.mask_host);  // NOTE: never throws (free_buffers is noexcept)
  if (b.host_words != nullptr) cudaFreeHost(b.host_words);
  b.host_words = nullptr;
  b.mask_host = nullptr;
  b.mask_host_device = nullptr;
  b.expert_scale_bytes = 0;
}

DispatchResult dispatch_result(Buffers const& b, bool expand) {
  DispatchResult result;
  result.num_recv = &b.state->num_recv;
  result.expert_counts = b.expert_counts;
  result.recv_capacity = b.recv_capacity;
  result.recv_row_bytes = b.recv_row_bytes;
  if (expand || b.protocol == Protocol::ll) {
    result.expert_x = b.expert_x;
    result.expert_src_row = b.expert_src_row;
    result.expert_slots = b.expert_slots;
    result.expert_scales = b.expert_scales;              // null unless quantized delivery
    result.expert_token_scales = b.expert_token_scales;  // null unless nvfp4 delivery
  }
  if (b.protocol == Protocol::ll) {
    result.recv_x = nullptr;  // low-latency mode returns the expert-major layout (see DispatchResult)
    result.recv_topk_idx = b.recv_idx;
    result.recv_topk_weights = b.recv_w;
    result.recv_src = b.recv_src;
    return result;
  }
  char* const sym = b.sym.peer(b.rank);
  result.recv_x = sym + b.layout.normal.recv_x;
  if (b.config.delivers_quantized()) {
    result.recv_scales = b.recv_scales_final ? b.recv_scales_final : sym + b.layout.normal.recv_scales;
    if (b.config.dispatch_format == WireFormat::nvfp4)
      result.recv_token_scales = reinterpret_cast<float*>(sym + b.layout.normal.recv_token_scales);
  }
  result.recv_topk_idx = reinterpret_cast<int32_t*>(sym + b.layout.normal.recv_idx);
  result.recv_topk_weights = reinterpret_cast<float*>(sym + b.layout.normal.recv_w);
  result.recv_src = reinterpret_cast<int32_t*>(sym + b.layout.normal.recv_src);
  return result;
}

LinkBytes hier_link_bytes(Buffers const& b, LinkLeg leg, cudaStream_t stream) {
  unsigned long long words[3] = {0, 0, 0};
  FERRY_CHECK_CUDA(cudaMemcpyAsync(words, b.state->hier.bytes[static_cast<int>(leg)], sizeof(words),
                                   cudaMemcpyDeviceToHost, stream));
  FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  return LinkBytes{words[0], words[1], words[2]};
}

KernelParams common_params(Buffers const& b, int ctas, bool refuse, std::optional<TraceKernel> traced) {
  KernelParams p{};
  p.view = b.view;
  // every rank's window by world rank; low-latency mode across nodes holds its node's (ll/params.cuh "Wider worlds")
  p.net = b.protocol == Protocol::ll && b.layout.nodes > 1 ? transport::make_node_lsa(b.sym, b.rank, b.layout.local)
                                                           : transport::make_lsa(b.sym, b.rank, b.world);
  p.layout = b.layout;
  p.state = b.state;
  p.abort = refuse;
  p.hidden = b.config.hidden;
  p.topk = b.config.topk;
  p.max_tokens = b.config.max_tokens_per_rank;
  p.num_ctas = ctas;
  p.trace = b.trace && traced ? b.trace->launch(*traced, ctas, kWarps) : trace::TraceView{};
  return p;
}

cuda_ll::LlParams ll_params(Buffers const& b, bool refuse, TraceKernel traced) {
  FERRY_CHECK(b.num_ctas >= 1 && b.num_ctas <= cuda_ll::kMaxCtas, "LL grid of ", b.num_ctas, " CTAs is outside [1, ",
              cuda_ll::kMaxCtas, "]");
  cuda_ll::LlParams p{};
  static_cast<KernelParams&>(p) = common_params(b, b.num_ctas, refuse, traced);
  p.local = ll_ranks_per_node(b);
  p.nodes = b.layout.nodes > 1 ? b.layout.nodes : 1;
  p.forward = b.layout.ll.fwd_rows != 0;
  p.fwd_num = b.ll_fwd_num;
  p.fwd_mask = b.ll_fwd_mask;
  p.expert_slots = b.expert_slots;
  p.token_mask = b.token_mask;
  p.recv_src = b.recv_src;
  p.recv_idx = b.recv_idx;
  p.recv_w = b.recv_w;
  p.recv_slot = b.recv_slot;
  p.wait_stats = b.wait_stats;
  return p;
}

// Kernel invariants only (FERRY_CHECK: a failure is a bug): the arguments were validated once by EpBuffer
// (validate_dispatch_args / validate_combine_args), which refuses a bad call on every rank. An InputError thrown by a
// launcher would be refused on this rank alone, the desync docs/errors.md rules out.
void check_dispatch_invariants(Buffers const& b, DispatchArgs const& args, bool refuse) {
  FERRY_CHECK(!refuse || args.num_tokens == 0, "a refused dispatch joins with no tokens, not ", args.num_tokens);
  FERRY_CHECK(args.num_tokens >= 0 && args.num_tokens <= b.config.max_tokens_per_rank, "num_tokens=", args.num_tokens,
              " is outside [0, max_tokens_per_rank=", b.config.max_tokens_per_rank, "]");
  FERRY_CHECK(args.num_tokens == 0 || (args.x && args.topk_idx && args.topk_weights),
              "x, topk_idx and topk_weights must be non-null for num_tokens=", args.num_tokens);
}

}  // namespace ferry::cuda_ep
