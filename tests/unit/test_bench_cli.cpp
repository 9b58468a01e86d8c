// `ferry bench` on the cpu backend (tools/ferry/bench.cpp): every mode, routing and wire format at several world sizes,
// every leg checked against the reference, the --json result file, and bad use of `ferry bench` and `ferry tune`
// refused by the launching process before any rank starts. The cuda legs and the NCCL baseline run in
// `scripts/gpu-check.sh bench`; `ferry tune`'s sweep in test_tuning.cpp.
#include <gtest/gtest.h>

#include <filesystem>
#include <string>

#include "core/util/json.hpp"
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

// The --json records field by field: which fields each kind of record has, in which order, and the values a cpu run
// fixes (the case's shape, formats, layout, route, check; the link bytes equal to ferry model's). Scripts and the
// A/B tables read these records, so a change of the bench's code must not change them silently. Checked to fail:
// with host_us written after the fields of a run across nodes, every record of the first run failed the order.
std::vector<std::string> keys_of(util::json::Value const& record) {
  std::vector<std::string> keys;
  for (auto const& member : record.members) keys.push_back(member.first);
  return keys;
}

std::string text_of(util::json::Value const& record, char const* key) {
  util::json::Value const* value = record.find(key);
  return value && value->is(util::json::Value::Kind::string) ? value->text : "(missing " + std::string(key) + ")";
}

double number_of(util::json::Value const& record, char const* key) {
  util::json::Value const* value = record.find(key);
  return value && value->is(util::json::Value::Kind::number) ? value->number : -1.0;
}

