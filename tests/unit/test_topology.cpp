// The world's topology (Topology in include/ferry/communicator.hpp): parsing, the split from LOCAL_WORLD_SIZE or
// FERRY_TOPOLOGY, worlds far past one node (256 ranks), the cpu communicator's load/store reachability over emulated
// nodes, and the refusal of an EpBuffer that spans nodes (the inter-node protocols are not built), on every rank.
#include <gtest/gtest.h>

#include <string>

#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/cpu_ranks.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

std::string config_error(std::string const& forced, int world, int local_world) {
  try {
    topology_of(world, local_world, forced);
  } catch (ConfigError const& error) {
    return error.what();
  }
  return "";
}

TEST(Topology, ParsesNodesByRanks) {
  Topology const t = parse_topology("32x8");
  EXPECT_EQ(t.nodes, 32);
  EXPECT_EQ(t.local, 8);
  EXPECT_EQ(t.world(), 256);
  EXPECT_EQ(t.node_of(255), 31);
  EXPECT_EQ(t.local_of(255), 7);
  EXPECT_EQ(t.node_of(8), 1);
  EXPECT_TRUE(t.same_node(8, 15));
  EXPECT_FALSE(t.same_node(7, 8));
  EXPECT_EQ(topology_name(t), "32x8");
  for (char const* bad : {"8", "2x", "x8", "0x8", "2x0", "2x8x", "ax8", "2*8", "2 x 8", ""}) {
    try {
      parse_topology(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (ConfigError const& error) {
      EXPECT_NE(std::string(error.what()).find(std::string("topology '") + bad + "'"), std::string::npos)
          << error.what();
    }
  }
}

TEST(Topology, FromTheLocalWorldOrForced) {
  Topology const from_env = topology_of(256, 8, "");
  EXPECT_EQ(from_env.nodes, 32);
  EXPECT_EQ(from_env.local, 8);
  Topology const forced = topology_of(8, 8, "2x4");
  EXPECT_EQ(forced.nodes, 2);
  EXPECT_EQ(forced.local, 4);
  EXPECT_NE(config_error("", 12, 8).find("does not split into whole nodes"), std::string::npos);
  EXPECT_NE(config_error("2x4", 6, 6).find("FERRY_TOPOLOGY=2x4 has 8 ranks but the world has 6"), std::string::npos);
  EXPECT_EQ(config_error("3x2", 6, 6), "");
}

TEST(Topology, CpuCommunicatorReachesItsEmulatedNodeByLoadStore) {
  ScopedEnv const topology("FERRY_TOPOLOGY", std::string("2x2"));
  auto const failures = run_cpu_ranks(4, [](int rank, std::shared_ptr<Communicator> const& comm) {
    EXPECT_EQ(comm->topology().nodes, 2);
    for (int peer = 0; peer < 4; ++peer)
      EXPECT_EQ(comm->load_store_reachable(peer), peer / 2 == rank / 2) << "rank " << rank << " peer " << peer;
  });
  for (auto const& failure : failures) EXPECT_EQ(failure, "");
}

// Normal mode across emulated nodes runs the hierarchical protocol (tests/unit/test_internode_cpu.cpp checks its
// results); explain() says so.
TEST(Topology, EpBufferAcrossNodesRunsHierarchical) {
  ScopedEnv const topology("FERRY_TOPOLOGY", std::string("2x2"));
  auto const failures = run_cpu_ranks(4, [](int, std::shared_ptr<Communicator> const& comm) {
    EpConfig config;
    config.hidden = 64;
    config.num_experts = 8;
    config.topk = 2;
    config.max_tokens_per_rank = 4;
    EpBuffer buffer(comm, config);
    DispatchArgs args;
    buffer.dispatch(args);
    FERRY_CHECK(buffer.explain().find("hierarchical 2x2") != std::string::npos, buffer.explain());
  });
  for (auto const& failure : failures) EXPECT_EQ(failure, "");
}

}  // namespace
}  // namespace ferry::test
