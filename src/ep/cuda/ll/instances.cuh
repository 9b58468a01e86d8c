// The template instances of the low-latency legs (instances.cuh's scheme), for each network to the ranks of other
// nodes: OneNode (ll/dispatch.cu, ll/combine.cu) and Emulated / Gin (ll/dispatch_net.cu, ll/combine_net.cu), and with
// rank masking (kMasking: one node in ll/masked.cu, over a network in ll/masked_dispatch_net.cu and
// ll/masked_combine_net.cu), each compiled apart so that the builds run side by side. Included by those launchers
// only.
#pragma once

#include <cstdint>
#include <type_traits>

#include "ep/cuda/buffers.hpp"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"
#include "ep/cuda/ll/combine.cuh"
#include "ep/cuda/ll/dispatch.cuh"

namespace ferry::cuda_ep {

// The dispatch family: codec x halves x index type. The receive half reads no ids and runs no codec, so every index
// type and unit of a format shares its one instance.
template <class Net, bool kMasking = false>
struct LlDispatchFamily : InstanceFamily<void (*)(cuda_ll::NetParams<cuda_ll::LlDispatchParams, Net>), 6, true> {
  using Kernel = void (*)(cuda_ll::NetParams<cuda_ll::LlDispatchParams, Net>);
  static constexpr char const* kName = "low-latency dispatch";
  static constexpr char const* kFormatField = "dispatch_format";
  static constexpr int variant(Half half, IndexType ids) {
    return static_cast<int>(half) * 2 + (ids == IndexType::int64 ? 1 : 0);
  }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    constexpr Half half = static_cast<Half>(kVariant / 2);
    using IdxT = std::conditional_t<kVariant % 2 == 1, int64_t, int32_t>;
    constexpr int kRecvUnit = device::unit_elems_for(codec.format, 0);
    if constexpr (half == Half::recv)
      return cuda_ll::ll_dispatch_kernel<int64_t, codec.format, kRecvUnit, false, true, Net, kMasking>;
    return cuda_ll::ll_dispatch_kernel<IdxT, codec.format, codec.unit, true, half == Half::both, Net, kMasking>;
  }
};

// The combine family: codec x halves x layout, and the grouped sum (CombineArgs::group_weights) as instances of its
// own: the receive half's loop with weights is compiled apart, so that the plain sum keeps its code and registers.
// The kernels take no codec unit (a work item is a chunk of whole scale blocks), and the receive half reads no expert
// outputs: one instance per format for it. The send half reads no group: a grouped send-only call runs the plain one.
template <class Net, bool kMasking = false>
struct LlCombineFamily : InstanceFamily<void (*)(cuda_ll::NetParams<cuda_ll::LlCombineParams, Net>), 9, false> {
  using Kernel = void (*)(cuda_ll::NetParams<cuda_ll::LlCombineParams, Net>);
  static constexpr char const* kName = "low-latency combine";
  static constexpr char const* kFormatField = "combine_format";
  // 0..5: half x layout; 6, 7: both halves, grouped, by layout; 8: the receive half, grouped
  static constexpr int variant(Half half, CombineLayout layout, bool grouped) {
    int const major = layout == CombineLayout::expert_major ? 1 : 0;
    if (grouped && half == Half::both) return 6 + major;
    if (grouped && half == Half::recv) return 8;
    return static_cast<int>(half) * 2 + major;
  }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr WireFormat format = kCodecs[kCodec].format;
    if constexpr (kVariant >= 6) {
      constexpr bool kBoth = kVariant != 8;
      constexpr bool kExpertMajor = kVariant != 6;  // the receive half alone reads no layout: expert-major, as above
      return cuda_ll::ll_combine_kernel<kExpertMajor, format, kBoth, true, Net, kMasking, true>;
    } else {
      constexpr Half half = static_cast<Half>(kVariant / 2);
      if constexpr (half == Half::recv) return cuda_ll::ll_combine_kernel<true, format, false, true, Net, kMasking>;
      return cuda_ll::ll_combine_kernel<kVariant % 2 == 1, format, true, half == Half::both, Net, kMasking>;
    }
  }
};

// The instance of a leg for its Params (`base`, OneNode's) over `network`, launched on the buffers' grid.
template <class Family, class Base, class Net>
void launch_ll(Buffers const& b, Base const& base, Net const& network, WireFormat format, int variant, std::size_t smem,
               cudaStream_t stream, detail::LegRecord* record) {
  auto const kernel = find_instance<Family>(format, b.config.hidden, variant, record);
  cuda_ll::NetParams<Base, Net> p{};
  static_cast<Base&>(p) = base;
  if constexpr (cuda_ll::kAcrossNodes<Net>) p.network = network;
  cuda_grid::launch_grid<kThreads>(kernel, p, base.num_ctas, smem, b.cooperative, stream);
}

}  // namespace ferry::cuda_ep
