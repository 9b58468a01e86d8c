// The low-latency dispatch's instances over a network (low-latency mode across nodes: Emulated between ranks that
// share memory, Gin on a cluster), apart from the one-node ones so that both build side by side.
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/instances.cuh"

namespace ferry::cuda_ep {

void launch_ll_dispatch_net(Buffers const& buffers, cuda_ll::LlDispatchParams const& p, int variant, std::size_t smem,
                            cudaStream_t stream, detail::LegRecord* record) {
  // the dispatch's endpoints are the first num_ctas * kWarps, the combine's the next (ll_combine_send_network)
  with_network(buffers, 2 * p.num_ctas, "low-latency dispatch", [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    launch_ll<LlDispatchFamily<Net>>(buffers, p, network, buffers.config.dispatch_format, variant, smem, stream,
                                     record);
  });
}

}  // namespace ferry::cuda_ep
