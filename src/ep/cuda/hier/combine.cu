// Host launcher of the hierarchical normal-mode combine (hier/combine.cuh): its two kernels per (codec, layout)
// instance, over the network transport of the buffers (Emulated or Gin: with_network).
#include <type_traits>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/hier/combine.cuh"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"

namespace ferry::cuda_ep {

namespace {

template <class Net>
using HierCombineLaunch = void (*)(HierCombineParams<Net> const&, bool, cudaStream_t);

template <bool kExpertMajor, WireFormat kFormat, int kUnitElems, class Net>
void launch_kernels(HierCombineParams<Net> const& p, bool cooperative, cudaStream_t stream) {
  cuda_grid::launch_grid<kThreads>(hier_combine_push_kernel<kExpertMajor, kFormat, kUnitElems, Net>, p, p.num_ctas, 0,
                                   cooperative, stream);
  cuda_grid::launch_grid<kThreads>(hier_combine_sum_kernel<kFormat, kUnitElems, Net>, p, p.num_ctas, 0, cooperative,
                                   stream);
}

// The family's instances (instances.cuh): codec x layout, over one network transport.
template <class Net>
struct HierCombineFamily : InstanceFamily<HierCombineLaunch<Net>, 2, true> {
  using Kernel = HierCombineLaunch<Net>;
  static constexpr char const* kName = "hierarchical combine";
  static constexpr char const* kFormatField = "combine_format";
  static constexpr int variant(CombineLayout layout) { return layout == CombineLayout::expert_major ? 1 : 0; }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    return launch_kernels<kVariant == 1, codec.format, codec.unit, Net>;
  }
};

}  // namespace

void launch_hier_combine(Buffers const& b, CombineParams const& base, CombineLayout layout, cudaStream_t stream,
                         detail::LegRecord* record) {
  with_network(b, base.num_ctas, "hierarchical combine", [&](auto const& network) {
    using Net = std::decay_t<decltype(network)>;
    auto p = hier_params<HierCombineParams>(b, base, network);
    p.recv_capacity = b.recv_capacity;
    p.rail_partials = b.rail_partials;
    using Family = HierCombineFamily<Net>;
    auto const launch =
        find_instance<Family>(b.config.combine_format, b.config.hidden, Family::variant(layout), record);
    launch(p, b.cooperative, stream);
  });
}

}  // namespace ferry::cuda_ep
