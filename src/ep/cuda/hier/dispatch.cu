// Host launcher of the hierarchical normal-mode dispatch (hier/dispatch.cuh): its two kernels, over the network
// transport of the buffers (Emulated or Gin: with_network; the kernels are templates on it).
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/hier/dispatch.cuh"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"

namespace ferry::cuda_ep {

namespace {

template <class Net>
using HierDispatchLaunch = void (*)(HierDispatchParams<Net> const&, std::size_t, bool, cudaStream_t);

template <typename IdxT, WireFormat kFormat, int kUnitElems, class Net>
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
  cuda_grid::launch_grid<kThreads>(hier_dispatch_kernel<IdxT, kFormat, kUnitElems, Net>, p, p.num_ctas, 0, cooperative,
                                   stream);
}

// The family's instances (instances.cuh): codec x index type, over one network transport.
template <class Net>
struct HierDispatchFamily : InstanceFamily<HierDispatchLaunch<Net>, 2, true> {
  using Kernel = HierDispatchLaunch<Net>;
  static constexpr char const* kName = "hierarchical dispatch";
  static constexpr char const* kFormatField = "dispatch_format";
  static constexpr int variant(IndexType ids) { return ids == IndexType::int64 ? 1 : 0; }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    using IdxT = std::conditional_t<kVariant == 1, int64_t, int32_t>;
    return launch_kernels<IdxT, codec.format, codec.unit, Net>;
  }
};

}  // namespace

void launch_hier_dispatch(Buffers const& b, DispatchParams const& base, IndexType ids, cudaStream_t stream,
                          detail::LegRecord* record) {
  FERRY_CHECK(b.topology.world() == b.world && b.world + b.topology.nodes <= kMaxHierColumns,
              "hierarchical dispatch: topology ", topology_name(b.topology), " for world ", b.world);
  FERRY_CHECK(ids == IndexType::int32 || ids == IndexType::int64, "topk_idx_type=", static_cast<int>(ids),
              " is not int32 or int64");
  std::size_t const layout_smem =
      static_cast<std::size_t>(b.world + b.topology.nodes + b.config.num_experts) * sizeof(int32_t);
  FERRY_CHECK(layout_smem <= kMaxDispatchSmem, "hierarchical layout needs ", layout_smem, " bytes of shared memory");
  with_network(b, base.num_ctas, "hierarchical dispatch", [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    auto p = hier_params<HierDispatchParams>(b, base, network);
    p.node_pos = b.node_pos;
    p.skip_rail_wait = b.test_skip_rail_wait;
    using Family = HierDispatchFamily<Net>;
    auto const launch = find_instance<Family>(b.config.dispatch_format, b.config.hidden, Family::variant(ids), record);
    launch(p, layout_smem, b.cooperative, stream);
  });
}

}  // namespace ferry::cuda_ep
