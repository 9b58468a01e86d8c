// `ferry bench` on the cpu backend (tools/ferry/bench.cpp): every mode, routing and wire format at several world sizes,
// every leg checked against the reference, the --json result file, and bad use of `ferry bench` and `ferry tune`
// refused by the launching process before any rank starts. The cuda legs and the NCCL baseline run in
// scripts/device-check.sh; `ferry tune`'s sweep in test_tuning.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

// These tests start ferry as the launching process (it starts its own ranks), whatever this process's RANK.
class BenchCli : public testing::Test {
  ScopedEnv rank_{"RANK", std::nullopt};
};
using TuneOptions = BenchCli;

int count(std::string const& text, std::string const& part) {
  int n = 0;
  for (std::size_t at = text.find(part); at != std::string::npos; at = text.find(part, at + part.size())) ++n;
  return n;
}

// Both modes, two routings, two token counts and two format pairs: 2 legs each, every one checked (exact for bf16,
// the codec's tolerance otherwise). --seed 0: a fresh seed each run, printed in the first line of the output.
TEST_F(BenchCli, EveryLegPassesTheCheckAtWorlds2And8) {
  for (int world : {2, 8}) {
    TempDir const dir;
    std::string const json = dir.file("bench.json");
    CliRun const run = run_ferry("bench --backend cpu --nproc " + std::to_string(world) +
                                 " --tokens 16,64 --hidden 256 --mode both --routing random,grouped"
                                 " --dispatch bf16,fp8 --combine bf16,fp8 --check --iters 2 --warmup 1 --seed 0"
                                 " --json " +
                                 json);
    ASSERT_EQ(run.code, 0) << run.output;
    int const legs = 2 /*modes*/ * 2 /*routings*/ * 2 /*tokens*/ * 2 /*format pairs*/ * 2 /*legs*/;
    EXPECT_TRUE(contains(run.output, "ferry bench: " + std::to_string(world) + " ranks, backend cpu")) << run.output;
    EXPECT_EQ(count(run.output, "world " + std::to_string(world) + "  cpu"), legs / 2) << run.output;
    EXPECT_EQ(count(run.output, "PASS\n"), legs) << run.output;
    EXPECT_EQ(count(run.output, "FAIL"), 0) << run.output;
    std::string const records = read_file(json);
    EXPECT_TRUE(contains(records, "\"tool\": \"ferry bench\"")) << records;
    EXPECT_TRUE(contains(records, "\"world\": " + std::to_string(world))) << records;
    EXPECT_EQ(count(records, "\"check\": \"pass\""), legs) << records;
    EXPECT_EQ(count(records, "\"mode\": \"ll\""), legs / 2) << records;
    EXPECT_EQ(count(records, "\"routing\": \"grouped\""), legs / 2) << records;
    // the pair of formats of each record's run, and its combine layout (LL's is expert-major)
    EXPECT_EQ(count(records, "\"dispatch_format\": \"fp8\", \"combine_format\": \"fp8\""), legs / 2) << records;
    EXPECT_EQ(count(records, "\"layout\": \"expert\""), legs / 2) << records;
  }
}

// The expert-major combine input of normal mode, a hot expert and the fp4 formats, at world 4 (the cpu default).
TEST_F(BenchCli, ExpertMajorLayoutHotRoutingAndFp4FormatsPass) {
  CliRun const run = run_ferry(
      "bench --backend cpu --tokens 48 --hidden 512 --layout expert --routing hot,ring --mask-rate 0.1"
      " --dispatch nvfp4,mxfp4 --combine nvfp4,mxfp4 --check --iters 1 --warmup 0 --seed 0");
  ASSERT_EQ(run.code, 0) << run.output;
  EXPECT_TRUE(contains(run.output, "ferry bench: 4 ranks, backend cpu")) << run.output;
  EXPECT_EQ(count(run.output, "layout expert"), 4) << run.output;
  EXPECT_EQ(count(run.output, "PASS\n"), 8) << run.output;
  EXPECT_EQ(count(run.output, "FAIL"), 0) << run.output;
}

