// The low-latency legs' instances with rank masking (one node; ll/dispatch.cuh / ll/combine.cuh with kMasking), apart
// from the others so that both build side by side and the instances without masking stay what they were.
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/ll/instances.cuh"

namespace ferry::cuda_ep {

void launch_ll_masked_dispatch(Buffers const& buffers, cuda_ll::LlDispatchParams const& p, int variant,
                               std::size_t smem, cudaStream_t stream, detail::LegRecord* record) {
  launch_ll<LlDispatchFamily<cuda_ll::OneNode, true>>(buffers, p, cuda_ll::OneNode{}, buffers.config.dispatch_format,
                                                      variant, smem, stream, record);
}

void launch_ll_masked_combine(Buffers const& buffers, cuda_ll::LlCombineParams const& p, int variant,
                              cudaStream_t stream, detail::LegRecord* record) {
  launch_ll<LlCombineFamily<cuda_ll::OneNode, true>>(buffers, p, cuda_ll::OneNode{}, buffers.config.combine_format,
                                                     variant, 0, stream, record);
}

}  // namespace ferry::cuda_ep
