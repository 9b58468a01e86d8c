// Host side of rank masking in low-latency mode (ll_mask.cuh): the agreement's launch, the mask words, clear_mask's
// steps.
#include <type_traits>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll_mask.cuh"

namespace ferry::cuda_ep {

void launch_ll_agreement(Buffers const& b, detail::LlMaskLeg leg, cudaStream_t stream) {
  FERRY_CHECK(b.mask_host_device != nullptr, "the agreement of rank masking on buffers allocated without it");
  cuda_ll::LlAgreementParams p{};
  p.view = b.view;
  p.net = transport::make_lsa(b.sym, b.rank, b.world);
  LlMaskArea const area = ll_mask_area(b.layout, b.world);
  p.arrive = area.arrive;
  p.verdict = area.verdict;
  p.arrive_signals = area.arrive_signals;
  p.verdict_signals = area.verdict_signals;
  p.local = b.layout.nodes > 1 ? b.layout.local : b.world;
  p.state = b.state;
  p.host = b.mask_host_device;
  p.leg = leg;
  p.send_seq = leg == detail::LlMaskLeg::dispatch ? b.state->dispatch_send_seq : b.state->combine_send_seq;
  auto const launch = [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    cuda_ll::NetParams<cuda_ll::LlAgreementParams, Net> params{};
    static_cast<cuda_ll::LlAgreementParams&>(params) = p;
    if constexpr (cuda_ll::kAcrossNodes<Net>) params.network = network;
    cuda_ll::ll_agreement_kernel<Net><<<1, cuda_ll::kAgreementThreads, 0, stream>>>(params);
  };
  if (b.layout.nodes <= 1) {
    launch(cuda_ll::OneNode{});
  } else if (b.network_kind == transport::Kind::gin) {
    launch(b.mask_gin);  // the agreement's own signal range (LlMaskArea::signals)
  } else {
    // lane s opens endpoint s < 32, as many as 2 CTAs of warps (the legs' endpoints, idle between kernels on the
    // stream; each lane closes its own)
    with_network(b, 2, "rank masking's agreement", launch);
  }
  FERRY_CHECK_CUDA(cudaGetLastError());
}

detail::LlMaskWords read_ll_mask(Buffers const& b, cudaStream_t stream) {
  detail::LlMaskWords words{};
  FERRY_CHECK_CUDA(cudaMemcpyAsync(&words, &b.state->ll_mask, sizeof(words), cudaMemcpyDeviceToHost, stream));
  FERRY_CHECK_CUDA(cudaStreamSynchronize(stream));
  return words;
}

void request_ll_mask(Buffers const& b, uint32_t ranks) {
  FERRY_CHECK(b.mask_host != nullptr, "mask_ranks on buffers allocated without rank masking");
  auto* const request = reinterpret_cast<uint32_t volatile*>(&b.mask_host->request);
  *request = *request | ranks;
}

detail::LlCallCounters ll_call_counters(Buffers const& b, cudaStream_t stream) {
  uint64_t seq[4] = {0, 0, 0, 0};
  DeviceState* const s = b.state;
  for (auto [i, word] : {std::pair{0, s->dispatch_send_seq}, std::pair{1, s->dispatch_recv_seq},
                         std::pair{2, s->combine_send_seq}, std::pair{3, s->combine_recv_seq}})
    FERRY_CHECK_CUDA(cudaMemcpyAsync(&seq[i], word, sizeof(uint64_t), cudaMemcpyDeviceToHost, stream));
  detail::LlMaskWords const words = read_ll_mask(b, stream);
  return detail::LlCallCounters{std::max(seq[0], seq[1]), std::max(seq[2], seq[3]), words.epoch};
}

void reset_ll_mask(Buffers const& b, detail::LlCallCounters const& to, cudaStream_t stream) {
  cuda_ll::LlMaskResetParams p{};
  p.state = b.state;
  char* const region = b.sym.ptr[b.rank];
  p.dispatch_arrivals = reinterpret_cast<uint64_t*>(region + b.layout.dispatch_arrivals);
  p.combine_arrivals = reinterpret_cast<uint64_t*>(region + b.layout.combine_arrivals);
  p.agreement_signals = reinterpret_cast<uint64_t*>(region + ll_mask_area(b.layout, b.world).signals);
  p.host = b.mask_host_device;
  p.world = b.world;
  p.num_ctas = b.num_ctas;
  p.to = to;
  cuda_ll::ll_mask_reset_kernel<<<1, kMaxLlCtas, 0, stream>>>(p);
  FERRY_CHECK_CUDA(cudaGetLastError());
}

}  // namespace ferry::cuda_ep