// --backward: the four legs of each shape (forward dispatch and combine, dispatch_backward, combine_backward), every
// one checked against the reference, in both combine layouts (expert: the weight gradients too), and each backward
// leg's ratio to the forward leg of the same bytes in the table and in --json.
TEST_F(BenchCli, BackwardLegsPassTheCheckInBothLayouts) {
  for (char const* layout : {"rank", "expert"}) {
    TempDir const dir;
    std::string const json = dir.file("bench.json");
    CliRun const run = run_ferry(std::string("bench --backend cpu --nproc 2 --tokens 16,40 --hidden 256 --backward") +
                                 " --layout " + layout + " --check --iters 2 --warmup 1 --seed 0 --json " + json);
    ASSERT_EQ(run.code, 0) << run.output;
    EXPECT_EQ(count(run.output, "PASS"), 2 /*tokens*/ * 4 /*legs*/) << run.output;
    EXPECT_EQ(count(run.output, "FAIL"), 0) << run.output;
    EXPECT_EQ(count(run.output, "dispatch_backward / combine"), 2) << run.output;
    std::string const records = read_file(json);
    EXPECT_EQ(count(records, "\"leg\": \"dispatch_backward\""), 2) << records;
    EXPECT_EQ(count(records, "\"leg\": \"combine_backward\""), 2) << records;
    EXPECT_EQ(count(records, "\"backward_over_forward\""), 4) << records;
    EXPECT_EQ(count(records, "\"check\": \"pass\""), 8) << records;
  }
}

struct Refusal {
  char const* args;
  char const* says;
};

// A run that cannot go is refused once, by the launching process (exit 2, one line naming the option), not once per
// rank after the ranks started.
void expect_refused_once(Refusal const& c) {
  CliRun const run = run_ferry(c.args);
  EXPECT_EQ(run.code, 2) << c.args << "\n" << run.output;
  EXPECT_EQ(count(run.output, c.says), 1) << c.args << ": '" << c.says << "' not once in:\n" << run.output;
  EXPECT_FALSE(contains(run.output, "rank 0")) << c.args << ": a rank started:\n" << run.output;
}

// --topology across emulated nodes: the hierarchical legs pass the check, and the network bytes each rank sent equal
// ferry model's count from the same routing (random and grouped), labelled as emulated in the table and the records.
TEST_F(BenchCli, TopologyAcrossNodesCountsTheNetworkBytes) {
  TempDir const dir;
  std::string const json = dir.file("bench.json");
  CliRun const run = run_ferry(
      "bench --backend cpu --topology 2x4 --tokens 16 --hidden 256 --routing random,grouped --layout expert"
      " --dispatch bf16,fp8 --combine bf16,nvfp4 --check --iters 2 --warmup 1 --json " +
      json);
  ASSERT_EQ(run.code, 0) << run.output;
  int const legs = 2 /*routings*/ * 2 /*format pairs*/ * 2 /*legs*/;
  EXPECT_TRUE(contains(run.output, "8 ranks, backend cpu")) << run.output;
  EXPECT_TRUE(contains(run.output, "topology 2x4 (emulated nodes on one host")) << run.output;
  EXPECT_EQ(count(run.output, "PASS\n"), legs) << run.output;
  EXPECT_EQ(count(run.output, ", equal), NVLink"), legs) << run.output;
  EXPECT_EQ(count(run.output, "DIFFERENT"), 0) << run.output;
  std::string const records = read_file(json);
  EXPECT_EQ(count(records, "\"network\": \"emulated\""), legs) << records;
  EXPECT_EQ(count(records, "\"topology\": \"2x4\""), legs) << records;
}

// Low-latency mode across emulated nodes, both routes: every leg checked against the reference of its route (the
// direct route's combine is one node's, the forward route's the topology's), the network bytes equal to ferry model's
// count of the route that ran (the direct route sends more), and the route in the table and the records.
TEST_F(BenchCli, TopologyAcrossNodesRunsLowLatencyOnEveryRoute) {
  TempDir const dir;
  std::string const json = dir.file("bench.json");
  CliRun const run = run_ferry(
      "bench --backend cpu --topology 2x2 --mode ll --route forward,direct --tokens 1,8 --hidden 256"
      " --routing random --dispatch bf16,fp8 --combine bf16,fp8 --check --iters 2 --warmup 1 --json " +
      json);
  ASSERT_EQ(run.code, 0) << run.output;
  int const legs = 2 /*sizes*/ * 2 /*format pairs*/ * 2 /*routes*/ * 2 /*legs*/;
  EXPECT_EQ(count(run.output, "PASS\n"), legs) << run.output;
  EXPECT_EQ(count(run.output, ", equal), NVLink"), legs) << run.output;
  EXPECT_EQ(count(run.output, "DIFFERENT"), 0) << run.output;
  EXPECT_EQ(count(run.output, "route forward  cpu"), legs / 4) << run.output;
  EXPECT_EQ(count(run.output, "route direct  cpu"), legs / 4) << run.output;
  std::string const records = read_file(json);
  EXPECT_EQ(count(records, "\"route\": \"forward\""), legs / 2) << records;
  EXPECT_EQ(count(records, "\"route\": \"direct\""), legs / 2) << records;
}

