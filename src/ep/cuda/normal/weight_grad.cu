// Host launcher of combine_backward's weight step (normal/weight_grad.cuh): the send kernel on the grid, then the collect
// kernel on a few CTAs, on one stream (graph-capturable: no host sync, no allocation).
#include <algorithm>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/normal/weight_grad.cuh"
#include "ferry/error.hpp"

namespace ferry::cuda_ep {

void launch_weight_grad(Buffers const& b, void const* x, float* grad_w, int num_tokens, bool refuse,
                        cudaStream_t stream) {
  // Kernel invariants only (FERRY_CHECK: EpBuffer validated the call; check_dispatch_invariants says why).
  FERRY_CHECK(b.protocol != Protocol::ll, "the weight step of a low-latency buffer");
  FERRY_CHECK(b.expert_slots > 0 && b.expert_x != nullptr, "the weight step needs the expert-major layout");
  FERRY_CHECK(num_tokens >= 0 && num_tokens <= b.config.max_tokens_per_rank, "num_tokens=", num_tokens,
              " is outside [0, max_tokens_per_rank=", b.config.max_tokens_per_rank, "]");
  FERRY_CHECK(!refuse || (x == nullptr && grad_w == nullptr), "a refused weight step reads and writes nothing");
  FERRY_CHECK(b.config.hidden % 8 == 0, "hidden=", b.config.hidden, " is not a multiple of 8 (16-byte vectors)");
  // NOTE: the send grid never waits, so any size is safe; one CTA per SM gives every SM rows. The collect grid waits:
  // a few CTAs, so ranks sharing a GPU (the virtual-rank tests) keep SMs for the sends they wait for.
  int const send_ctas = std::max(1, b.num_sms);
  int const collect_ctas = std::clamp(b.num_sms, 1, kWeightGradWaitCtas);
  WeightGradParams p{};
  static_cast<KernelParams&>(p) = common_params(b, send_ctas, refuse, std::nullopt);
  p.x = x;
  p.expert_x = b.expert_x;
  p.recv_slot = b.recv_slot;
  p.num_local_experts = b.num_local_experts;
  p.expert_slots = b.expert_slots;
  p.grad_w = grad_w;
  p.num_tokens = num_tokens;
  weight_grad_send_kernel<<<static_cast<unsigned>(send_ctas), kThreads, 0, stream>>>(p);
  FERRY_CHECK_CUDA(cudaGetLastError());
  p.num_ctas = collect_ctas;
  weight_grad_collect_kernel<<<static_cast<unsigned>(collect_ctas), kThreads, 0, stream>>>(p);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ferry::cuda_ep
