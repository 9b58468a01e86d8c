// The host logic the multi-GPU tests share (tests/support/gpu_case.hpp): the world they run at and the per-rank lists
// of their matrices. Host-only: it runs in CI, where the GPU tests themselves skip.
#include <gtest/gtest.h>

#include <cstdlib>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "support/gpu_case.hpp"

namespace ferry::test {
namespace {

// Sets FERRY_TEST_WORLD for one scope and restores what was there.
class WorldEnv {
 public:
  explicit WorldEnv(char const* value) {
    if (char const* old = std::getenv("FERRY_TEST_WORLD")) old_ = old;
    if (value)
      ::setenv("FERRY_TEST_WORLD", value, 1);
    else
      ::unsetenv("FERRY_TEST_WORLD");
  }
  ~WorldEnv() {
    if (old_)
      ::setenv("FERRY_TEST_WORLD", old_->c_str(), 1);
    else
      ::unsetenv("FERRY_TEST_WORLD");
  }

 private:
  std::optional<std::string> old_;
};

TEST(GpuCaseSupport, WorldDefaultsToTwoAndReadsTheEnvironment) {
  {
    WorldEnv const env(nullptr);
    EXPECT_EQ(gpu_test_world(), 2);
  }
  {
    WorldEnv const env("");
    EXPECT_EQ(gpu_test_world(), 2);
  }
  for (int world = 1; world <= 8; ++world) {
    WorldEnv const env(std::to_string(world).c_str());
    EXPECT_EQ(gpu_test_world(), world);
    EXPECT_EQ(peer_case_world(), world < 2 ? 2 : world);  // a case with a missing rank needs a second one
  }
}

TEST(GpuCaseSupport, BadWorldIsRefusedNamingTheValue) {
  for (char const* bad : {"9", "0", "-2", "4x", "x", "2.5"}) {
    WorldEnv const env(bad);
    try {
      gpu_test_world();
      ADD_FAILURE() << "FERRY_TEST_WORLD=" << bad << " was accepted";
    } catch (std::invalid_argument const& error) {
      EXPECT_NE(std::string(error.what()).find(std::string("FERRY_TEST_WORLD=") + bad), std::string::npos)
          << error.what();
    }
  }
}

TEST(GpuCaseSupport, PerRankListsRepeatOverTheRanks) {
  EXPECT_EQ(per_rank({100, 37}, 2), (std::vector<int>{100, 37}));  // world 2: the list as written
  EXPECT_EQ(per_rank({100, 37}, 5), (std::vector<int>{100, 37, 100, 37, 100}));
  EXPECT_EQ(per_rank({0, 64}, 8), (std::vector<int>{0, 64, 0, 64, 0, 64, 0, 64}));  // zero-token ranks stay
  EXPECT_EQ(per_rank({7}, 3), (std::vector<int>{7, 7, 7}));
  EXPECT_EQ(per_rank({1, 2, 3}, 2), (std::vector<int>{1, 2}));
  EXPECT_EQ(per_rank({}, 3), (std::vector<int>{0, 0, 0}));
}

TEST(GpuCaseSupport, CaseShapeReadsItsKeysAndLeavesTheRestAlone) {
  CaseShape shape;
  shape.read(CaseArgs({"routing=grouped", "tokens=100,37", "hidden=7168", "topk=6", "experts=256", "mask=0.25",
                       "iters=3", "graph=1", "seed=99", "capacity=5"}));
  EXPECT_EQ(shape.routing, "grouped");
  EXPECT_EQ(shape.tokens, (std::vector<int>{100, 37}));
  EXPECT_EQ(shape.hidden, 7168);
  EXPECT_EQ(shape.topk, 6);
  EXPECT_EQ(shape.experts, 256);
  EXPECT_EQ(shape.mask_rate, 0.25);
  EXPECT_EQ(shape.iters, 3);
  EXPECT_TRUE(shape.graph);
  EXPECT_EQ(shape.seed, 99u);
  EXPECT_EQ(shape.most_tokens(), 100);

  EpConfig const config = shape.config();
  EXPECT_EQ(config.hidden, 7168);
  EXPECT_EQ(config.topk, 6);
  EXPECT_EQ(config.num_experts, 256);
  EXPECT_EQ(config.max_tokens_per_rank, 100);

  // every iteration its own routing seed, the kind and mask rate as read
  RoutingOptions const first = shape.routing_options(0);
  RoutingOptions const second = shape.routing_options(1);
  EXPECT_EQ(first.kind, RoutingKind::grouped);
  EXPECT_EQ(first.mask_rate, 0.25);
  EXPECT_EQ(first.seed, 99u);
  EXPECT_NE(second.seed, first.seed);

  CaseShape defaults;
  defaults.read(CaseArgs({"tokens=0,0"}));  // zero-token ranks still get buffers of one token
  EXPECT_EQ(defaults.most_tokens(), 1);
  EXPECT_EQ(defaults.routing_options(0).kind, RoutingKind::random);
  EXPECT_FALSE(defaults.graph);
}

}  // namespace
}  // namespace ferry::test
