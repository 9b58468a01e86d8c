// Properties of the routing generators (workloads/routing.hpp) and the token generator.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/error.hpp"
#include "support/rank_case.hpp"
#include "workloads/routing.hpp"

namespace ferry {
namespace {

// Inputs come from test::test_seed() (fresh per run and printed, FERRY_TEST_SEED replays one). The statistical
// checks allow 5 standard deviations.
using test::test_seed;

struct Routing {
  int columns = 0;
  std::vector<int64_t> idx;
  std::vector<float> weights;
};

Routing generate(RoutingOptions const& options, int num_experts, int world, int rank, int num_tokens, int topk) {
  Routing routing;
  routing.columns = routing_columns(options, topk);
  routing.idx.assign(static_cast<std::size_t>(num_tokens) * routing.columns, -7);
  routing.weights.assign(routing.idx.size(), -7.0f);
  generate_routing(options, num_experts, world, rank, num_tokens, topk, routing.idx, routing.weights);
  return routing;
}

// The properties every routing has: ids in [-1, E), valid ids distinct per token, weights positive on valid
// entries, 0 on -1 entries, summing to 1; shared columns are never masked and live on the token's own rank.
void expect_common_properties(RoutingOptions const& options, Routing const& routing, int num_experts, int world,
                              int rank, int num_tokens, int topk) {
  int const local = num_experts / world;
  for (int t = 0; t < num_tokens; ++t) {
    std::set<int64_t> seen;
    double sum = 0.0;
    int valid = 0;
    for (int j = 0; j < routing.columns; ++j) {
      std::size_t const at = static_cast<std::size_t>(t) * routing.columns + j;
      int64_t const id = routing.idx[at];
      float const w = routing.weights[at];
      ASSERT_GE(id, -1) << "token " << t << " column " << j;
      ASSERT_LT(id, num_experts) << "token " << t << " column " << j;
      if (id < 0) {
        ASSERT_EQ(w, 0.0f) << "token " << t << " column " << j;
        ASSERT_LT(j, topk) << "a shared column was masked, token " << t;
        continue;
      }
      ++valid;
      ASSERT_TRUE(seen.insert(id).second) << "token " << t << " repeats expert " << id;
      ASSERT_GT(w, 0.0f) << "token " << t << " column " << j;
      sum += w;
      if (j >= topk) ASSERT_EQ(id / local, rank) << "shared column " << j << " of token " << t << " not local";
    }
    if (valid > 0) ASSERT_NEAR(sum, 1.0, 1e-5) << "token " << t;
  }
  (void)options;
}

struct Shape {
  int num_experts;
  int world;
  int topk;
};

TEST(Routing, EveryKindHasTheCommonProperties) {
  for (RoutingKind kind : {RoutingKind::random, RoutingKind::ring, RoutingKind::grouped, RoutingKind::hot}) {
    for (Shape shape : {Shape{64, 4, 8}, Shape{8, 1, 8}, Shape{256, 8, 9}, Shape{32, 8, 1}, Shape{128, 2, 16}}) {
      for (int shared : {0, 1, 2}) {
        for (double mask_rate : {0.0, 0.3}) {
          RoutingOptions options;
          options.kind = kind;
          options.shared_experts = shared;
          options.mask_rate = mask_rate;
          options.expert_groups = shape.num_experts >= 8 ? 8 : 1;
          options.topk_groups = options.expert_groups / 2 > 0 ? options.expert_groups / 2 : 1;
          options.hot_expert = shape.num_experts - 1;
          options.seed = test_seed();
          if (routing_columns(options, shape.topk) > kMaxTopk) continue;
          try {
            validate_routing(options, shape.num_experts, shape.world, shape.topk);
          } catch (ConfigError const&) {
            continue;  // e.g. too many shared experts for the rank; covered by ValidateRoutingNamesTheRule
          }
          for (int rank = 0; rank < shape.world; rank += std::max(1, shape.world / 3)) {
            SCOPED_TRACE(std::string(routing_name(kind)) + " E=" + std::to_string(shape.num_experts) +
                         " W=" + std::to_string(shape.world) + " topk=" + std::to_string(shape.topk) +
                         " shared=" + std::to_string(shared) + " mask=" + std::to_string(mask_rate) +
                         " rank=" + std::to_string(rank));
            Routing const routing = generate(options, shape.num_experts, shape.world, rank, 300, shape.topk);
            expect_common_properties(options, routing, shape.num_experts, shape.world, rank, 300, shape.topk);
          }
        }
      }
    }
  }
}

TEST(Routing, ColumnsIncludeSharedExperts) {
  RoutingOptions options;
  options.shared_experts = 2;
  EXPECT_EQ(routing_columns(options, 8), 10);
}

TEST(Routing, RingGoesToTheNextRanks) {
  RoutingOptions options;
  options.kind = RoutingKind::ring;
  int const num_experts = 32;
  int const world = 4;
  int const local = num_experts / world;
  for (int topk : {1, 3, 9}) {
    for (int rank = 0; rank < world; ++rank) {
      Routing const routing = generate(options, num_experts, world, rank, 50, topk);
      for (int t = 0; t < 50; ++t)
        for (int j = 0; j < topk; ++j)
          ASSERT_EQ(routing.idx[static_cast<std::size_t>(t) * topk + j] / local, (rank + 1 + j) % world)
              << "topk " << topk << " rank " << rank << " token " << t << " column " << j;
      expect_common_properties(options, routing, num_experts, world, rank, 50, topk);
    }
  }
}

TEST(Routing, GroupedStaysWithinTopkGroups) {
  RoutingOptions options;
  options.seed = test_seed();
  options.kind = RoutingKind::grouped;
  options.expert_groups = 8;
  options.topk_groups = 3;
  int const num_experts = 64;
  int const group_size = num_experts / options.expert_groups;
  Routing const routing = generate(options, num_experts, 4, 1, 2000, 8);
  std::set<int64_t> all_groups;
  for (int t = 0; t < 2000; ++t) {
    std::set<int64_t> groups;
    for (int j = 0; j < 8; ++j) groups.insert(routing.idx[static_cast<std::size_t>(t) * 8 + j] / group_size);
    ASSERT_LE(groups.size(), 3u) << "token " << t;
    all_groups.insert(groups.begin(), groups.end());
  }
  EXPECT_EQ(all_groups.size(), 8u) << "every group is used by some token";
}

TEST(Routing, HotFractionIsRoughlyRight) {
  RoutingOptions options;
  options.seed = test_seed();
  options.kind = RoutingKind::hot;
  options.hot_fraction = 0.3;
  options.hot_expert = 5;
  int const num_tokens = 4000;
  Routing const routing = generate(options, 64, 4, 2, num_tokens, 8);
  int hot = 0;
  for (int t = 0; t < num_tokens; ++t) {
    auto const begin = routing.idx.begin() + static_cast<std::ptrdiff_t>(t) * 8;
    hot += std::find(begin, begin + 8, 5) != begin + 8;
  }
  // Binomial(4000, 0.3): sd 0.0072; 5 sd.
  EXPECT_NEAR(hot / static_cast<double>(num_tokens), 0.3, 0.036);
}

TEST(Routing, MaskRateIsRoughlyRight) {
  RoutingOptions options;
  options.seed = test_seed();
  options.mask_rate = 0.25;
  options.shared_experts = 1;
  int const num_tokens = 4000;
  Routing const routing = generate(options, 64, 4, 0, num_tokens, 8);
  int masked = 0;
  for (int t = 0; t < num_tokens; ++t) {
    for (int j = 0; j < 8; ++j) masked += routing.idx[static_cast<std::size_t>(t) * 9 + j] == -1;
    ASSERT_GE(routing.idx[static_cast<std::size_t>(t) * 9 + 8], 0) << "shared column masked";
  }
  // Binomial(32000, 0.25): sd 0.0024; 5 sd.
  EXPECT_NEAR(masked / (8.0 * num_tokens), 0.25, 0.012);
}

TEST(Routing, FullMaskGivesZeroWeights) {
  RoutingOptions options;
  options.mask_rate = 1.0;
  Routing const routing = generate(options, 16, 2, 0, 20, 4);
  for (std::size_t i = 0; i < routing.idx.size(); ++i) {
    EXPECT_EQ(routing.idx[i], -1);
    EXPECT_EQ(routing.weights[i], 0.0f);
  }
}

TEST(Routing, RandomUsesEveryExpertEvenly) {
  RoutingOptions options;
  options.seed = test_seed();
  int const num_experts = 32;
  Routing const routing = generate(options, num_experts, 4, 3, 8000, 4);
  std::vector<int> hits(num_experts, 0);
  for (int64_t id : routing.idx) ++hits[static_cast<std::size_t>(id)];
  // Expected 1000 per expert; sd about 31.
  for (int e = 0; e < num_experts; ++e) EXPECT_NEAR(hits[static_cast<std::size_t>(e)], 1000, 160) << "expert " << e;
}

TEST(Routing, DeterministicInSeedAndRank) {
  for (RoutingKind kind : {RoutingKind::random, RoutingKind::grouped, RoutingKind::hot}) {
    RoutingOptions options;
    options.kind = kind;
    options.mask_rate = 0.1;
    options.seed = 99;
    Routing const a = generate(options, 64, 4, 1, 100, 8);
    Routing const b = generate(options, 64, 4, 1, 100, 8);
    EXPECT_EQ(a.idx, b.idx) << routing_name(kind);
    EXPECT_EQ(a.weights, b.weights) << routing_name(kind);
    Routing const other_rank = generate(options, 64, 4, 2, 100, 8);
    EXPECT_NE(a.idx, other_rank.idx) << routing_name(kind);
    options.seed = 100;
    Routing const other_seed = generate(options, 64, 4, 1, 100, 8);
    EXPECT_NE(a.idx, other_seed.idx) << routing_name(kind);
    // A token's routing does not depend on how many tokens follow it.
    options.seed = 99;
    Routing const prefix = generate(options, 64, 4, 1, 37, 8);
    EXPECT_TRUE(std::equal(prefix.idx.begin(), prefix.idx.end(), a.idx.begin())) << routing_name(kind);
  }
}

uint64_t fnv1a(void const* data, std::size_t bytes, uint64_t hash = 0xcbf29ce484222325ULL) {
  auto const* p = static_cast<unsigned char const*>(data);
  for (std::size_t i = 0; i < bytes; ++i) hash = (hash ^ p[i]) * 0x100000001b3ULL;
  return hash;
}

// Pinned outputs: the generators use no implementation-defined distribution and no libm function, so these hold on
// every machine and compiler. A change here changes every benchmark's and test's inputs: do it on purpose only.
TEST(Routing, GoldenOutputs) {
  RoutingOptions options;
  options.kind = RoutingKind::grouped;
  options.mask_rate = 0.1;
  options.shared_experts = 1;
  options.seed = 7;
  Routing const routing = generate(options, 256, 8, 3, 64, 8);
  uint64_t hash = fnv1a(routing.idx.data(), routing.idx.size() * sizeof(int64_t));
  hash = fnv1a(routing.weights.data(), routing.weights.size() * sizeof(float), hash);
  std::vector<uint16_t> const tokens = generate_tokens(7, 3, 16, 128);
  uint64_t const token_hash = fnv1a(tokens.data(), tokens.size() * sizeof(uint16_t));
  EXPECT_EQ(hash, 0x407533c010d20fabULL) << std::hex << "routing hash 0x" << hash;
  EXPECT_EQ(token_hash, 0x0fefee84960cf177ULL) << std::hex << "token hash 0x" << token_hash;
}

// Expects ConfigError whose message names every fragment.
void expect_config_error(RoutingOptions const& options, int num_experts, int world, int topk,
                         std::vector<std::string> const& fragments) {
  try {
    validate_routing(options, num_experts, world, topk);
    ADD_FAILURE() << "no ConfigError";
  } catch (ConfigError const& error) {
    std::string const message = error.what();
    for (auto const& fragment : fragments)
      EXPECT_NE(message.find(fragment), std::string::npos) << "'" << fragment << "' missing from: " << message;
  }
}

TEST(Routing, ValidateRoutingNamesTheRule) {
  RoutingOptions grouped;
  grouped.kind = RoutingKind::grouped;
  grouped.expert_groups = 6;
  expect_config_error(grouped, 64, 4, 8, {"expert_groups=6", "divide", "num_experts=64"});
  grouped.expert_groups = 8;
  grouped.topk_groups = 9;
  expect_config_error(grouped, 64, 4, 8, {"topk_groups=9", "expert_groups=8"});
  grouped.topk_groups = 1;
  expect_config_error(grouped, 64, 4, 9, {"topk=9", "topk_groups=1"});

  RoutingOptions hot;
  hot.kind = RoutingKind::hot;
  hot.hot_expert = 64;
  expect_config_error(hot, 64, 4, 8, {"hot_expert=64", "num_experts=64"});
  hot.hot_expert = 0;
  hot.hot_fraction = 1.5;
  expect_config_error(hot, 64, 4, 8, {"hot_fraction=1.5"});

  RoutingOptions masked;
  masked.mask_rate = -0.1;
  expect_config_error(masked, 64, 4, 8, {"mask_rate=-0.1"});

  RoutingOptions shared;
  shared.shared_experts = 3;
  // 2 experts per rank and both can be routed locally: no room for shared ones.
  expect_config_error(shared, 8, 4, 2, {"shared_experts=3", "holds 2 experts"});
  shared.shared_experts = 9;
  expect_config_error(shared, 256, 4, 8, {"shared_experts=9", "17 columns", "16"});

  RoutingOptions plain;
  expect_config_error(plain, 64, 3, 8, {"num_experts=64", "world=3"});
  expect_config_error(plain, 64, 4, 65, {"topk=65"});
  EXPECT_THROW(generate(plain, 64, 4, 4, 1, 8), ConfigError);  // rank outside [0, world)
  std::vector<int64_t> idx(7);
  std::vector<float> weights(8);
  EXPECT_THROW(generate_routing(plain, 64, 4, 0, 1, 8, idx, weights), ConfigError);  // short output
}

TEST(Routing, NamesRoundTrip) {
  for (RoutingKind kind : {RoutingKind::random, RoutingKind::ring, RoutingKind::grouped, RoutingKind::hot})
    EXPECT_EQ(parse_routing(routing_name(kind)), kind);
  try {
    parse_routing("zipf");
    ADD_FAILURE() << "no ConfigError";
  } catch (ConfigError const& error) {
    EXPECT_NE(std::string(error.what()).find("zipf"), std::string::npos) << error.what();
  }
}

TEST(Tokens, FiniteStandardAndDeterministic) {
  std::vector<uint16_t> const a = generate_tokens(5, 0, 64, 512);
  ASSERT_EQ(a.size(), 64u * 512u);
  double sum = 0.0;
  double sum_sq = 0.0;
  for (uint16_t bits : a) {
    float const value = ref::bf16_to_float(bits);
    ASSERT_TRUE(std::isfinite(value));
    ASSERT_LT(std::fabs(value), 3.5f);
    sum += value;
    sum_sq += static_cast<double>(value) * value;
  }
  double const mean = sum / a.size();
  double const variance = sum_sq / a.size() - mean * mean;
  EXPECT_NEAR(mean, 0.0, 0.02);
  EXPECT_NEAR(variance, 1.0, 0.03);
  EXPECT_EQ(a, generate_tokens(5, 0, 64, 512));
  EXPECT_NE(a, generate_tokens(5, 1, 64, 512));
  EXPECT_NE(a, generate_tokens(6, 0, 64, 512));
  EXPECT_TRUE(generate_tokens(5, 0, 0, 512).empty());
}

}  // namespace
}  // namespace ferry
