// Host launcher of the low-latency dispatch kernel (ll_dispatch.cuh): validation, template instance, launch.
#include <type_traits>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"
#include "ep/cuda/ll_dispatch.cuh"

namespace ferry::cuda_ep {

namespace {

using cuda_ll::LlDispatchParams;

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants in buffers.cu says why).
LlDispatchParams to_params(Buffers const& b, DispatchArgs const& args, bool refuse) {
  check_dispatch_invariants(b, args, refuse);
  FERRY_CHECK(b.num_local_experts >= 1 && b.num_local_experts <= kMaxLayoutLocalExperts,
              "num_local_experts=", b.num_local_experts, " is outside [1, ", kMaxLayoutLocalExperts, "]");
  WireFormat const format = b.config.dispatch_format;
  // Pre-quantized arguments were validated by EpBuffer (validate_dispatch_args); the kernel relies on these two.
  bool const prequantized = args.x_scales != nullptr;
  FERRY_CHECK(!prequantized || format != WireFormat::bf16, "x_scales is set but dispatch_format=bf16");
  FERRY_CHECK(!prequantized || format != WireFormat::nvfp4 || args.num_tokens == 0 || args.x_token_scales,
              "pre-quantized nvfp4 input needs x_token_scales");
  LlDispatchParams p{};
  static_cast<cuda_ll::LlParams&>(p) = ll_params(b, refuse, TraceKernel::ll_dispatch);
  set_dispatch_inputs(p, args);
  p.x_scales = args.x_scales;
  p.x_token_scales = args.x_token_scales;
  p.num_experts = b.config.num_experts;
  p.num_local_experts = b.num_local_experts;
  p.expert_counts = b.expert_counts;
  p.expert_x = b.expert_x;
  p.expert_src_row = b.expert_src_row;
  p.own_slot = b.own_slot;
  p.own_direct = b.own_direct;
  p.expert_row_bytes = b.recv_row_bytes;
  p.dequantize = format != WireFormat::bf16 && b.config.dispatch_dequantize;
  p.scale_layout = b.config.recv_scale_layout;
  p.scale_tensor_bytes = b.expert_scale_bytes;
  p.expert_scales = b.expert_scales;
  p.expert_token_scales = b.expert_token_scales;
  return p;
}

using DispatchKernel = void (*)(LlDispatchParams);

// The family's instances (instances.cuh): codec x halves x index type. The receive half reads no ids and runs no
// codec, so every index type and unit of a format shares its one instance.
struct LlDispatchFamily : InstanceFamily<DispatchKernel, 6, true> {
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
    if constexpr (half == Half::recv) return cuda_ll::ll_dispatch_kernel<int64_t, codec.format, kRecvUnit, false, true>;
    return cuda_ll::ll_dispatch_kernel<IdxT, codec.format, codec.unit, true, half == Half::both>;
  }
};

}  // namespace

void launch_ll_dispatch(Buffers const& buffers, DispatchArgs const& args, Half half, cudaStream_t stream, bool refuse,
                        detail::LegRecord* record) {
  LlDispatchParams const p = to_params(buffers, args, refuse);
  FERRY_CHECK(args.topk_idx_type == IndexType::int32 || args.topk_idx_type == IndexType::int64,
              "topk_idx_type=", static_cast<int>(args.topk_idx_type), " is not int32 or int64");
  DispatchKernel const kernel = find_instance<LlDispatchFamily>(
      buffers.config.dispatch_format, buffers.config.hidden, LlDispatchFamily::variant(half, args.topk_idx_type),
      half == Half::recv ? nullptr : record);  // the send half's codec is the leg's
  // both halves expand (the send half a bf16 dispatch's own rows): per-expert counters in shared memory
  std::size_t const smem = cuda_ll::expand_smem_bytes(p.num_local_experts);
  cuda_grid::launch_grid<kThreads>(kernel, p, p.num_ctas, smem, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ep
