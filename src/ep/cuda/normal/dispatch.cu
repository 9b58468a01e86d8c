// Host launcher of the normal-mode dispatch kernel (normal/dispatch.cuh): geometry, validation, template instance,
// launch.
#include <algorithm>
#include <cstdint>
#include <type_traits>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"
#include "ep/cuda/normal/dispatch.cuh"
#include "ep/cuda/normal/land_dispatch.cuh"
#include "ep/landing_policy.hpp"
#include "tuning/choose.hpp"

namespace ferry::cuda_ep {

LaunchPlan plan_dispatch(Buffers const& buffers, int num_tokens) {
  if (buffers.protocol == Protocol::landing) {
    // NOTE: every CTA of the landing dispatch keeps its own sequence word, so its grid is fixed per EpBuffer.
    LaunchPlan plan;
    plan.ctas = buffers.land_ctas;
    plan.why = "one CTA per SM, fixed per EpBuffer (per-CTA sequence words; tuning pins do not apply)";
    return plan;
  }
  // NOTE: the analytic default: small batches are latency-bound, so they are spread over the whole grid (one token
  // per CTA at most, its row split over the CTA's warps) and every SM has bytes in flight; large ones take a warp per
  // token on every SM. At least 8 CTAs so the push can fill NVLink, at most one per SM (persistent grid).
  // EpConfig::dispatch_geometry, FERRY_DISPATCH_BLOCKS and the tuning table come first (choose.hpp).
  Geometry const analytic{std::clamp(num_tokens, 8, buffers.num_sms)};
  tuning::Choice const choice =
      tuning::choose(buffers.dispatch_tuning, tuning::read_env_pin(tuning::Leg::dispatch), num_tokens, analytic,
                     "every SM up to one CTA per token, rows split over warps, min 8 CTAs to fill NVLink");
  LaunchPlan plan;
  plan.ctas = std::min(choice.geometry.blocks, buffers.max_dispatch_ctas);
  plan.why = choice.source;
  if (plan.ctas != choice.geometry.blocks) {
    plan.why += detail::concat("; ", choice.geometry.blocks, " CTAs clamped to ", plan.ctas,
                               " (at most one per SM: the grid is persistent)");
    plan.fallbacks |= detail::kFallbackGridClamped;
  }
  return plan;
}

namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants says why).
DispatchParams to_params(Buffers const& b, DispatchArgs const& args, LaunchPlan const& plan, bool refuse) {
  check_dispatch_invariants(b, args, refuse);
  FERRY_CHECK(plan.ctas >= 1 && plan.ctas <= b.max_dispatch_ctas, "dispatch grid of ", plan.ctas,
              " CTAs is outside [1, ", b.max_dispatch_ctas, "]");
  WireFormat const format = b.config.dispatch_format;
  bool const prequantized = args.num_tokens > 0 && args.x_scales != nullptr;
  if (prequantized) {
    // NOTE: pre-quantized rows are forwarded piece by piece: fp32 scales are read as words, the token scales as floats.
    FERRY_CHECK(format != WireFormat::bf16, "x_scales is set but dispatch_format is bf16; pass bf16 rows ",
                "without scales, or create the EpBuffer with a quantized dispatch_format");
    FERRY_CHECK(format != WireFormat::fp8_e4m3 || reinterpret_cast<uintptr_t>(args.x_scales) % 4 == 0,
                "x_scales=", args.x_scales, " is not 4-byte aligned (fp32 scales of fp8_e4m3)");
    FERRY_CHECK(format != WireFormat::nvfp4 || args.x_token_scales != nullptr,
                "pre-quantized nvfp4 input needs x_token_scales (the per-token fp32 scales)");
    FERRY_CHECK(args.x_token_scales == nullptr || reinterpret_cast<uintptr_t>(args.x_token_scales) % 4 == 0,
                "x_token_scales=", args.x_token_scales, " is not 4-byte aligned");
  }
  DispatchParams p{};
  static_cast<KernelParams&>(p) = common_params(b, plan.ctas, refuse, TraceKernel::dispatch);
  set_dispatch_inputs(p, args);
  p.num_experts = b.config.num_experts;
  p.num_local_experts = b.num_local_experts;
  p.recv_capacity = b.recv_capacity;
  p.token_mask = b.token_mask;
  p.token_pos = b.token_pos;
  p.block_counts = b.block_counts;
  p.count_totals = b.count_totals;
  p.expert_counts = b.expert_counts;
  p.recv_pass = RecvPass::none;
  p.scale_layout = b.config.recv_scale_layout;
  if (format != WireFormat::bf16) {
    p.x_scales = prequantized ? args.x_scales : nullptr;
    p.x_token_scales = prequantized ? args.x_token_scales : nullptr;
    p.token_scales = b.token_scales;
    WireRowLayout const wire = wire_row_layout(format, b.config.hidden);
    if (b.config.dispatch_dequantize) {
      // whole wire rows land in recv_wire; the receiver dequantizes them into recv_x
      p.qdst = QuantDst{b.layout.normal.recv_wire,
                        wire.row_bytes,
                        b.layout.normal.recv_wire + wire.scales_offset,
                        wire.row_bytes,
                        b.layout.normal.recv_wire + wire.token_scale_offset,
                        wire.row_bytes};
      p.recv_pass = RecvPass::dequantize;
    } else {
      // the payload, the scales (row-major) and the token scale straight into the delivered buffers
      p.qdst = QuantDst{b.layout.normal.recv_x,
                        wire.payload_bytes,
                        b.layout.normal.recv_scales,
                        static_cast<std::size_t>(wire.num_scales) * wire.scale_bytes,
                        b.layout.normal.recv_token_scales,
                        sizeof(float)};
      if (b.config.recv_scale_layout != ScaleLayout::row_major) {
        p.recv_pass = RecvPass::relayout;
        p.recv_scales_final = b.recv_scales_final;
      }
    }
  }
  return p;
}

