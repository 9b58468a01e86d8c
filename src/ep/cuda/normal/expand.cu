// Host launcher of the expert-major layout kernel (normal/expand.cuh).
#include <algorithm>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/normal/expand.cuh"

namespace ferry::cuda_ep {
namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants in buffers.cu says why).
ExpandParams to_params(Buffers const& b, bool copy_rows, bool skip_rows) {
  FERRY_CHECK(b.expert_slots > 0, "the expert-major layout needs EpConfig::expert_capacity (rows per local ",
              "expert); set it when creating the EpBuffer");
  FERRY_CHECK(!copy_rows || (b.expert_x && b.expert_src_row), "expert-major buffers are not allocated");
  FERRY_CHECK(!copy_rows || !b.config.delivers_quantized() || b.expert_scales,
              "expert-major scale tensors are not allocated");
  FERRY_CHECK(b.num_local_experts >= 1 && b.num_local_experts <= kMaxLayoutLocalExperts,
              "num_local_experts=", b.num_local_experts, " is outside [1, ", kMaxLayoutLocalExperts, "]");
  // NOTE: one CTA per SM, each an even share of the hits (expert_layout.cuh); its CTAs never wait for each other, so
  // the grid need not be co-resident.
  ExpandParams p{};
  static_cast<KernelParams&>(p) = common_params(b, std::max(1, b.num_sms), false, std::nullopt);
  p.sym_local = b.sym.peer(b.rank);
  p.row_bytes = b.recv_row_bytes;
  // NOTE: dispatch_dequantize delivers bf16 rows: expand copies them like bf16 transport.
  p.format = b.config.delivers_quantized() ? b.config.dispatch_format : WireFormat::bf16;
  p.scale_layout = b.config.recv_scale_layout;
  p.expert_scale_bytes = b.expert_scale_bytes;
  p.expert_scales = b.expert_scales;
  p.expert_token_scales = b.expert_token_scales;
  p.num_local_experts = b.num_local_experts;
  p.expert_slots = b.expert_slots;
  p.recv_capacity = b.recv_capacity;
  p.recv_slot = b.recv_slot;
  p.expert_x = b.expert_x;
  p.expert_src_row = b.expert_src_row;
  p.skip_rows = skip_rows;
  return p;
}

}  // namespace

void launch_expand(Buffers const& buffers, bool copy_rows, cudaStream_t stream, bool skip_rows) {
  FERRY_CHECK(!skip_rows || (copy_rows && !buffers.config.delivers_quantized()),
              "skip_rows belongs to combine_backward's expand of bf16 rows");
  ExpandParams const p = to_params(buffers, copy_rows, skip_rows);
  unsigned const ctas = static_cast<unsigned>(p.num_ctas);
  std::size_t const smem = expand_smem_bytes(p.num_local_experts);  // per-expert counters
  if (copy_rows && p.format != WireFormat::bf16)
    expand_kernel<true, true><<<ctas, kThreads, smem, stream>>>(p);
  else if (copy_rows)
    expand_kernel<true><<<ctas, kThreads, smem, stream>>>(p);
  else
    expand_kernel<false><<<ctas, kThreads, smem, stream>>>(p);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ferry::cuda_ep
