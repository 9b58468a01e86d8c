// The low-latency dispatch's instances with rank masking over a network (kMasking across nodes, the direct route:
// Emulated between ranks that share memory, Gin on a cluster), apart from the others so that the builds run side by
// side and the instances without masking stay what they were.
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/instances.cuh"

namespace ferry::cuda_ep {

void launch_ll_masked_dispatch_net(Buffers const& buffers, cuda_ll::LlDispatchParams const& p, int variant,
                                   std::size_t smem, cudaStream_t stream, detail::LegRecord* record) {
  // the endpoints as launch_ll_dispatch_net's
  with_network(buffers, 2 * p.num_ctas, "low-latency dispatch", [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    launch_ll<LlDispatchFamily<Net, true>>(buffers, p, network, buffers.config.dispatch_format, variant, smem, stream,
                                           record);
  });
}

}  // namespace ferry::cuda_ep
