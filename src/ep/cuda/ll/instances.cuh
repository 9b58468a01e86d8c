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

// The dispatch family: codec x index type. The halves a launch runs are a runtime field (LlParams::halves): a leg is
// one kernel symbol whether it runs as one launch or as the hook's two.
template <class Net, bool kMasking = false>
struct LlDispatchFamily : InstanceFamily<void (*)(cuda_ll::NetParams<cuda_ll::LlDispatchParams, Net>), 2, true> {
  using Kernel = void (*)(cuda_ll::NetParams<cuda_ll::LlDispatchParams, Net>);
  static constexpr char const* kName = "low-latency dispatch";
  static constexpr char const* kFormatField = "dispatch_format";
  static constexpr int variant(IndexType ids) { return ids == IndexType::int64 ? 1 : 0; }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    using IdxT = std::conditional_t<kVariant == 1, int64_t, int32_t>;
    return cuda_ll::leg::dispatch<IdxT, codec.format, codec.unit, Net, kMasking>;
  }
};

// The combine family: codec x layout x the grouped sum (CombineArgs::group_weights), whose receive loop with weights
// is compiled apart so that the plain sum keeps its code and registers. The kernels take no codec unit (a work item
// is a chunk of whole scale blocks). The halves are a runtime field, as the dispatch's.
template <class Net, bool kMasking = false>
struct LlCombineFamily : InstanceFamily<void (*)(cuda_ll::NetParams<cuda_ll::LlCombineParams, Net>), 4, false> {
  using Kernel = void (*)(cuda_ll::NetParams<cuda_ll::LlCombineParams, Net>);
  static constexpr char const* kName = "low-latency combine";
  static constexpr char const* kFormatField = "combine_format";
  static constexpr int variant(CombineLayout layout, bool grouped) {
    return (grouped ? 2 : 0) + (layout == CombineLayout::expert_major ? 1 : 0);
  }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr WireFormat format = kCodecs[kCodec].format;
    return cuda_ll::leg::combine<kVariant % 2 == 1, format, Net, kMasking, (kVariant >= 2)>;
  }
};

// The halves a launch runs (LlParams::halves).
constexpr uint32_t halves_of(Half half) {
  return half == Half::both   ? cuda_ll::kSendHalf | cuda_ll::kRecvHalf
         : half == Half::send ? cuda_ll::kSendHalf
                              : cuda_ll::kRecvHalf;
}

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
