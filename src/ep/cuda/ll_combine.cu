// Host launcher of the low-latency combine kernel (ll_combine.cuh): validation, template instance, launch.
#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"
#include "ep/cuda/ll_combine.cuh"

namespace ferry::cuda_ep {

namespace {

using cuda_ll::LlCombineParams;

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants in buffers.cu says why).
LlCombineParams to_params(Buffers const& b, CombineArgs const& args, int num_tokens, bool refuse) {
  FERRY_CHECK(refuse || num_tokens == 0 || args.y != nullptr, "combine y is null for num_tokens=", num_tokens,
              " of the last dispatch");
  FERRY_CHECK(args.layout == CombineLayout::rank_major || b.expert_slots > 0,
              "expert-major combine needs expert slots; the LL config resolves them at construction");
  LlCombineParams p{};
  static_cast<cuda_ll::LlParams&>(p) = ll_params(b, refuse, TraceKernel::ll_combine);
  p.x = args.x;
  p.y = args.y;
  return p;
}

using CombineKernel = void (*)(LlCombineParams);

// The family's instances (instances.cuh): codec x halves x layout. The kernels take no codec unit (a work item is a
// chunk of whole scale blocks), and the receive half reads no expert outputs: one instance per format for it.
struct LlCombineFamily : InstanceFamily<CombineKernel, 6, false> {
  static constexpr char const* kName = "low-latency combine";
  static constexpr char const* kFormatField = "combine_format";
  static constexpr int variant(Half half, CombineLayout layout) {
    return static_cast<int>(half) * 2 + (layout == CombineLayout::expert_major ? 1 : 0);
  }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr WireFormat format = kCodecs[kCodec].format;
    constexpr Half half = static_cast<Half>(kVariant / 2);
    if constexpr (half == Half::recv) return cuda_ll::ll_combine_kernel<true, format, false, true>;
    return cuda_ll::ll_combine_kernel<kVariant % 2 == 1, format, true, half == Half::both>;
  }
};

}  // namespace

void launch_ll_combine(Buffers const& buffers, CombineArgs const& args, int num_tokens, Half half, cudaStream_t stream,
                       bool refuse, detail::LegRecord* record) {
  // num_tokens is only checked here; the kernel reads the device copy of the last dispatch's count
  LlCombineParams const p = to_params(buffers, args, num_tokens, refuse);
  CombineKernel const kernel = find_instance<LlCombineFamily>(buffers.config.combine_format, buffers.config.hidden,
                                                              LlCombineFamily::variant(half, args.layout), record);
  cuda_grid::launch_grid<kThreads>(kernel, p, p.num_ctas, 0, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ep