TEST_F(BenchCli, BadUseIsRefusedOnceBeforeAnyRankStarts) {
  for (Refusal const& c : {
           Refusal{"bench --backend cpu --nproc 8 --baseline nccl", "--baseline nccl needs the cuda backend"},
           Refusal{"bench --backend cpu --baseline mpi", "--baseline=mpi is unknown; use nccl"},
           Refusal{"bench --backend cpu --graph", "--graph needs the cuda backend"},
           Refusal{"bench --backend cpu --layout column", "--layout=column is unknown; use rank or expert"},
           Refusal{"bench --backend cpu --nproc 3", "256"},
           Refusal{"bench --backend cpu --nproc -2", "--nproc=-2 must be 0"},
           Refusal{"bench --backend cpu --dispatch int8", "int8"},
           Refusal{"bench --backend cpu --mode fast", "fast"},
           Refusal{"bench --backend cpu --iters 0", "--iters=0 must be at least 1"},
           Refusal{"bench --backend cpu --warmup -1", "--warmup=-1 must be 0 or more"},
           Refusal{"bench --backend cpu --graph-calls 0", "--graph-calls=0 must be at least 1"},
           Refusal{"bench --backend cpu --layout expert --expert-capacity -3", "--expert-capacity=-3"},
           Refusal{"bench --backend cpu --dispatch-blocks -1", "--dispatch-blocks=-1"},
           Refusal{"bench --backend cpu --mode ll --tokens 8 --combine-blocks 4",
                   "--combine-blocks=4 does nothing with --mode ll"},
           Refusal{"bench --backend cpu --mode ll --tokens 8 --backward",
                   "--backward times the training passes, which only mode=normal has"},
           Refusal{"bench --backend cpu --mode both --backward", "use --mode normal (got --mode both)"},
           Refusal{"bench --backend cpu --topology 2x2 --route direct", "normal mode always forwards"},
           Refusal{"bench --backend cpu --mode ll --route forward", "it needs a --topology of 2 nodes or more"},
           Refusal{"bench --backend cpu --topology 2x2 --mode ll --route sideways", "internode_route 'sideways'"},
           Refusal{"bench --backend cpu --backward --combine fp8", "--backward times bf16 legs"},
       })
    expect_refused_once(c);
}

// An unwritable --json is refused before any rank starts (it was reported only after the whole run, the rows of the
// table printed: this test failed so), and the check leaves no file behind.
TEST_F(BenchCli, UnwritableJsonIsRefusedBeforeAnyRankStarts) {
  TempDir const dir;
  std::string const missing_folder = dir.file("no-such-folder/bench.json");
  expect_refused_once({("bench --backend cpu --tokens 16 --hidden 256 --iters 1 --json " + missing_folder).c_str(),
                       ("--json " + missing_folder + " cannot be written").c_str()});
  std::string const fresh = dir.file("fresh.json");
  CliRun const refused = run_ferry("bench --backend cpu --nproc 3 --json " + fresh);  // refused after the json check
  EXPECT_EQ(refused.code, 2) << refused.output;
  EXPECT_FALSE(std::filesystem::exists(fresh)) << "the check left " << fresh << " behind";
}

TEST_F(TuneOptions, BadUseIsRefusedOnceBeforeAnyRankStarts) {
  TempDir const dir;  // a table the cpu backend may name (none is written)
  std::string const table = " --table " + dir.file("t.json");
  for (Refusal const& c : {
           Refusal{"--nproc 4 --graph on", "--graph on needs the cuda backend"},
           Refusal{"--graph maybe", "--graph=maybe is unknown"},
           Refusal{"--tolerance -1", "--tolerance=-1 must be in [0, 1)"},
           Refusal{"--verify-tolerance -0.5", "--verify-tolerance=-0.5 must be 0 or more"},
           Refusal{"--rounds 0", "--rounds and --iters must be at least 1"},
           Refusal{"--graph-calls 0", "--graph-calls=0 must be at least 1"},
           Refusal{"--blocks 0,4", "--blocks=0,4 must list positive values"},
           Refusal{"--blocks 4,4", "--blocks=4,4 repeats a value"},
           Refusal{"--warps 16", "unknown option --warps"},  // warps are not a setting: refused, not ignored
           Refusal{"--nproc -1", "--nproc=-1 must be 0"},
       }) {
    std::string const args = std::string("tune --backend cpu ") + c.args + table;
    expect_refused_once({args.c_str(), c.says});
  }
}

}  // namespace
}  // namespace ferry::test
