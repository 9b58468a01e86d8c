// The fast-path test (DESIGN "No silent slow paths"): walks worlds 1, 2, 4 and 8 (virtual ranks on one GPU,
// support/virtual_ranks.hpp), topk 1..9 and hidden 2048 / 4096 / 7168, in normal mode (a small batch: the landing
// zone; a large one: the count exchange) and in low-latency mode, bf16 and fp8 in each. Each case runs a dispatch and a
// combine of real tokens through the backend's own decisions (detail::choose_protocol, plan_dispatch /
// plan_combine, ll_grid, the instance tables of instances.cuh, which record what ran in a detail::LegRecord) and
// asserts that no leg recorded a fallback. The check can fail: ForcedFallbackIsDetected sets the test-only
// detail::force_fallback_for_test, which makes the decisions take their slower branch (the count exchange for a small
// batch, half the low-latency grid), and asserts that the same walk then sees it.
#include <gtest/gtest.h>

#include <cuda_runtime.h>

#include <cstdio>
#include <string>
#include <vector>

#include "ep/cuda/buffers.hpp"
#include "ep/ep_impl.hpp"
#include "ep/landing_policy.hpp"
#include "ep/run_record.hpp"
#include "support/gpu_case.hpp"
#include "support/virtual_ranks.hpp"

