// The world's topology (Topology in include/ferry/communicator.hpp): parsing, the split from LOCAL_WORLD_SIZE or
// FERRY_TOPOLOGY, worlds far past one node (1024 ranks), the cpu communicator's load/store reachability over emulated
// nodes, and the refusal of an EpBuffer that spans nodes (the inter-node protocols are not built), on every rank.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <utility>

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
  for (char const* bad : {"8", "2x", "x8", "0x8", "2x0", "2x8x", "ax8", "2*8", "2 x 8", "", "129x8", "1x1025"}) {
    try {
      parse_topology(bad);
      ADD_FAILURE() << "'" << bad << "' accepted";
    } catch (ConfigError const& error) {
      EXPECT_NE(std::string(error.what()).find(std::string("topology '") + bad + "'"), std::string::npos)
          << error.what();
    }
  }
}

// A world has at most kMaxWorld ranks: one more is refused naming the text, its ranks and the bound.
TEST(Topology, WorldsPastTheBoundAreRefused) {
  EXPECT_EQ(parse_topology("1x1024").world(), 1024);
  EXPECT_EQ(parse_topology("128x8").world(), 1024);
  for (auto [text, ranks] : {std::pair{"129x8", "1032"}, std::pair{"1x1025", "1025"}, std::pair{"1025x1", "1025"}}) {
    try {
      parse_topology(text);
      ADD_FAILURE() << text << " accepted";
    } catch (ConfigError const& error) {
      std::string const message = error.what();
      EXPECT_NE(message.find(std::string("topology '") + text + "' has " + ranks + " ranks"), std::string::npos)
          << message;
      EXPECT_NE(message.find("at most 1024 (kMaxWorld"), std::string::npos) << message;
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

// A world past 32 ranks (5 emulated nodes of 8): each rank's load/store team is its node, the kernels' view holds
// pointers for that team only (lsa_first, lsa_size), and the region gives every rank's copy (the cpu backend
// emulates the network through them); a word each rank writes into every copy is read back by its owner.
TEST(Topology, CpuCommunicatorPastThirtyTwoRanks) {
  int const world = 40;
  CommunicatorOptions options{Backend::cpu};
  options.topology = "5x8";
  auto const failures = run_cpu_ranks(
      world,
      [world](int rank, std::shared_ptr<Communicator> const& comm) {
        FERRY_CHECK(comm->world() == world && comm->topology().nodes == 5, "world/topology");
        for (int peer = 0; peer < world; ++peer)
          FERRY_CHECK(comm->load_store_reachable(peer) == (peer / 8 == rank / 8), "rank ", rank, " peer ", peer);
        SymmetricRegion const region = comm->alloc_symmetric(world * sizeof(int64_t));
        FERRY_CHECK(region.view.lsa_first == rank / 8 * 8 && region.view.lsa_size == 8, "rank ", rank, ": team [",
                    region.view.lsa_first, ", +", region.view.lsa_size, ")");
        FERRY_CHECK(region.ranks.size() == static_cast<std::size_t>(world), "ranks of the region");
        for (int peer = 0; peer < world; ++peer) {
          bool const team = peer / 8 == rank / 8;
          FERRY_CHECK(region.view.peer(peer) == (team ? region.of(peer) : nullptr), "rank ", rank, ": view of ", peer);
          reinterpret_cast<int64_t*>(region.of(peer))[rank] = int64_t{rank} * 1000 + peer;
        }
        comm->barrier();
        for (int peer = 0; peer < world; ++peer) {
          int64_t const seen = static_cast<int64_t const*>(region.local)[peer];
          FERRY_CHECK(seen == int64_t{peer} * 1000 + rank, "rank ", rank, ": slot ", peer, " holds ", seen);
        }
        comm->barrier();
      },
      options);
  for (std::size_t r = 0; r < failures.size(); ++r) EXPECT_EQ(failures[r], "") << "rank " << r;
}

// The cpu communicator refuses, before any collective step, a world past kMaxWorld and a node past the load/store
// team bound (kMaxLsaTeam), naming the value, the bound and what to do.
TEST(Topology, CpuCommunicatorRefusesPastItsBounds) {
  auto const refusal = [](int world, std::string const& topology) -> std::string {
    auto bootstraps = make_local_bootstraps(world, std::chrono::seconds(5));
    CommunicatorOptions options{Backend::cpu};
    options.topology = topology;
    try {
      Communicator::create(std::move(bootstraps.front()), options);  // rank 0 alone: it throws before any exchange
    } catch (ConfigError const& error) {
      return error.what();
    }
    return "";
  };
  std::string const world = refusal(kMaxWorld + 1, "");
  EXPECT_NE(world.find("world=1025 is outside [1, 1024] (kMaxWorld)"), std::string::npos) << world;
  std::string const node = refusal(40, "");
  EXPECT_NE(node.find("topology 1x40: a node of 40 ranks is more than the 32 ranks of one load/store team"),
            std::string::npos)
      << node;
  EXPECT_NE(node.find("FERRY_TOPOLOGY=2x20"), std::string::npos) << node;
  std::string const forced = refusal(33, "1x33");
  EXPECT_NE(forced.find("a node of 33 ranks"), std::string::npos) << forced;
  EXPECT_NE(forced.find("FERRY_TOPOLOGY=3x11"), std::string::npos) << forced;
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
