// `ferry p2p`'s options and result records (tools/ferry/p2p_settings.cpp), on the host: the transports and the ops
// each measures, the emulated transport's knobs, --one-gpu, every refusal naming the option, the value and what is
// allowed, and the fields that label a record's transport. The measures run in `scripts/gpu-check.sh p2p`.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "ferry/error.hpp"
#include "p2p_settings.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

using cli::p2p::Direction;
using cli::p2p::Op;

cli::p2p::Settings settings_of(std::vector<std::string> args) {
  cli::Options options = cli::p2p::make_options();
  std::vector<char*> argv;
  for (auto& arg : args) argv.push_back(arg.data());
  EXPECT_TRUE(options.parse(static_cast<int>(argv.size()), argv.data()));
  return cli::p2p::settings_from(options);
}

TEST(P2pOptions, LsaKeepsTodaysOpsAndTheNetworkTransportsGoThroughTheSeam) {
  cli::p2p::Settings const lsa = settings_of({});
  EXPECT_EQ(lsa.transport, transport::Kind::lsa);
  EXPECT_EQ(lsa.ops, (std::vector<Op>{Op::push, Op::pull, Op::copy_engine, Op::latency}));
  EXPECT_FALSE(lsa.one_gpu);
  for (char const* name : {"emulated", "gin"}) {
    cli::p2p::Settings const net = settings_of({"--transport", name});
    EXPECT_EQ(net.ops, (std::vector<Op>{Op::put_signal, Op::latency})) << name;
    EXPECT_STREQ(transport::kind_name(net.transport), name);
  }
  // the seam's put_signal over NVLink, beside the emulated figures
  EXPECT_EQ(settings_of({"--ops", "put_signal,push"}).ops, (std::vector<Op>{Op::put_signal, Op::push}));
}

TEST(P2pOptions, EmulatedKnobsDefaultToTheTransportsOwnAndAreSet) {
  transport::EmulatedOptions const defaults;
  cli::p2p::Settings const plain = settings_of({"--transport", "emulated"});
  EXPECT_EQ(plain.emulated.max_delay_ns, defaults.max_delay_ns);
  EXPECT_EQ(plain.emulated.seed, defaults.seed);
  EXPECT_EQ(plain.emulated.reorder, defaults.reorder);
  cli::p2p::Settings const set =
      settings_of({"--transport=emulated", "--emulated-delay-ns=0", "--emulated-seed", "12345678901",
                   "--emulated-reorder", "0", "--one-gpu", "--nproc", "4", "--directions", "alltoall"});
  EXPECT_EQ(set.emulated.max_delay_ns, 0u);
  EXPECT_EQ(set.emulated.seed, 12345678901ull);
  EXPECT_FALSE(set.emulated.reorder);
  EXPECT_TRUE(set.one_gpu);
  EXPECT_EQ(set.nproc, 4);
  EXPECT_EQ(set.directions, std::vector<Direction>{Direction::alltoall});
  // what the table prints above an emulated run says what was in force
  EXPECT_TRUE(contains(cli::p2p::emulated_text(plain.emulated),
                       "seeded delay in [0, " + std::to_string(defaults.max_delay_ns) + ") ns per delivery"));
  EXPECT_TRUE(contains(cli::p2p::emulated_text(set.emulated), "no delay"));
  EXPECT_TRUE(contains(cli::p2p::emulated_text(set.emulated), "issue order"));
  EXPECT_TRUE(contains(cli::p2p::emulated_text(set.emulated), "seed 12345678901"));
}

