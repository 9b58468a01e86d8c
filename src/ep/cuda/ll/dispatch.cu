// Host launcher of the low-latency dispatch kernel (ll/dispatch.cuh): validation, template instance, launch. The
// instances over a network (across nodes) are ll/dispatch_net.cu's.
#include "core/cuda_check.hpp"
#include "ep/capacity.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/instances.cuh"

namespace ferry::cuda_ep {

using cuda_ll::LlDispatchParams;

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants in buffers.cu says why).
LlDispatchParams ll_dispatch_params(Buffers const& b, DispatchArgs const& args, bool refuse) {
  check_dispatch_invariants(b, args, refuse);
  FERRY_CHECK(b.num_local_experts >= 1 && b.num_local_experts <= kMaxLayoutLocalExperts,
              "num_local_experts=", b.num_local_experts, " is outside [1, ", kMaxLayoutLocalExperts, "]");
  WireFormat const format = b.config.dispatch_format;
  // Pre-quantized arguments were validated by EpBuffer (validate_dispatch_args); the kernel relies on these two.
  bool const prequantized = args.x_scales != nullptr;
  FERRY_CHECK(!prequantized || format != WireFormat::bf16, "x_scales is set but dispatch_format=bf16");
  FERRY_CHECK(!prequantized || format != WireFormat::nvfp4 || args.num_tokens == 0 || args.x_token_scales,
              "pre-quantized nvfp4 input needs x_token_scales");
  LlDispatchParams p{};
  static_cast<cuda_ll::LlParams&>(p) = ll_params(b, refuse, TraceKernel::ll_dispatch);
  set_dispatch_inputs(p, args);
  FERRY_CHECK(args.x_repeat >= 1, "x_repeat=", args.x_repeat, " reached the kernel (EpBuffer refuses it)");
  p.x_row = ferry::detail::RowDivider::of(args.x_repeat);
  p.x_group = ferry::detail::entry_group(b.config, args.x_repeat);
  p.x_scales = args.x_scales;
  p.x_token_scales = args.x_token_scales;
  p.num_experts = b.config.num_experts;
  p.num_local_experts = b.num_local_experts;
  p.expert_counts = b.expert_counts;
  p.expert_x = b.expert_x;
  p.expert_src_row = b.expert_src_row;
  p.own_slot = b.own_slot;
  p.own_direct = b.own_direct;
  p.expert_row_bytes = b.recv_row_bytes;
  p.dequantize = format != WireFormat::bf16 && b.config.dispatch_dequantize;
  p.scale_layout = b.config.recv_scale_layout;
  p.scale_tensor_bytes = b.expert_scale_bytes;
  p.expert_scales = b.expert_scales;
  p.expert_token_scales = b.expert_token_scales;
  return p;
}

void launch_ll_dispatch(Buffers const& buffers, DispatchArgs const& args, Half half, cudaStream_t stream, bool refuse,
                        detail::LegRecord* record) {
  LlDispatchParams p = ll_dispatch_params(buffers, args, refuse);
  p.halves = halves_of(half);
  FERRY_CHECK(args.topk_idx_type == IndexType::int32 || args.topk_idx_type == IndexType::int64,
              "topk_idx_type=", static_cast<int>(args.topk_idx_type), " is not int32 or int64");
  int const variant = LlDispatchFamily<cuda_ll::OneNode>::variant(args.topk_idx_type);
  // both halves expand (the send half a bf16 dispatch's own rows): per-expert counters in shared memory
  std::size_t const smem = cuda_ll::expand_smem_bytes(p.num_local_experts);
  detail::LegRecord* const leg = half == Half::recv ? nullptr : record;  // the send half's codec is the leg's
  if (buffers.config.rank_masking) {
    // NOTE: the agreement opens the call (its send half); across nodes CudaEp runs the direct route with masking
    FERRY_CHECK(buffers.layout.nodes == 1 || buffers.layout.ll.fwd_rows == 0,
                "rank masking across nodes runs the direct route");
    if (half != Half::recv && !buffers.test_agreement_apart)
      launch_ll_agreement(buffers, detail::LlMaskLeg::dispatch, stream);
    if (buffers.layout.nodes > 1)
      launch_ll_masked_dispatch_net(buffers, p, variant, smem, stream, leg);
    else
      launch_ll_masked_dispatch(buffers, p, variant, smem, stream, leg);
    return;
  }
  if (buffers.layout.nodes > 1) {
    launch_ll_dispatch_net(buffers, p, variant, smem, stream, leg);
    return;
  }
  launch_ll<LlDispatchFamily<cuda_ll::OneNode>>(buffers, p, cuda_ll::OneNode{}, buffers.config.dispatch_format, variant,
                                                smem, stream, leg);
}

}  // namespace ferry::cuda_ep
