// Host launcher of the normal-mode combine kernel (combine.cuh).
#include <algorithm>
#include <iterator>

#include "core/cuda_check.hpp"
#include "ep/cuda/buffers.hpp"
#include "ep/cuda/combine.cuh"
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
  if (plan.ctas != choice.geometry.blocks)
    clamped = detail::concat("; ", choice.geometry.blocks, " CTAs clamped to ", plan.ctas, " (2 to one per SM)");
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

// Kernel invariants only (FERRY_CHECK: a failure is a bug): the arguments were validated once by EpBuffer
// (validate_dispatch_args / validate_combine_args), which refuses a bad call on every rank. An InputError thrown here
// would be refused on this rank alone, the desync docs/errors.md rules out.
CombineParams to_params(Buffers const& b, CombineArgs const& args, LaunchPlan const& plan, int num_tokens,
                        bool refuse) {
  FERRY_CHECK(refuse || num_tokens == 0 || args.y != nullptr, "combine y is null for num_tokens=", num_tokens,
              " of the last dispatch");
  FERRY_CHECK(args.layout != CombineLayout::expert_major || b.expert_slots > 0,
              "expert-major combine needs EpConfig::expert_capacity (rows per local expert of its input); set "
              "it when creating the EpBuffer or use layout rank_major");
  FERRY_CHECK(plan.push_ctas >= 1 && plan.ctas > plan.push_ctas && plan.ctas <= b.num_sms, "combine grid ", plan.ctas,
              " CTAs with ", plan.push_ctas, " pushing is not valid on ", b.num_sms, " SMs");
  CombineParams p{};
  p.view = b.view;
  for (int r = 0; r < b.world; ++r) p.sym[r] = b.sym.ptr[r];
  p.layout = b.layout;
  p.x = args.x;
  p.y = args.y;
  p.abort = refuse;
  p.landing_row_bytes = wire_row_bytes(b.config.combine_format, b.config.hidden);
  p.hidden = b.config.hidden;
  p.topk = b.config.topk;
  p.expert_slots = b.expert_slots;
  p.max_tokens = b.config.max_tokens_per_rank;
  p.num_push_ctas = plan.push_ctas;
  p.num_ctas = plan.ctas;
  p.state = b.state;
  p.token_mask = b.token_mask;
  p.recv_slot = b.recv_slot;
  p.trace = b.trace ? b.trace->launch(TraceKernel::combine, plan.ctas, kWarps) : trace::TraceView{};
  return p;
}

using CombineKernel = void (*)(CombineParams);

// The instances: (layout, wire format, unit elements). bf16 rows are copied (no unit).
struct Instance {
  bool expert_major;
  WireFormat format;
  int unit;
  CombineKernel kernel;
};

template <bool kExpertMajor>
constexpr Instance kInstances[] = {
    {kExpertMajor, WireFormat::bf16, 0, combine_kernel<kExpertMajor, WireFormat::bf16, 0>},
    {kExpertMajor, WireFormat::fp8_e4m3, 16, combine_kernel<kExpertMajor, WireFormat::fp8_e4m3, 16>},
    {kExpertMajor, WireFormat::fp8_e4m3_ue8m0, 16, combine_kernel<kExpertMajor, WireFormat::fp8_e4m3_ue8m0, 16>},
    {kExpertMajor, WireFormat::nvfp4, 32, combine_kernel<kExpertMajor, WireFormat::nvfp4, 32>},
    {kExpertMajor, WireFormat::nvfp4, 16, combine_kernel<kExpertMajor, WireFormat::nvfp4, 16>},
    {kExpertMajor, WireFormat::mxfp4, 32, combine_kernel<kExpertMajor, WireFormat::mxfp4, 32>},
};

CombineKernel pick_kernel(bool expert_major, WireFormat format, int hidden) {
  int const unit = format == WireFormat::bf16 ? 0 : device::unit_elems_for(format, hidden);
  for (auto const* table : {kInstances<true>, kInstances<false>})
    for (std::size_t i = 0; i < std::size(kInstances<true>); ++i)
      if (table[i].expert_major == expert_major && table[i].format == format && table[i].unit == unit)
        return table[i].kernel;
  FERRY_THROW(ConfigError, "config", "no combine kernel for combine_format=", wire_format_name(format), " with ", unit,
              "-element units (hidden=", hidden, ")");
}

}  // namespace

void launch_combine(Buffers const& buffers, CombineArgs const& args, LaunchPlan const& plan, int num_tokens,
                    cudaStream_t stream, bool refuse) {
  // num_tokens is only checked here; the kernel reads the device copy of the last dispatch's count
  CombineParams const p = to_params(buffers, args, plan, num_tokens, refuse);
  CombineKernel const kernel =
      pick_kernel(args.layout == CombineLayout::expert_major, buffers.config.combine_format, buffers.config.hidden);
  cuda_grid::launch_grid<kThreads>(kernel, p, p.num_ctas, 0, buffers.cooperative, stream);
}

}  // namespace ferry::cuda_ep