TEST(P2pOptions, RefusalsNameTheOptionTheValueAndWhatIsAllowed) {
  struct Case {
    std::vector<std::string> args;
    std::vector<std::string> said;
  };
  std::vector<Case> const cases = {
      {{"--transport", "rdma"}, {"--transport", "'rdma'", "lsa, emulated, gin"}},
      {{"--transport", "emulated", "--ops", "pull"},
       {"--ops", "'pull'", "--transport emulated", "put_signal, latency"}},
      {{"--transport", "gin", "--ops", "copy_engine"}, {"--ops", "'copy_engine'", "--transport gin"}},
      {{"--ops", "get"}, {"--ops", "'get'", "push, pull, copy_engine, latency, put_signal"}},
      {{"--directions", "ring"}, {"--directions", "'ring'", "oneway, bidir, alltoall"}},
      {{"--emulated-delay-ns", "100"}, {"--emulated-delay-ns", "--transport is lsa", "--transport emulated"}},
      {{"--transport", "gin", "--emulated-seed", "3"}, {"--emulated-seed", "--transport is gin"}},
      {{"--transport", "emulated", "--emulated-delay-ns", "-5"}, {"--emulated-delay-ns=-5", "non-negative"}},
      {{"--transport", "emulated", "--emulated-delay-ns", "2000000000"},
       {"--emulated-delay-ns=2000000000", "[0, 1000000000]"}},
      {{"--transport", "emulated", "--emulated-reorder", "yes"}, {"--emulated-reorder=yes", "1", "0"}},
      {{"--one-gpu"}, {"--one-gpu", "not lsa", "not NVLink"}},
      {{"--transport", "gin", "--one-gpu"}, {"--one-gpu", "not gin", "one rank per GPU"}},
      {{"--transport", "emulated", "--one-gpu", "--nproc", "9"}, {"--nproc 9", "--one-gpu", "2 to 8"}},
      {{"--transport", "emulated", "--ctas", "8,1024"}, {"--ctas", "1024", "512", "put_signal"}},
      {{"--sizes", "100"}, {"--sizes", "100", "multiple of 16"}},
  };
  for (Case const& c : cases)
    EXPECT_EQ(expect_error<ConfigError>([&] { settings_of(c.args); }, c.said), "") << c.args[0] << " " << c.args[1];
  // the same CTA count is fine where no put_signal measure runs
  EXPECT_EQ(settings_of({"--ctas", "1024"}).ctas, (std::vector<int>{1024}));
}

TEST(P2pRecords, EveryRecordNamesItsTransportAndEmulatedOnesTheirSettings) {
  cli::p2p::Settings const emulated = settings_of({"--transport", "emulated", "--emulated-delay-ns", "500",
                                                   "--emulated-seed", "7", "--one-gpu", "--directions", "bidir"});
  cli::p2p::Record const put{Op::put_signal, Direction::bidir, 1 << 20, 32, 10.5, 99.5, 0};
  std::string const json = cli::p2p::result_record(put, emulated, 2).json();
  EXPECT_EQ(json,
            "{\"op\": \"put_signal\", \"bytes\": 1048576, \"ctas\": 32, \"direction\": \"bidir\", \"transport\": "
            "\"emulated\", \"one_gpu\": true, \"emulated_delay_ns\": 500, \"emulated_reorder\": true, "
            "\"emulated_seed\": 7, \"gbps\": 99.5, \"gbps_sum\": 199, \"median_us\": 10.5}");

  cli::p2p::Settings const lsa = settings_of({});
  cli::p2p::Record const push{Op::push, Direction::alltoall, 4096, 8, 1.0, 4.0, 0};
  std::string const nvlink = cli::p2p::result_record(push, lsa, 4).json();
  EXPECT_TRUE(contains(nvlink, "\"transport\": \"lsa\", \"one_gpu\": false, \"gbps\": 4")) << nvlink;
  EXPECT_TRUE(contains(nvlink, "\"peers\": 3")) << nvlink;
  EXPECT_FALSE(contains(nvlink, "emulated")) << nvlink;

  cli::p2p::Record const latency{Op::latency, Direction::oneway, 8, 1, 0, 0, 2.25};
  std::string const gin = cli::p2p::result_record(latency, settings_of({"--transport", "gin"}), 2).json();
  EXPECT_TRUE(contains(gin, "\"transport\": \"gin\"")) << gin;
  EXPECT_TRUE(contains(gin, "\"latency_us\": 2.25")) << gin;
  EXPECT_FALSE(contains(gin, "gbps")) << gin;
}

#if FERRY_HAVE_CUDA
// The CLI refuses bad use in the launching process, before it looks for GPUs or starts a rank (exit 2, one line).
class P2pCli : public testing::Test {
  ScopedEnv rank_{"RANK", std::nullopt};
};

TEST_F(P2pCli, BadUseIsRefusedBeforeAnyGpuWork) {
  CliRun const gin = run_ferry("p2p --transport gin --one-gpu");
  EXPECT_EQ(gin.code, 2) << gin.output;
  EXPECT_TRUE(contains(gin.output, "ferry p2p: ")) << gin.output;
  EXPECT_TRUE(contains(gin.output, "--one-gpu runs --transport emulated only")) << gin.output;
  CliRun const delay = run_ferry("p2p --transport emulated --emulated-delay-ns soon");
  EXPECT_EQ(delay.code, 2) << delay.output;
  EXPECT_TRUE(contains(delay.output, "--emulated-delay-ns=soon is not a non-negative integer")) << delay.output;
}
#endif

}  // namespace
}  // namespace ferry::test
