// Host launcher of the normal-mode combine kernel (normal/combine.cuh).
#include <algorithm>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/normal/combine.cuh"
#include "ep/cuda/instances.cuh"
#include "ep/cuda/launch_grid.cuh"
#include "tuning/choose.hpp"

namespace ferry::cuda_ep {

LaunchPlan plan_combine(Buffers const& buffers, int num_tokens) {
  // NOTE: the analytic default is one CTA per SM; EpConfig::combine_geometry, FERRY_COMBINE_BLOCKS and the
  // tuning table come first (choose.hpp). At least 2 CTAs (one push, one sum), at most one per SM (persistent grid).
  Geometry const analytic{buffers.num_sms};
  tuning::Choice const choice = tuning::choose(buffers.combine_tuning, tuning::read_env_pin(tuning::Leg::combine),
                                               num_tokens, analytic, "grid = SMs");
  LaunchPlan plan;
  plan.ctas = std::clamp(choice.geometry.blocks, 2, buffers.num_sms);
  std::string clamped;
  if (plan.ctas != choice.geometry.blocks) {
    clamped = detail::concat("; ", choice.geometry.blocks, " CTAs clamped to ", plan.ctas, " (2 to one per SM)");
    // NOTE: fewer CTAs than asked is slower; a pin below 2 CTAs is raised (that is not slower)
    if (plan.ctas < choice.geometry.blocks) plan.fallbacks |= detail::kFallbackGridClamped;
  }
  // NOTE: push items are (tile, source): world * tiles of at most kMaxCombineTiles; sum items are this rank's tiles.
  // The push side moves and (expert-major) reduces every row, the sum side reads the landing rows once: two thirds
  // of the grid push, one third sums, and neither side gets more CTAs than it has items.
  int const tiles = std::max(1, combine_num_tiles(std::max(num_tokens, 1)));
  int const sum_ctas = std::clamp(plan.ctas / 3, 1, tiles);
  plan.push_ctas = std::min(plan.ctas - sum_ctas, buffers.world * kMaxCombineTiles);
  plan.ctas = plan.push_ctas + sum_ctas;
  plan.why = choice.source + clamped + ", tile " + std::to_string(combine_tile_tokens(num_tokens)) + " tokens";
  if (CombineSums const sums = combine_sums(num_tokens, sum_ctas); sums.num_claims() > 0)
    plan.why += detail::concat(", tiles ", sums.first_claimed, " to ", sums.num_tiles - 1, " of ", sums.num_tiles,
                               " claimed by any idle CTA (the last ", sums.num_tiles - sums.first_tile, " in ",
                               kTailParts, " parts each)");
  return plan;
}

namespace {

// Kernel invariants only (FERRY_CHECK: a failure is a bug; check_dispatch_invariants in buffers.cu says why).
CombineParams to_params(Buffers const& b, CombineArgs const& args, LaunchPlan const& plan, int num_tokens, bool refuse,
                        CombineVariant variant) {
  FERRY_CHECK(refuse || num_tokens == 0 || args.y != nullptr, "combine y is null for num_tokens=", num_tokens,
              " of the last dispatch");
  FERRY_CHECK(args.layout != CombineLayout::expert_major || b.expert_slots > 0,
              "expert-major combine needs EpConfig::expert_capacity (rows per local expert of its input); set "
              "it when creating the EpBuffer or use layout rank_major");
  FERRY_CHECK(plan.push_ctas >= 1 && plan.ctas > plan.push_ctas && plan.ctas <= b.num_sms, "combine grid ", plan.ctas,
              " CTAs with ", plan.push_ctas, " pushing is not valid on ", b.num_sms, " SMs");
  CombineParams p{};
  static_cast<KernelParams&>(p) = common_params(b, plan.ctas, refuse, TraceKernel::combine);
  p.x = args.x;
  p.y = args.y;
  p.landing_row_bytes = wire_row_bytes(b.config.combine_format, b.config.hidden);
  p.expert_slots = b.expert_slots;
  p.num_push_ctas = plan.push_ctas;
  p.token_mask = b.token_mask;
  p.recv_slot = b.recv_slot;
  p.unit_weights = variant.unit_weights;
  p.y_fp32 = variant.y_fp32 && !refuse;  // a refused combine writes no y
  return p;
}

using CombineKernel = void (*)(CombineParams);

// The family's instances (instances.cuh): codec x layout.
struct CombineFamily : InstanceFamily<CombineKernel, 2, true> {
  static constexpr char const* kName = "normal combine";
  static constexpr char const* kFormatField = "combine_format";
  static constexpr int variant(CombineLayout layout) { return layout == CombineLayout::expert_major ? 1 : 0; }
  template <int kCodec, int kVariant>
  static constexpr Kernel kernel() {
    constexpr Codec codec = kCodecs[kCodec];
    return combine_kernel<kVariant == 1, codec.format, codec.unit>;
  }
};

}  // namespace

void launch_combine(Buffers const& buffers, CombineArgs const& args, LaunchPlan const& plan, int num_tokens,
                    cudaStream_t stream, bool refuse, detail::LegRecord* record, CombineVariant variant) {
  // num_tokens is only checked here; the kernel reads the device copy of the last dispatch's count
  CombineParams const p = to_params(buffers, args, plan, num_tokens, refuse, variant);
  if (buffers.protocol == Protocol::hierarchical) {
    launch_hier_combine(buffers, p, args.layout, stream, record);
    return;
  }
  CombineKernel const kernel = find_instance<CombineFamily>(buffers.config.combine_format, buffers.config.hidden,
                                                            CombineFamily::variant(args.layout), record);
  cuda_grid::launch_grid<kThreads>(kernel, p, p.num_ctas, 0, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ep
