// Host launcher of the hierarchical normal-mode combine (hier_combine.cuh): its two kernels per (codec, layout)
// instance, over the network transport of the buffers (Emulated today).
#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/hier_combine.cuh"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"

namespace ferry::cuda_ep {

namespace {

using Net = transport::Emulated;
using Params = HierCombineParams<Net>;
using LaunchFn = void (*)(Params const&, bool, cudaStream_t);

template <bool kExpertMajor, WireFormat kFormat, int kUnitElems>
void launch_kernels(Params const& p, bool cooperative, cudaStream_t stream) {
  cuda_grid::launch_grid<kThreads>(hier_combine_push_kernel<kExpertMajor, kFormat, kUnitElems, Net>, p, p.num_ctas, 0,
                                   cooperative, stream);
  cuda_grid::launch_grid<kThreads>(hier_combine_sum_kernel<kFormat, kUnitElems, Net>, p, p.num_ctas, 0, cooperative,
                                   stream);
}

// The family's instances (instances.cuh): codec x layout.
struct HierCombineFamily : InstanceFamily<LaunchFn, 2, true> {
  static constexpr char const* kName = "hierarchical combine";
  static constexpr char const* kFormatField = "combine_format";
  static constexpr int variant(CombineLayout layout) { return layout == CombineLayout::expert_major ? 1 : 0; }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    return launch_kernels<kVariant == 1, codec.format, codec.unit>;
  }
};

}  // namespace

void launch_hier_combine(Buffers const& b, CombineParams const& base, CombineLayout layout, cudaStream_t stream,
                         detail::LegRecord* record) {
  FERRY_CHECK(b.network.areas != nullptr && base.num_ctas * kWarps <= b.network.num_areas, "hierarchical combine of ",
              base.num_ctas, " CTAs needs ", base.num_ctas * kWarps, " network endpoints, the buffers have ",
              b.network.num_areas);
  Params p{};
  static_cast<CombineParams&>(p) = base;
  p.network = b.network;
  p.nodes = b.topology.nodes;
  p.local = b.topology.local;
  p.hier_mask = b.hier_mask;
  p.recv_capacity = b.recv_capacity;
  p.rail_partials = b.rail_partials;
  LaunchFn const launch = find_instance<HierCombineFamily>(b.config.combine_format, b.config.hidden,
                                                           HierCombineFamily::variant(layout), record);
  launch(p, b.cooperative, stream);
}

}  // namespace ferry::cuda_ep
