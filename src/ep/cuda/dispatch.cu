// Host launcher of the normal-mode dispatch kernel (dispatch.cuh): geometry, validation, template instance, launch.
#include <algorithm>
#include <cstdint>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/dispatch.cuh"
#include "ep/cuda/land_dispatch.cuh"
#include "ep/cuda/launch_grid.cuh"
#include "ep/landing_policy.hpp"
#include "tuning/choose.hpp"

namespace ferry::cuda_ep {

LaunchPlan plan_dispatch(Buffers const& buffers, int num_tokens) {
  if (buffers.landing) {
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
  if (plan.ctas != choice.geometry.blocks)
    plan.why += detail::concat("; ", choice.geometry.blocks, " CTAs clamped to ", plan.ctas,
                               " (at most one per SM: the grid is persistent)");
  return plan;
}

namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug): the arguments were validated once by EpBuffer
// (validate_dispatch_args / validate_combine_args), which refuses a bad call on every rank. An InputError thrown here
// would be refused on this rank alone, the desync docs/errors.md rules out.
DispatchParams to_params(Buffers const& b, DispatchArgs const& args, LaunchPlan const& plan, bool refuse) {
  FERRY_CHECK(!refuse || args.num_tokens == 0, "a refused dispatch joins with no tokens, not ", args.num_tokens);
  FERRY_CHECK(args.num_tokens >= 0 && args.num_tokens <= b.config.max_tokens_per_rank, "num_tokens=", args.num_tokens,
              " is outside [0, max_tokens_per_rank=", b.config.max_tokens_per_rank, "]");
  FERRY_CHECK(args.num_tokens == 0 || (args.x && args.topk_idx && args.topk_weights),
              "x, topk_idx and topk_weights must be non-null for num_tokens=", args.num_tokens);
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
  p.view = b.view;
  for (int r = 0; r < b.world; ++r) p.sym[r] = b.sym.ptr[r];
  p.layout = b.layout;
  p.x = args.x;
  p.topk_idx = args.topk_idx;
  p.topk_weights = args.topk_weights;
  p.num_tokens = args.num_tokens;
  p.abort = refuse;
  p.hidden = b.config.hidden;
  p.topk = b.config.topk;
  p.num_experts = b.config.num_experts;
  p.num_local_experts = b.num_local_experts;
  p.recv_capacity = b.recv_capacity;
  p.max_tokens = b.config.max_tokens_per_rank;
  p.num_ctas = plan.ctas;
  p.state = b.state;
  p.token_mask = b.token_mask;
  p.token_pos = b.token_pos;
  p.block_counts = b.block_counts;
  p.count_totals = b.count_totals;
  p.expert_counts = b.expert_counts;
  p.trace = b.trace ? b.trace->launch(TraceKernel::dispatch, plan.ctas, kWarps) : trace::TraceView{};
  p.recv_pass = RecvPass::none;
  p.scale_layout = b.config.recv_scale_layout;
  if (format != WireFormat::bf16) {
    p.x_scales = prequantized ? args.x_scales : nullptr;
    p.x_token_scales = prequantized ? args.x_token_scales : nullptr;
    p.token_scales = b.token_scales;
    WireRowLayout const wire = wire_row_layout(format, b.config.hidden);
    if (b.config.dispatch_dequantize) {
      // whole wire rows land in recv_wire; the receiver dequantizes them into recv_x
      p.qdst = QuantDst{b.layout.recv_wire,
                        wire.row_bytes,
                        b.layout.recv_wire + wire.scales_offset,
                        wire.row_bytes,
                        b.layout.recv_wire + wire.token_scale_offset,
                        wire.row_bytes};
      p.recv_pass = RecvPass::dequantize;
    } else {
      // the payload, the scales (row-major) and the token scale straight into the delivered buffers
      p.qdst = QuantDst{b.layout.recv_x,
                        wire.payload_bytes,
                        b.layout.recv_scales,
                        static_cast<std::size_t>(wire.num_scales) * wire.scale_bytes,
                        b.layout.recv_token_scales,
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

// The instances: (wire format, unit elements) for each index type. bf16 copies rows (no unit).
struct Instance {
  WireFormat format;
  int unit;
  void (*launch)(DispatchParams const&, std::size_t, bool, cudaStream_t);
};

template <typename IdxT>
constexpr Instance kInstances[] = {
    {WireFormat::bf16, 0, launch_kernel<dispatch_kernel<IdxT, WireFormat::bf16, 0>>},
    {WireFormat::fp8_e4m3, 16, launch_kernel<dispatch_kernel<IdxT, WireFormat::fp8_e4m3, 16>>},
    {WireFormat::fp8_e4m3_ue8m0, 16, launch_kernel<dispatch_kernel<IdxT, WireFormat::fp8_e4m3_ue8m0, 16>>},
    {WireFormat::nvfp4, 32, launch_kernel<dispatch_kernel<IdxT, WireFormat::nvfp4, 32>>},
    {WireFormat::nvfp4, 16, launch_kernel<dispatch_kernel<IdxT, WireFormat::nvfp4, 16>>},
    {WireFormat::mxfp4, 32, launch_kernel<dispatch_kernel<IdxT, WireFormat::mxfp4, 32>>},
};

template <typename IdxT>
void launch_instance(WireFormat format, int hidden, DispatchParams const& p, std::size_t smem, bool cooperative,
                     cudaStream_t stream) {
  int const unit = format == WireFormat::bf16 ? 0 : device::unit_elems_for(format, hidden);
  for (Instance const& instance : kInstances<IdxT>) {
    if (instance.format == format && instance.unit == unit) {
      instance.launch(p, smem, cooperative, stream);
      return;
    }
  }
  FERRY_THROW(ConfigError, "config", "no dispatch kernel for dispatch_format=", wire_format_name(format), " with ",
              unit, "-element units (hidden=", hidden, ")");
}

// The kernel of one index type: the landing zone's (small batches, bf16; its receiver's shared memory checked at
// construction by choose_normal_landing), or the count exchange's instance for the wire format.
template <typename IdxT>
void launch_protocol(Buffers const& buffers, DispatchParams const& p, cudaStream_t stream) {
  if (buffers.landing) {
    static_assert(detail::kLandingMaxSmem <= kMaxDispatchSmem, "the landing receiver's budget fits the dispatch limit");
    launch_kernel<land_dispatch_kernel<IdxT>>(p, detail::landing_smem_bytes(buffers.config, buffers.world),
                                              buffers.cooperative, stream);
    return;
  }
  launch_instance<IdxT>(buffers.config.dispatch_format, buffers.config.hidden, p,
                        dispatch_smem_bytes(buffers.world, buffers.config.num_experts), buffers.cooperative, stream);
}

}  // namespace

void launch_dispatch(Buffers const& buffers, DispatchArgs const& args, LaunchPlan const& plan, cudaStream_t stream,
                     bool refuse) {
  DispatchParams const p = to_params(buffers, args, plan, refuse);
  FERRY_CHECK(!buffers.landing || plan.ctas == buffers.land_ctas, "landing dispatch grid of ", plan.ctas,
              " CTAs differs from the ", buffers.land_ctas, " its sequence words were counted with");
  switch (args.topk_idx_type) {
    case IndexType::int64:
      launch_protocol<int64_t>(buffers, p, stream);
      break;
    case IndexType::int32:
      launch_protocol<int32_t>(buffers, p, stream);
      break;
    default:
      FERRY_THROW(Error, "ferry", "topk_idx_type=", static_cast<int>(args.topk_idx_type), " is not int32 or int64");
  }
}

}  // namespace ferry::cuda_ep
