// The low-latency combine's instances with rank masking over a network (kMasking across nodes, the direct route:
// Emulated between ranks that share memory, Gin on a cluster), apart from the others so that the builds run side by
// side and the instances without masking stay what they were.
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/instances.cuh"

namespace ferry::cuda_ep {

void launch_ll_masked_combine_net(Buffers const& buffers, cuda_ll::LlCombineParams const& p, int variant,
                                  cudaStream_t stream, detail::LegRecord* record) {
  with_network(buffers, 2 * p.num_ctas, "low-latency combine", [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    launch_ll<LlCombineFamily<Net, true>>(buffers, p, network, buffers.config.combine_format, variant, 0, stream,
                                          record);
  });
}

}  // namespace ferry::cuda_ep
