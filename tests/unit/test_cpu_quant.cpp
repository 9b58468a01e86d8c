// Quantized wire formats through EpBuffer on the cpu backend (ranks as processes), both modes:
//  - dispatch: the delivered payload, scale tensor (every layout the format supports) and per-token scales are exactly
//    ref::deliver of the reference's wire rows; pre-quantized input is forwarded exactly; dispatch_dequantize gives
//    the reference's dequantized rows; the expert-major layout likewise per expert;
//  - combine in every format: bit-exact with the reference, and within the derived error bound
//    (wire::combine_error_bound, docs/quant.md) of the exact sum of the unquantized rows;
//  - bad configurations and arguments: ConfigError / InputError naming the field.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "wire/codec.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"
#include "workloads/inputs.hpp"
#include "workloads/routing.hpp"

namespace ferry {
namespace {

using detail::concat;
using test::expect_error;

std::size_t at(int64_t row, int64_t width) {
  return static_cast<std::size_t>(row * width);
}

constexpr WireFormat kQuantized[] = {WireFormat::fp8_e4m3, WireFormat::fp8_e4m3_ue8m0, WireFormat::nvfp4,
                                     WireFormat::mxfp4};
constexpr ScaleLayout kLayouts[] = {ScaleLayout::row_major, ScaleLayout::mn_major_tma,
                                    ScaleLayout::mn_major_tma_packed_ue8m0, ScaleLayout::blocked_128x4};

// Compares the delivered scale entries of rows [0, num_rows) of a tensor of tensor_rows rows (padding and rows past
// num_rows are unspecified), and the token scales.
std::string compare_scales(EpConfig const& config, ref::DeliveredRows const& want, void const* scales,
                           float const* token_scales, int num_rows, int tensor_rows, std::string const& what) {
  std::string const problem = ref::compare_delivered_scales(config, want, scales, token_scales, num_rows, tensor_rows);
  return problem.empty() ? problem : concat(what, ": ", problem);
}

struct Variant {
  Mode mode = Mode::normal;
  WireFormat dispatch = WireFormat::bf16;
  ScaleLayout layout = ScaleLayout::row_major;
  bool dequantize = false;
  bool prequantized = false;
  WireFormat combine = WireFormat::bf16;
  std::string name() const {
    return concat(mode_name(mode), " dispatch ", wire_format_name(dispatch), dequantize ? " (dequantized)" : "",
                  prequantized ? " (pre-quantized)" : "", " ", scale_layout_name(layout), ", combine ",
                  wire_format_name(combine));
  }
};

std::vector<Variant> variants() {
  std::vector<Variant> out;
  for (Mode mode : {Mode::normal, Mode::low_latency}) {
    for (WireFormat format : kQuantized) {
      for (ScaleLayout layout : kLayouts) {
        if (!scale_layout_supported(format, layout)) continue;
        out.push_back({mode, format, layout, false, false, WireFormat::bf16});
      }
      out.push_back({mode, format, ScaleLayout::row_major, false, true, WireFormat::bf16});
      out.push_back({mode, format, ScaleLayout::row_major, true, false, format});
    }
    for (WireFormat format : kQuantized)
      out.push_back({mode, WireFormat::bf16, ScaleLayout::row_major, false, false, format});
  }
  return out;
}

// Checks |y - sum_i x_i| against wire::combine_error_bound for every element of every token: terms[t] holds the
// bf16 rows (one per destination that received token t) the destinations sent back.
std::string check_error_bound(WireFormat format, int hidden,
                              std::vector<std::vector<std::vector<uint16_t>>> const& terms,
                              std::vector<uint16_t> const& y, double* worst_ratio) {
  for (std::size_t t = 0; t < terms.size(); ++t) {
    if (terms[t].empty()) continue;
    std::vector<uint16_t const*> rows;
    for (auto const& row : terms[t]) rows.push_back(row.data());
    wire::CombineRowError const measured = wire::measure_combine_row(
        format, hidden, rows.data(), static_cast<int>(rows.size()), y.data() + at(static_cast<int64_t>(t), hidden));
    *worst_ratio = std::max(*worst_ratio, measured.worst_ratio);
    if (measured.first_over >= 0)
      return concat("token ", t, " element ", measured.first_over, ": |", measured.over_y, " - ", measured.over_exact,
                    "| = ", measured.over_error, " > bound ", measured.over_bound);
  }
  return "";
}

std::vector<std::string> run_variant(std::shared_ptr<Communicator> const& comm, Variant const& v, uint64_t seed) {
  int const rank = comm->rank();
  int const world = comm->world();
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  EpConfig user;
  user.mode = v.mode;
  user.hidden = 512;
  user.topk = 4;
  user.num_experts = 4 * world;
  user.max_tokens_per_rank = 12;
  user.dispatch_format = v.dispatch;
  user.combine_format = v.combine;
  user.dispatch_dequantize = v.dequantize;
  user.recv_scale_layout = v.layout;
  if (v.mode == Mode::normal) user.expert_capacity = world * user.max_tokens_per_rank;
  EpBuffer buffer(comm, user);
  EpConfig const& config = buffer.config();
  int const hidden = config.hidden;
  int const num_local = config.num_local_experts(world);
  int const slots = config.expert_slots();
  int const capacity = config.recv_capacity(world);
  bool const quantized_out = config.delivers_quantized();

  RoutingOptions routing;
  routing.seed = seed;
  routing.mask_rate = 0.1;
  std::vector<int> tokens(static_cast<std::size_t>(world));
  std::mt19937 sizes(static_cast<uint32_t>(seed));
  for (int r = 0; r < world; ++r) tokens[static_cast<std::size_t>(r)] = 1 + static_cast<int>(sizes() % 12);
  std::vector<ref::RankInput> inputs = ref::generate_inputs(config, world, routing, tokens);
  if (v.prequantized)  // the input arrives quantized: the same wire rows, which dispatch must forward unchanged
    for (auto& input : inputs) input.x_wire = ref::source_wire_rows(config, input);
  std::vector<ref::RankDispatch> want;
  for (int d = 0; d < world; ++d) want.push_back(ref::dispatch(config, world, d, inputs));
  ref::RankInput const& in = inputs[static_cast<std::size_t>(rank)];
  ref::RankDispatch const& mine = want[static_cast<std::size_t>(rank)];

  // 1. dispatch
  ref::QuantizedInput split;
  DispatchArgs args;
  args.num_tokens = in.num_tokens;
  args.topk_idx = in.topk_idx.data();
  args.topk_weights = in.topk_weights.data();
  args.expand = true;
  if (v.prequantized) {
    split = ref::split_wire_rows(config, in.x_wire, in.num_tokens);
    args.x = split.payload.data();
    args.x_scales = split.scales.data();
    args.x_token_scales = split.token_scales.empty() ? nullptr : split.token_scales.data();
  } else {
    args.x = in.x.data();
  }
  DispatchResult const result = buffer.dispatch(args);
  std::string const where = v.name() + ": ";
  if (result.num_recv_host != mine.num_recv)
    note(concat(where, "num_recv ", result.num_recv_host, " != ", mine.num_recv));
  if (result.recv_row_bytes != config.recv_row_bytes()) note(where + "recv_row_bytes");
  if (v.mode == Mode::normal) {
    if (quantized_out) {
      ref::DeliveredRows const delivered = ref::deliver(config, mine.recv_wire, mine.num_recv, capacity);
      if (std::memcmp(result.recv_x, delivered.payload.data(), delivered.payload.size()) != 0)
        note(where + "recv_x payload differs");
      note(compare_scales(config, delivered, result.recv_scales, result.recv_token_scales, mine.num_recv, capacity,
                          where + "recv_scales"));
    } else {
      if (result.recv_scales != nullptr) note(where + "recv_scales set for a bf16 delivery");
      if (std::memcmp(result.recv_x, mine.recv_x.data(), mine.recv_x.size() * 2) != 0) note(where + "recv_x differs");
    }
  }
  // expert-major (both modes): per expert, the filled slots
  std::vector<uint8_t> const wire_expert = ref::expand_wire(config, world, mine);
  std::vector<uint16_t> const bf16_expert = ref::expand(config, world, mine);
  std::size_t const wire_bytes = wire_row_bytes(config.dispatch_format, hidden);
  for (int e = 0; e < num_local; ++e) {
    int const filled = std::min(mine.expert_counts[static_cast<std::size_t>(e)], slots);
    std::string const expert = concat(where, "expert ", e);
    if (quantized_out) {
      std::span<uint8_t const> const rows(wire_expert.data() + at(static_cast<int64_t>(e) * slots, wire_bytes),
                                          at(filled, wire_bytes));
      ref::DeliveredRows const delivered = ref::deliver(config, rows, filled, slots);
      auto const* got =
          static_cast<uint8_t const*>(result.expert_x) + at(static_cast<int64_t>(e) * slots, 1) * result.recv_row_bytes;
      if (filled > 0 && std::memcmp(got, delivered.payload.data(), delivered.payload.size()) != 0)
        note(expert + " payload differs");
      std::size_t const tensor = scale_tensor_bytes(config.dispatch_format, config.recv_scale_layout, slots, hidden);
      note(compare_scales(config, delivered, static_cast<uint8_t const*>(result.expert_scales) + at(e, tensor),
                          result.expert_token_scales ? result.expert_token_scales + at(e, slots) : nullptr, filled,
                          slots, expert + " scales"));
    } else {
      auto const* got = static_cast<uint16_t const*>(result.expert_x) + at(static_cast<int64_t>(e) * slots, hidden);
      if (std::memcmp(got, bf16_expert.data() + at(static_cast<int64_t>(e) * slots, hidden), at(filled, hidden) * 2) !=
          0)
        note(expert + " rows differ");
    }
  }

  // 2. expert-major combine of arbitrary expert outputs: exact vs the reference, and within the bound of the exact
  //    sum of what each destination sent back
  std::vector<std::vector<uint16_t>> expert_out;
  for (int d = 0; d < world; ++d) expert_out.push_back(generate_tokens(seed ^ 0xe0e0, d, num_local * slots, hidden));
  std::vector<uint16_t> y(at(in.num_tokens, hidden), 0xeeee);
  CombineArgs combine;
  combine.layout = CombineLayout::expert_major;
  combine.x = expert_out[static_cast<std::size_t>(rank)].data();
  combine.y = y.data();
  buffer.combine(combine);
  std::vector<uint16_t> const want_y = ref::combine_expert_major(config, world, rank, inputs, want, expert_out);
  if (y != want_y) note(where + "y (expert_major) differs from the reference");
  if (config.combine_format != WireFormat::bf16) {
    // the terms: each destination's reduced row of each of this rank's tokens
    std::vector<std::vector<std::vector<uint16_t>>> terms(static_cast<std::size_t>(in.num_tokens));
    for (int d = 0; d < world; ++d) {
      std::vector<uint16_t> const rows = ref::reduce_local_experts(config, world, want[static_cast<std::size_t>(d)],
                                                                   expert_out[static_cast<std::size_t>(d)]);
      ref::RankDispatch const& rd = want[static_cast<std::size_t>(d)];
      for (int i = 0; i < rd.num_recv; ++i)
        if (rd.recv_src[at(i, 2)] == rank)
          terms[static_cast<std::size_t>(rd.recv_src[at(i, 2) + 1])].emplace_back(rows.begin() + at(i, hidden),
                                                                                  rows.begin() + at(i + 1, hidden));
    }
    double worst = 0;
    std::string const bound_problem = check_error_bound(config.combine_format, hidden, terms, y, &worst);
    if (!bound_problem.empty()) note(where + bound_problem);
  }

  // 3. rank-major combine (normal mode)
  if (v.mode == Mode::normal) {
    std::vector<std::vector<uint16_t>> rows;
    for (int d = 0; d < world; ++d)
      rows.push_back(generate_tokens(seed ^ 0x7070, d, want[static_cast<std::size_t>(d)].num_recv, hidden));
    std::vector<uint16_t> const dummy(8);
    combine.layout = CombineLayout::rank_major;
    combine.x =
        rows[static_cast<std::size_t>(rank)].empty() ? dummy.data() : rows[static_cast<std::size_t>(rank)].data();
    std::fill(y.begin(), y.end(), 0xeeee);
    buffer.combine(combine);
    if (y != ref::combine_rank_major(config, world, rank, inputs, want, rows))
      note(where + "y (rank_major) differs from the reference");
  }
  return problems;
}

FERRY_RANK_CASE(cpu_quant_matches_reference) {
  uint64_t const seed = test::seed_arg();
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  int failures = 0;
  uint64_t variant_seed = seed;
  for (Variant const& v : variants()) {
    for (std::string const& problem : run_variant(comm, v, variant_seed++)) {
      std::fprintf(stderr, "rank %d, world %d: %s\n", comm->rank(), comm->world(), problem.c_str());
      ++failures;
    }
  }
  return failures == 0 ? 0 : 1;
}

class CpuQuantWorld : public testing::TestWithParam<int> {};

TEST_P(CpuQuantWorld, DeliveryIsExactAndCombineIsExactAndWithinItsBound) {
  test::RankCaseOptions options;
  options.args = {concat("--seed=", test::test_seed())};
  options.env = {{"FERRY_TIMEOUT_S", "20"}};
  options.timeout = std::chrono::seconds(240);
  LaunchResult const result = test::run_rank_case("cpu_quant_matches_reference", GetParam(), options);
  EXPECT_TRUE(result.ok()) << result.describe() << " (seed " << test::test_seed() << ")";
}

INSTANTIATE_TEST_SUITE_P(Worlds, CpuQuantWorld, testing::Values(1, 3, 8));

// --- bad configurations and arguments ------------------------------------------------------------------------------

TEST(CpuQuantConfig, DequantizeNeedsAQuantizedFormatAndTheLayoutMustHoldTheScales) {
  EpConfig config;
  config.dispatch_dequantize = true;
  EXPECT_EQ(expect_error<ConfigError>([&] { config.validate(2); }, {"dispatch_dequantize=true", "bf16"}), "");
  config = {};
  config.dispatch_format = WireFormat::fp8_e4m3;
  config.recv_scale_layout = ScaleLayout::blocked_128x4;
  EXPECT_EQ(expect_error<ConfigError>([&] { config.validate(2); }, {"recv_scale_layout=blocked_128x4", "fp8"}), "");
  config.recv_scale_layout = ScaleLayout::mn_major_tma_packed_ue8m0;
  EXPECT_EQ(expect_error<ConfigError>([&] { config.validate(2); }, {"mn_major_tma_packed_ue8m0"}), "");
  config.dispatch_format = WireFormat::fp8_e4m3_ue8m0;
  EXPECT_NO_THROW(config.validate(2));
  config = {};
  config.hidden = 7168 + 16;  // not a multiple of mxfp4's 32-element block
  config.combine_format = WireFormat::mxfp4;
  EXPECT_EQ(expect_error<ConfigError>([&] { config.validate(2); }, {"hidden=7184", "mxfp4"}), "");
  EXPECT_EQ(parse_scale_layout("mn_major_tma"), ScaleLayout::mn_major_tma);
  EXPECT_EQ(expect_error<ConfigError>([] { parse_scale_layout("col"); }, {"'col'", "row_major"}), "");
}

FERRY_RANK_CASE(cpu_quant_bad_arguments) {
  std::shared_ptr<Communicator> const comm = test::connect_rank(Backend::cpu);
  std::vector<std::string> problems;
  auto note = [&](std::string const& problem) {
    if (!problem.empty()) problems.push_back(problem);
  };
  std::vector<uint8_t> payload(4096, 0);
  std::vector<float> scales(64, 1.0f);
  std::vector<int64_t> idx(4, 0);
  std::vector<float> weights(4, 1.0f);
  DispatchArgs args;
  args.num_tokens = 1;
  args.x = payload.data();
  args.topk_idx = idx.data();
  args.topk_weights = weights.data();
  args.x_scales = scales.data();
  {
    EpConfig config;
    config.hidden = 512;
    config.topk = 4;
    config.num_experts = 8;
    config.max_tokens_per_rank = 4;
    EpBuffer bf16(comm, config);
    note(expect_error<InputError>([&] { bf16.dispatch(args); }, {"x_scales", "dispatch_format=bf16"}));
    config.dispatch_format = WireFormat::nvfp4;
    EpBuffer nvfp4(comm, config);
    note(expect_error<InputError>([&] { nvfp4.dispatch(args); }, {"x_token_scales", "nvfp4"}));
    config.dispatch_format = WireFormat::fp8_e4m3;
    EpBuffer fp8(comm, config);
    args.x_token_scales = scales.data();
    note(expect_error<InputError>([&] { fp8.dispatch(args); }, {"x_token_scales", "fp8"}));
  }
  for (auto const& problem : problems) std::fprintf(stderr, "rank %d: %s\n", comm->rank(), problem.c_str());
  return problems.empty() ? 0 : 1;
}

TEST(CpuQuant, BadPreQuantizedArgumentsAreInputErrors) {
  test::RankCaseOptions options;
  options.env = {{"FERRY_TIMEOUT_S", "10"}};
  LaunchResult const result = test::run_rank_case("cpu_quant_bad_arguments", 1, options);
  EXPECT_TRUE(result.ok()) << result.describe();
}

}  // namespace
}  // namespace ferry
