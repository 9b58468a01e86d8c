// Host launcher of the hierarchical normal-mode dispatch (hier_dispatch.cuh): its two kernels, over the network
// transport of the buffers (Emulated or Gin: with_network; the kernels are templates on it).
#include <cstdint>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/hier_dispatch.cuh"
#include "ep/cuda/launch_grid.cuh"

namespace ferry::cuda_ep {

namespace {

template <typename IdxT, class Net>
void launch_kernels(HierDispatchParams<Net> const& p, std::size_t layout_smem, bool cooperative, cudaStream_t stream) {
  static bool const configured = [] {
    FERRY_CHECK_CUDA(cudaFuncSetAttribute(hier_layout_kernel<IdxT, Net>, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                          static_cast<int>(kMaxDispatchSmem)));
    return true;
  }();
  (void)configured;
  // 1. the layout and the count rows: one CTA, in token order
  HierDispatchParams<Net> layout = p;
  layout.num_ctas = 1;
  cuda_grid::launch_grid<kThreads>(hier_layout_kernel<IdxT, Net>, layout, 1, layout_smem, cooperative, stream);
  // 2. the exchange, the push and the rail's forward: the grid
  cuda_grid::launch_grid<kThreads>(hier_dispatch_kernel<IdxT, Net>, p, p.num_ctas, 0, cooperative, stream);
}

}  // namespace

void launch_hier_dispatch(Buffers const& b, DispatchParams const& base, IndexType ids, cudaStream_t stream) {
  // NOTE: the forward carries bf16 wire rows in this version (a quantized dispatch_format is refused at construction).
  FERRY_CHECK(b.config.dispatch_format == WireFormat::bf16, "the hierarchical dispatch carries bf16 rows, not ",
              wire_format_name(b.config.dispatch_format));
  FERRY_CHECK(b.topology.world() == b.world && b.world + b.topology.nodes <= kMaxHierColumns,
              "hierarchical dispatch: topology ", topology_name(b.topology), " for world ", b.world);
  std::size_t const layout_smem =
      static_cast<std::size_t>(b.world + b.topology.nodes + b.config.num_experts) * sizeof(int32_t);
  FERRY_CHECK(layout_smem <= kMaxDispatchSmem, "hierarchical layout needs ", layout_smem, " bytes of shared memory");
  with_network(b, base.num_ctas, "hierarchical dispatch", [&](auto const& network) {
    auto p = hier_params<HierDispatchParams>(b, base, network);
    p.node_pos = b.node_pos;
    p.skip_rail_wait = b.test_skip_rail_wait;
    if (ids == IndexType::int64)
      launch_kernels<int64_t>(p, layout_smem, b.cooperative, stream);
    else
      launch_kernels<int32_t>(p, layout_smem, b.cooperative, stream);
  });
}

}  // namespace ferry::cuda_ep
