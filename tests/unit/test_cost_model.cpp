// The cost model of `ferry model` (workloads/cost_model.hpp): traffic counted from the routing, checked against counts
// worked out by hand for ring routing, against the topologies whose answer is known (one node: nothing on the
// network; one rank per node: nothing forwarded), against the averages of random routing, and the time arithmetic.
#include <gtest/gtest.h>

#include <cmath>
#include <string>

#include "core/util/json.hpp"
#include "ferry/error.hpp"
#include "ferry/wire_format.hpp"
#include "support/host_fixtures.hpp"
#include "workloads/cost_model.hpp"

namespace ferry::model {
namespace {

EpConfig shape(int experts, int topk) {
  EpConfig config;
  config.hidden = 7168;
  config.num_experts = experts;
  config.topk = topk;
  return config;
}

// 2 nodes x 2 ranks, ring routing with topk 2: rank r's tokens go to ranks r+1 and r+2 (mod 4). Worked out by hand:
// hierarchical, every rank sends one row a token over the network and one over NVLink (its own node's rank, or a
// forward as the rail of another node's token), in both legs; direct, ranks 1 and 3 send two network rows a token
// (both destinations on the other node), ranks 0 and 2 one network and one NVLink row.
TEST(CostModel, RingRoutingOnTwoByTwoMatchesTheCountsWorkedOutByHand) {
  RoutingOptions routing;
  routing.kind = RoutingKind::ring;
  EpConfig const config = shape(8, 2);
  int const tokens = 64;
  Traffic const t = count_traffic(config, {2, 2}, routing, tokens);
  double const drow = static_cast<double>(wire_row_bytes(WireFormat::bf16, 7168) + 2 * 8 + 8);
  double const crow = static_cast<double>(wire_row_bytes(WireFormat::bf16, 7168));
  EXPECT_EQ(t.dispatch_row_bytes, static_cast<std::size_t>(drow));
  EXPECT_DOUBLE_EQ(t.dest_ranks_per_token, 2.0);
  EXPECT_DOUBLE_EQ(t.remote_nodes_per_token, 1.0);
  EXPECT_DOUBLE_EQ(t.remote_ranks_per_token, 1.5);
  EXPECT_DOUBLE_EQ(t.hier_dispatch.network_bytes_max, tokens * drow);
  EXPECT_DOUBLE_EQ(t.hier_dispatch.network_bytes_mean, tokens * drow);
  EXPECT_DOUBLE_EQ(t.hier_dispatch.nvlink_bytes_max, tokens * drow);
  EXPECT_DOUBLE_EQ(t.hier_dispatch.nvlink_bytes_mean, tokens * drow);
  EXPECT_DOUBLE_EQ(t.hier_combine.network_bytes_max, tokens * crow);
  EXPECT_DOUBLE_EQ(t.hier_combine.nvlink_bytes_mean, tokens * crow);
  EXPECT_DOUBLE_EQ(t.hier_dispatch.network_messages_max, tokens);
  EXPECT_DOUBLE_EQ(t.direct_dispatch.network_bytes_max, 2 * tokens * drow);
  EXPECT_DOUBLE_EQ(t.direct_dispatch.network_bytes_mean, 1.5 * tokens * drow);
  EXPECT_DOUBLE_EQ(t.direct_dispatch.nvlink_bytes_max, tokens * drow);
  EXPECT_DOUBLE_EQ(t.direct_dispatch.nvlink_bytes_mean, 0.5 * tokens * drow);
  EXPECT_DOUBLE_EQ(t.direct_combine.network_bytes_mean, 1.5 * tokens * crow);
}

// The cuda low-latency protocol on the same ring at 2x2: every rank sends its record of every token to both ranks of
// the other node (2 messages a token) and its row to the 1 or 2 of them that hold the token (rank 0: rank 2; rank 1:
// ranks 2 and 3), plus per CTA of the grid and remote rank a signal (and CTA 0's token count); the combine sends a
// row back per received row of a remote source. Its messages enter the time at Links::nic_mmsgs.
TEST(CostModel, LowLatencyProtocolCountsItsRecordsRowsAndSignals) {
  RoutingOptions routing;
  routing.kind = RoutingKind::ring;
  EpConfig const config = shape(8, 2);
  int const tokens = 64;
  int const ctas = 10;
  Traffic const t = count_traffic(config, {2, 2}, routing, tokens, ctas);
  double const row = static_cast<double>(wire_row_bytes(WireFormat::bf16, 7168));
  double const record = 16;  // 2 ids + 2 weights, 16-byte aligned
  // rank 1 (to ranks 2, 3) and rank 3 (to 0, 1): two rows and two records a token over the network
  EXPECT_DOUBLE_EQ(t.ll_dispatch.network_bytes_max, tokens * (2 * row + 2 * record));
  EXPECT_DOUBLE_EQ(t.ll_dispatch.network_bytes_mean, tokens * (1.5 * row + 2 * record));
  EXPECT_DOUBLE_EQ(t.ll_dispatch.network_messages_max, tokens * 4.0);
  EXPECT_DOUBLE_EQ(t.ll_dispatch.network_rows_mean, tokens * 1.5);
  // over NVLink: the record to the own node's other rank, and the row when that rank holds the token (ranks 0, 2)
  EXPECT_DOUBLE_EQ(t.ll_dispatch.nvlink_bytes_max, tokens * (row + record));
  EXPECT_DOUBLE_EQ(t.ll_dispatch.control_messages, 2.0 * (ctas + 1));
  EXPECT_DOUBLE_EQ(t.ll_combine.network_messages_max, tokens * 2.0);
  EXPECT_DOUBLE_EQ(t.ll_combine.control_messages, 2.0 * ctas);
  // the forward route: every rank's token hits the other node, so a record and the row go to its rail once, and one
  // row comes back from it; one signal per CTA (and the count) to the one remote node
  EXPECT_DOUBLE_EQ(t.ll_fwd_dispatch.network_bytes_max, tokens * (row + record));
  EXPECT_DOUBLE_EQ(t.ll_fwd_dispatch.network_messages_max, tokens * 2.0);
  EXPECT_DOUBLE_EQ(t.ll_fwd_dispatch.control_messages, ctas + 1.0);
  EXPECT_DOUBLE_EQ(t.ll_fwd_combine.network_bytes_max, tokens * row);
  EXPECT_DOUBLE_EQ(t.ll_fwd_combine.network_messages_max, tokens * 1.0);
  EXPECT_DOUBLE_EQ(t.ll_fwd_combine.control_messages, 1.0 * ctas);
  EXPECT_LT(t.ll_fwd_dispatch.network_bytes_max, t.ll_dispatch.network_bytes_max);
  // 1e6 messages at 200 per us take 5000 us, more than their bytes at 50 GB/s
  Traffic many;
  many.ll_dispatch.network_bytes_max = 50e6;  // 1000 us
  many.ll_dispatch.network_messages_max = 1e6 - 2;
  many.ll_dispatch.control_messages = 2;
  Links const links;
  Prediction const p = predict(many, links);
  EXPECT_NEAR(p.ll_dispatch.us, links.ll_fixed_us + links.nic_latency_us + 1e6 / links.nic_mmsgs, 1e-6);
  EXPECT_EQ(p.ll_dispatch.bound, "network");
}

TEST(CostModel, OneNodeSendsNothingOverTheNetworkAndOneRankPerNodeForwardsNothing) {
  RoutingOptions routing;  // random
  routing.seed = 7;
  EpConfig const config = shape(256, 8);
  Traffic const one_node = count_traffic(config, {1, 8}, routing, 256);
  EXPECT_EQ(one_node.hier_dispatch.network_bytes_max, 0.0);
  EXPECT_EQ(one_node.direct_combine.network_bytes_max, 0.0);
  EXPECT_GT(one_node.hier_dispatch.nvlink_bytes_max, 0.0);
  EXPECT_DOUBLE_EQ(one_node.hier_dispatch.nvlink_bytes_mean, one_node.direct_dispatch.nvlink_bytes_mean)
      << "on one node hierarchical is direct";
  Traffic const one_per_node = count_traffic(config, {8, 1}, routing, 256);
  EXPECT_EQ(one_per_node.hier_dispatch.nvlink_bytes_max, 0.0);
  EXPECT_DOUBLE_EQ(one_per_node.hier_dispatch.network_bytes_mean, one_per_node.direct_dispatch.network_bytes_mean);
}

// Random routing: a token's network rows are its remote nodes (hierarchical) or remote ranks (direct), and the
// averages follow from the chance that a node (or rank) holds none of a token's 8 experts out of 256.
TEST(CostModel, RandomRoutingAveragesFollowTheDestinationProbabilities) {
  RoutingOptions routing;
  routing.seed = 11;
  EpConfig const config = shape(256, 8);
  int const tokens = 4096;
  Traffic const t = count_traffic(config, {2, 8}, routing, tokens);
  double const drow = static_cast<double>(t.dispatch_row_bytes);
  EXPECT_NEAR(t.hier_dispatch.network_bytes_mean, t.remote_nodes_per_token * tokens * drow, 1e-6 * drow * tokens);
  EXPECT_NEAR(t.direct_dispatch.network_bytes_mean, t.remote_ranks_per_token * tokens * drow, 1e-6 * drow * tokens);
  // P(a given 128-expert node is hit) = 1 - C(128, 8) / C(256, 8); P(a given 16-expert rank is hit) likewise
  auto const miss = [](int others, int total) {
    double p = 1;
    for (int i = 0; i < 8; ++i) p *= static_cast<double>(others - i) / (total - i);
    return p;
  };
  double const node_hit = 1 - miss(128, 256);
  double const rank_hit = 1 - miss(240, 256);
  EXPECT_NEAR(t.remote_nodes_per_token, node_hit, 0.02);
  EXPECT_NEAR(t.remote_ranks_per_token, 8 * rank_hit, 0.05);
  EXPECT_NEAR(t.dest_ranks_per_token, 16 * rank_hit, 0.08);
}

TEST(CostModel, PredictionsAddTheFixedCostTheHopsAndTheSlowerTransfer) {
  Traffic t;
  t.hier_dispatch.network_bytes_max = 50e6;  // 1000 us at 50 GB/s
  t.hier_dispatch.nvlink_bytes_max = 362e6;  // 1000 us at 362 GB/s
  t.direct_dispatch.network_bytes_max = 150e6;
  t.direct_combine.nvlink_bytes_max = 36.2e6;  // 100 us
  Links const links;
  Prediction const p = predict(t, links);
  double const hops = links.nic_latency_us + links.nvlink_latency_us;
  EXPECT_NEAR(p.hier_dispatch.us, links.normal_fixed_us + hops + 1000.0, 1e-9);
  EXPECT_NEAR(p.direct_dispatch.us, links.ll_fixed_us + links.nic_latency_us + 3000.0, 1e-9);
  EXPECT_EQ(p.direct_dispatch.bound, "network");
  EXPECT_NEAR(p.direct_combine.us, links.ll_fixed_us + links.nic_latency_us + 100.0, 1e-9);
  EXPECT_EQ(p.direct_combine.bound, "nvlink");
  EXPECT_NEAR(p.hier_dispatch.network_gbps, 50e6 / p.hier_dispatch.us / 1e3, 1e-9);
  EXPECT_NEAR(p.hier_dispatch.logical_network_gbps, 150e6 / p.hier_dispatch.us / 1e3, 1e-9);
  EXPECT_EQ(p.hier_combine.bound, "fixed cost");
}

// `ferry model`: the table and the result file, and a bad topology refused with the command's one-line error.
TEST(CostModel, FerryModelPrintsItsInputsAndWritesItsRecords) {
  test::TempDir dir;
  std::string const json = dir.file("model.json");
  test::CliRun const run = test::run_ferry("model --topology 2x8,4x8 --tokens 128 --dispatch fp8 --json " + json);
  ASSERT_EQ(run.code, 0) << run.output;
  EXPECT_TRUE(test::contains(run.output, "network 50.0 GB/s per GPU")) << run.output;
  EXPECT_TRUE(test::contains(run.output, "predictions, not measurements")) << run.output;
  util::json::Value const doc = util::json::parse(test::read_file(json), json);
  EXPECT_EQ(doc.find("tool")->text, "ferry model");
  util::json::Value const& records = *doc.find("records");
  ASSERT_EQ(records.items.size(), 22u)
      << "2 topologies x 1 token count x 5 protocols x 2 legs, then a memory record per topology and token count";
  EXPECT_EQ(records.items[0].find("dispatch_format")->text, "fp8");
  EXPECT_GT(records.items[0].find("predicted_us")->number, 0.0);
  EXPECT_EQ(records.items[9].find("world")->integer(), 16);
  EXPECT_EQ(records.items[10].find("world")->integer(), 32);
  util::json::Value const& memory = records.items[21];
  EXPECT_EQ(memory.find("protocol")->text, "memory");
  EXPECT_EQ(memory.find("world")->integer(), 32);
  EXPECT_GT(memory.find("normal_bytes")->number, 0.0);
  EXPECT_GT(memory.find("deepep_v2_bytes")->number, 0.0);
  EXPECT_TRUE(test::contains(run.output, "deepep-v2")) << run.output;

  test::CliRun const bad = test::run_ferry("model --topology 2by8");
  EXPECT_EQ(bad.code, 2) << bad.output;
  EXPECT_TRUE(test::contains(bad.output, "topology '2by8' is not of the form NxM")) << bad.output;
}

}  // namespace
}  // namespace ferry::model