TEST_F(BenchCli, JsonRecordsKeepTheirFieldsOrderAndValues) {
  std::vector<std::string> const common = {
      "mode",        "leg",       "tokens",          "hidden",         "topk",        "experts",
      "routing",     "format",    "dispatch_format", "combine_format", "layout",      "graph",
      "graph_calls", "median_us", "p10_us",          "p90_us",         "nvlink_gbps", "logical_gbps",
      "check"};
  auto const with = [&](std::vector<std::string> keys, std::vector<std::string> const& more) {
    keys.insert(keys.end(), more.begin(), more.end());
    return keys;
  };
  std::vector<std::string> const across = {
      "topology",          "network", "route", "network_bytes", "nvlink_bytes", "network_gbps", "model_network_bytes",
      "model_nvlink_bytes"};
  std::vector<std::string> const error = {"error_over_bound", "rel_l2_error"};
  TempDir const dir;
  // 1. across emulated nodes, both modes, two format pairs, the host time: every field but the backward ratio
  std::string const json = dir.file("bench.json");
  CliRun const run = run_ferry(
      "bench --backend cpu --topology 2x2 --tokens 8 --hidden 256 --mode both --layout expert --dispatch bf16,fp8"
      " --combine bf16,fp8 --check --host-time --iters 2 --warmup 1 --seed 5 --json " +
      json);
  ASSERT_EQ(run.code, 0) << run.output;
  EXPECT_TRUE(contains(run.output,
                       "\nnormal  tokens 8/rank  hidden 256  topk 8  experts 256  routing random  layout "
                       "expert  world 4  route hierarchical  cpu  dispatch fp8 (row_major)  combine fp8\n"
                       "leg        median_us     p10_us     p90_us  nvlink_GB/s  logical_GB/s     nccl_us "
                       " speedup  check\n"))
      << run.output;
  util::json::Value const doc = util::json::parse(read_file(json), json);
  std::vector<std::string> header;
  for (auto const& member : doc.members) header.push_back(member.first);
  EXPECT_EQ(header, (std::vector<std::string>{"tool", "version", "commit", "date", "device", "world", "records"}));
  std::vector<util::json::Value> const& records = doc.find("records")->items;
  // the cases in order (mode, then the format pairs), dispatch before combine in each; low-latency mode's automatic
  // route forwards past 2 tokens per rank
  struct Want {
    char const* mode;
    char const* leg;
    char const* dispatch;
    char const* combine;
    char const* route;
  };
  std::vector<Want> const want = {{"normal", "dispatch", "bf16", "bf16", "hierarchical"},
                                  {"normal", "combine", "bf16", "bf16", "hierarchical"},
                                  {"normal", "dispatch", "fp8", "fp8", "hierarchical"},
                                  {"normal", "combine", "fp8", "fp8", "hierarchical"},
                                  {"ll", "dispatch", "bf16", "bf16", "forward"},
                                  {"ll", "combine", "bf16", "bf16", "forward"},
                                  {"ll", "dispatch", "fp8", "fp8", "forward"},
                                  {"ll", "combine", "fp8", "fp8", "forward"}};
  ASSERT_EQ(records.size(), want.size()) << read_file(json);
  for (std::size_t i = 0; i < want.size(); ++i) {
    util::json::Value const& r = records[i];
    bool const combine = std::string(want[i].leg) == "combine";
    bool const quantized_combine = combine && std::string(want[i].combine) != "bf16";
    std::vector<std::string> keys = with(common, quantized_combine ? error : std::vector<std::string>{});
    keys = with(keys, {"host_us"});
    EXPECT_EQ(keys_of(r), with(keys, across)) << "record " << i;
    EXPECT_EQ(text_of(r, "mode"), want[i].mode) << i;
    EXPECT_EQ(text_of(r, "leg"), want[i].leg) << i;
    EXPECT_EQ(text_of(r, "dispatch_format"), want[i].dispatch) << i;
    EXPECT_EQ(text_of(r, "combine_format"), want[i].combine) << i;
    EXPECT_EQ(text_of(r, "format"), combine ? want[i].combine : want[i].dispatch) << i;
    EXPECT_EQ(text_of(r, "route"), want[i].route) << i;
    EXPECT_EQ(text_of(r, "layout"), "expert") << i;
    EXPECT_EQ(text_of(r, "routing"), "random") << i;
    EXPECT_EQ(text_of(r, "check"), "pass") << i;
    EXPECT_EQ(text_of(r, "topology"), "2x2") << i;
    EXPECT_EQ(text_of(r, "network"), "emulated") << i;
    EXPECT_EQ(number_of(r, "tokens"), 8) << i;
    EXPECT_EQ(number_of(r, "hidden"), 256) << i;
    EXPECT_EQ(number_of(r, "topk"), 8) << i;
    EXPECT_EQ(number_of(r, "experts"), 256) << i;
    EXPECT_EQ(number_of(r, "graph_calls"), 1) << i;
    EXPECT_TRUE(r.find("graph") && r.find("graph")->is(util::json::Value::Kind::boolean) && !r.find("graph")->boolean);
    EXPECT_GT(number_of(r, "network_bytes"), 0) << i;
    EXPECT_EQ(number_of(r, "network_bytes"), number_of(r, "model_network_bytes")) << i;
    for (char const* key : {"median_us", "p10_us", "p90_us", "nvlink_gbps", "logical_gbps", "host_us"})
      EXPECT_GT(number_of(r, key), 0) << i << " " << key;
    EXPECT_LE(number_of(r, "p10_us"), number_of(r, "median_us")) << i;
    EXPECT_LE(number_of(r, "median_us"), number_of(r, "p90_us")) << i;
    if (quantized_combine) EXPECT_LE(number_of(r, "error_over_bound"), 1.0) << i;
  }
  // 2. one node, --backward: the backward records carry their ratio to the forward leg of the same bytes
  std::string const backward_json = dir.file("backward.json");
  CliRun const backward = run_ferry(
      "bench --backend cpu --nproc 2 --tokens 8 --hidden 256 --backward --check --iters 2"
      " --warmup 1 --seed 5 --json " +
      backward_json);
  ASSERT_EQ(backward.code, 0) << backward.output;
  util::json::Value const bdoc = util::json::parse(read_file(backward_json), backward_json);
  std::vector<util::json::Value> const& brecords = bdoc.find("records")->items;
  ASSERT_EQ(brecords.size(), 4u) << read_file(backward_json);
  char const* const legs[] = {"dispatch", "combine", "dispatch_backward", "combine_backward"};
  for (std::size_t i = 0; i < 4; ++i) {
    EXPECT_EQ(text_of(brecords[i], "leg"), legs[i]);
    EXPECT_EQ(keys_of(brecords[i]), i < 2 ? common : with(common, {"backward_over_forward"})) << legs[i];
    EXPECT_EQ(text_of(brecords[i], "layout"), "rank");
    EXPECT_EQ(text_of(brecords[i], "check"), "pass");
  }
  // each backward leg's ratio is its median over its forward twin's (the combine's bytes for dispatch_backward);
  // the file holds 6 significant digits
  for (auto const [backward_leg, forward_leg] : {std::pair{2, 1}, std::pair{3, 0}}) {
    double const ratio = number_of(brecords[backward_leg], "median_us") / number_of(brecords[forward_leg], "median_us");
    EXPECT_NEAR(number_of(brecords[backward_leg], "backward_over_forward"), ratio, 1e-4 * ratio) << legs[backward_leg];
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