namespace ferry::test {
namespace test_fast_path_virtual {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

using cuda_ep::Buffers;
using cuda_ep::Half;
using cuda_ep::Protocol;
using VirtualFastRanks = VirtualRanks<Buffers, cuda_ep::allocate_buffers, cuda_ep::free_buffers>;

struct FastCase {
  Mode mode = Mode::normal;
  WireFormat format = WireFormat::bf16;
  int world = 1;
  int topk = 1;
  int hidden = 2048;
  int max_tokens = 16;
};

std::string describe(FastCase const& c) {
  return detail::concat("mode ", mode_name(c.mode), " format ", wire_format_name(c.format), " world ", c.world,
                        " topk ", c.topk, " hidden ", c.hidden, " max_tokens ", c.max_tokens);
}

// Runs one dispatch + combine of `c` on virtual ranks of ctas CTAs each and returns the fallbacks every rank's legs
// recorded (OR), with what ran in `ran`. Fails the calling test when the call itself fails.
uint8_t run_fast_case(FastCase const& c, int ctas, uint64_t seed, std::string& ran) {
  int const world = c.world;
  EpConfig user;
  user.mode = c.mode;
  user.hidden = c.hidden;
  user.topk = c.topk;
  user.num_experts = 64;
  user.max_tokens_per_rank = c.max_tokens;
  user.dispatch_format = c.format;
  user.combine_format = c.format;
  if (c.mode == Mode::normal) user.expert_capacity = user.recv_capacity(world);
  user.validate(world);
  EpConfig const config = user.resolved(world);
  // 1. the backend's decisions, as CudaEp makes them
  detail::ProtocolChoice const protocol = detail::choose_protocol(config, world, "auto");
  uint8_t fallbacks = protocol.fallback ? detail::kFallbackCountExchange : detail::kNoFallback;
  cuda_ep::GridChoice const grid = cuda_ep::ll_grid(ctas, "virtual ranks", ctas);
  if (protocol.protocol == Protocol::ll) fallbacks |= grid.fallbacks;
  cuda_ep::SymLayout const layout = cuda_ep::make_sym_layout(config, world, protocol.protocol);
  VirtualFastRanks ranks(world, layout.total, [&](Buffers& b, int r) {
    cuda_ep::configure_buffers(b, config, world, r, protocol.protocol, ctas);
    b.num_ctas = grid.ctas;
    b.layout = layout;
  });
  // 2. inputs: every rank passes a full batch but the last (one token fewer)
  std::vector<int> tokens(world, c.max_tokens);
  tokens.back() = std::max(1, c.max_tokens - 1);
  std::vector<VirtualRankIo> io;
  io.reserve(world);
  for (int r = 0; r < world; ++r) io.emplace_back(config, world, tokens[r]);
  RoutingOptions routing;
  routing.seed = seed;
  VirtualIteration const it(config, world, routing, tokens, io);
  std::vector<detail::LegRecord> dispatch(world), combine(world);
  // 3. dispatch, then a rank-major combine, every rank on its own stream
  for (int r = 0; r < world; ++r) {
    DispatchArgs args;
    args.x = io[r].x.ptr;
    args.num_tokens = tokens[r];
    args.topk_idx = io[r].idx.ptr;
    args.topk_idx_type = IndexType::int64;
    args.topk_weights = static_cast<float const*>(io[r].w.ptr);
    detail::validate_dispatch_args(config, args);
    if (protocol.protocol == Protocol::ll) {
      cuda_ep::launch_ll_dispatch(ranks[r], args, Half::both, ranks.stream(r), false, &dispatch[r]);
    } else {
      cuda_ep::LaunchPlan const plan = cuda_ep::plan_dispatch(ranks[r], tokens[r]);
      cuda_ep::launch_dispatch(ranks[r], args, plan, ranks.stream(r), false, &dispatch[r]);
      dispatch[r].fallbacks |= plan.fallbacks;
    }
  }
  for (int r = 0; r < world; ++r) {
    CombineArgs args{CombineLayout::rank_major, io[r].rows.ptr, io[r].y_rm.ptr, true};
    if (protocol.protocol == Protocol::ll) {
      cuda_ep::launch_ll_combine(ranks[r], args, tokens[r], Half::both, ranks.stream(r), false, &combine[r]);
    } else {
      cuda_ep::LaunchPlan const plan = cuda_ep::plan_combine(ranks[r], tokens[r]);
      cuda_ep::launch_combine(ranks[r], args, plan, tokens[r], ranks.stream(r), false, &combine[r]);
      combine[r].fallbacks |= plan.fallbacks;
    }
  }
  std::vector<int> dropped(world);
  for (int r = 0; r < world; ++r) dropped[r] = protocol.protocol == Protocol::ll ? it.expected[r].dropped_slots : 0;
  std::string const failure = ranks.synchronize(dropped);
  EXPECT_EQ(failure, "") << describe(c);
  for (int r = 0; r < world; ++r) fallbacks |= dispatch[r].fallbacks | combine[r].fallbacks;
  ran = detail::concat(protocol.protocol == Protocol::ll        ? "ll"
                       : protocol.protocol == Protocol::landing ? "landing"
                                                                : "count exchange",
                       ", ", protocol.protocol == Protocol::ll ? grid.ctas : ctas, " CTAs, unit ", dispatch[0].unit,
                       ": ", detail::fallback_text(fallbacks, protocol.why.c_str()));
  return fallbacks;
}

// The walk: every case of the grid, at its world's virtual CTAs. Returns the cases that recorded a fallback.
std::vector<std::string> walk(std::vector<FastCase> const& cases, uint64_t seed) {
  std::vector<std::string> fell_back;
  for (FastCase const& c : cases) {
    int const ctas = virtual_ctas_per_rank(c.world, cuda_ep::kMaxLlCtas);
    if (ctas < 1) continue;  // the GPU has fewer SMs than ranks
    std::string ran;
    if (run_fast_case(c, ctas, seed, ran) != detail::kNoFallback) fell_back.push_back(describe(c) + ": " + ran);
  }
  return fell_back;
}

std::vector<FastCase> grid() {
  std::vector<FastCase> cases;
  for (int world : {1, 2, 4, 8})
    for (int topk = 1; topk <= 9; ++topk)
      for (int hidden : {2048, 4096, 7168}) {
        for (WireFormat format : {WireFormat::bf16, WireFormat::fp8_e4m3}) {
          cases.push_back({Mode::low_latency, format, world, topk, hidden, 16});
          // normal mode: a small batch (landing zone) and a large one (count exchange)
          cases.push_back({Mode::normal, format, world, topk, hidden, 16});
          cases.push_back({Mode::normal, format, world, topk, hidden, 1024 / world + 1});
        }
      }
  return cases;
}

TEST(FastPathVirtualRanks, NoFallbackOnTheSupportedGrid) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  uint64_t const seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  detail::force_fallback_for_test(false);
  std::vector<std::string> const fell_back = walk(grid(), seed);
  for (std::string const& line : fell_back) ADD_FAILURE() << "fallback ran: " << line;
}

// The check above can fail: with the test-only switch on, the slower branches run and the walk sees them.
TEST(FastPathVirtualRanks, ForcedFallbackIsDetected) {
  if (cuda_device_count() == 0) GTEST_SKIP() << "needs a GPU, found 0";
  uint64_t const seed = fresh_seed();
  std::printf("seed %llu\n", static_cast<unsigned long long>(seed));
  std::vector<FastCase> const cases = {{Mode::normal, WireFormat::bf16, 2, 8, 7168, 16},
                                       {Mode::low_latency, WireFormat::bf16, 2, 8, 7168, 16}};
  detail::force_fallback_for_test(true);
  std::vector<std::string> const fell_back = walk(cases, seed);
  detail::force_fallback_for_test(false);
  ASSERT_EQ(fell_back.size(), cases.size()) << "a forced fallback went unseen";
  EXPECT_NE(fell_back[0].find("count exchange"), std::string::npos) << fell_back[0];
  EXPECT_NE(fell_back[1].find("fewer CTAs"), std::string::npos) << fell_back[1];
  // and nothing is left forced for the next test
  EXPECT_TRUE(walk(cases, seed).empty());
}

}  // namespace test_fast_path_virtual
}  // namespace ferry::test
