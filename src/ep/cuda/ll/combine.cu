// Host launcher of the low-latency combine kernel (ll/combine.cuh): validation, template instance, launch. The
// instances over a network (across nodes) are ll/combine_net.cu's.
#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/instances.cuh"

namespace ferry::cuda_ep {

using cuda_ll::LlCombineParams;

namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants in buffers.cu says why).
LlCombineParams to_params(Buffers const& b, CombineArgs const& args, int num_tokens, bool refuse) {
  FERRY_CHECK(refuse || num_tokens == 0 || args.y != nullptr, "combine y is null for num_tokens=", num_tokens,
              " of the last dispatch");
  FERRY_CHECK(args.layout == CombineLayout::rank_major || b.expert_slots > 0,
              "expert-major combine needs expert slots; the LL config resolves them at construction");
  LlCombineParams p{};
  static_cast<cuda_ll::LlParams&>(p) = ll_params(b, refuse, TraceKernel::ll_combine);
  p.x = args.x;
  p.y = args.y;
  FERRY_CHECK(args.group_weights == nullptr || b.config.topk == 1, "a grouped combine on a buffer of topk ",
              b.config.topk, " (EpBuffer allows topk 1 only: one row per token)");
  p.group = args.group;
  p.group_weights = args.group_weights;
  p.refuse_after_drop = b.refuse_combine_after_drop;
  return p;
}

}  // namespace

void launch_ll_combine(Buffers const& buffers, CombineArgs const& args, int num_tokens, Half half, cudaStream_t stream,
                       bool refuse, detail::LegRecord* record) {
  // num_tokens is only checked here; the kernel reads the device copy of the last dispatch's count
  LlCombineParams p = to_params(buffers, args, num_tokens, refuse);
  p.halves = halves_of(half);
  int const variant = LlCombineFamily<cuda_ll::OneNode>::variant(args.layout, args.group_weights != nullptr);
  if (buffers.config.rank_masking) {
    // NOTE: as launch_ll_dispatch: the agreement first (the send half's); across nodes the direct route
    FERRY_CHECK(buffers.layout.nodes == 1 || buffers.layout.ll.fwd_rows == 0,
                "rank masking across nodes runs the direct route");
    if (half != Half::recv && !buffers.test_agreement_apart)
      launch_ll_agreement(buffers, detail::LlMaskLeg::combine, stream);
    if (buffers.layout.nodes > 1)
      launch_ll_masked_combine_net(buffers, p, variant, stream, record);
    else
      launch_ll_masked_combine(buffers, p, variant, stream, record);
    return;
  }
  if (buffers.layout.nodes > 1) {
    launch_ll_combine_net(buffers, p, variant, stream, record);
    return;
  }
  launch_ll<LlCombineFamily<cuda_ll::OneNode>>(buffers, p, cuda_ll::OneNode{}, buffers.config.combine_format, variant,
                                               0, stream, record);
}

}  // namespace ferry::cuda_ep