using DispatchKernel = void (*)(DispatchParams);

// Sets the kernel's shared-memory limit once, then launches it.
template <DispatchKernel kKernel>
void launch_kernel(DispatchParams const& p, std::size_t smem, bool cooperative, cudaStream_t stream) {
  static bool const configured = [] {
    FERRY_CHECK_CUDA(
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(kMaxDispatchSmem)));
    return true;
  }();
  (void)configured;
  cuda_grid::launch_grid<kThreads>(kKernel, p, p.num_ctas, smem, cooperative, stream);
}

using NormalDispatchLaunch = void (*)(DispatchParams const&, std::size_t, bool, cudaStream_t);

// The family's instances (instances.cuh): codec x (protocol: count exchange or landing zone) x index type.
struct DispatchFamily : InstanceFamily<NormalDispatchLaunch, 4, true> {
  static constexpr char const* kName = "normal dispatch";
  static constexpr char const* kFormatField = "dispatch_format";
  static constexpr int variant(Protocol protocol, IndexType ids) {
    return (protocol == Protocol::landing ? 2 : 0) + (ids == IndexType::int64 ? 1 : 0);
  }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    using IdxT = std::conditional_t<kVariant % 2 == 1, int64_t, int32_t>;
    if constexpr (kVariant / 2 == 0)
      return launch_kernel<dispatch_kernel<IdxT, codec.format, codec.unit>>;
    else
      return launch_kernel<land_dispatch_kernel<IdxT, codec.format, codec.unit>>;
  }
};

}  // namespace

void launch_dispatch(Buffers const& buffers, DispatchArgs const& args, LaunchPlan const& plan, cudaStream_t stream,
                     bool refuse, detail::LegRecord* record) {
  DispatchParams const p = to_params(buffers, args, plan, refuse);
  if (buffers.protocol == Protocol::hierarchical) {
    launch_hier_dispatch(buffers, p, args.topk_idx_type, stream, record);
    return;
  }
  bool const landing = buffers.protocol == Protocol::landing;
  FERRY_CHECK(!landing || plan.ctas == buffers.land_ctas, "landing dispatch grid of ", plan.ctas,
              " CTAs differs from the ", buffers.land_ctas, " its sequence words were counted with");
  FERRY_CHECK(args.topk_idx_type == IndexType::int32 || args.topk_idx_type == IndexType::int64,
              "topk_idx_type=", static_cast<int>(args.topk_idx_type), " is not int32 or int64");
  NormalDispatchLaunch const launch =
      find_instance<DispatchFamily>(buffers.config.dispatch_format, buffers.config.hidden,
                                    DispatchFamily::variant(buffers.protocol, args.topk_idx_type), record);
  // the landing receiver's shared memory was checked at construction (choose_normal_landing)
  static_assert(detail::kLandingMaxSmem <= kMaxDispatchSmem, "the landing receiver's budget fits the dispatch limit");
  std::size_t const smem = landing ? detail::landing_smem_bytes(buffers.config, buffers.world)
                                   : dispatch_smem_bytes(buffers.world, buffers.config.num_experts);
  launch(p, smem, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ep
