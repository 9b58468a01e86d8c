// FERRY_NETWORK and the words of GIN's refusal (src/comm/network.hpp): which worlds set GIN up, and that the
// ConfigError a communicator raises where GIN is missing says what is missing and how to get it. The message checks
// fail when a piece of advice is dropped from gin_missing_message (dropping "GDRCopy" failed the test once, as it
// should).
#include <gtest/gtest.h>

#include <optional>
#include <string>
#include <vector>

#include "comm/network.hpp"
#include "comm/transport/transport.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

using detail::Network;

TEST(Network, ParsesTheThreeValuesAndRefusesOthers) {
  EXPECT_EQ(detail::parse_network("auto"), Network::automatic);
  EXPECT_EQ(detail::parse_network("emulated"), Network::emulated);
  EXPECT_EQ(detail::parse_network("gin"), Network::gin);
  for (Network network : {Network::automatic, Network::emulated, Network::gin})
    EXPECT_EQ(detail::parse_network(detail::network_name(network)), network);
  try {
    detail::parse_network("rdma");
    FAIL() << "FERRY_NETWORK=rdma was accepted";
  } catch (ConfigError const& error) {
    EXPECT_TRUE(contains(error.what(), "FERRY_NETWORK=rdma is not one of auto, emulated, gin")) << error.what();
  }
}

TEST(Network, IsDeclaredInTheEnvTableWithDefaultAuto) {
  EnvParam const& param = env_param("FERRY_NETWORK");
  EXPECT_STREQ(param.default_value, "auto");
  EXPECT_EQ(env_problem(param, "gin"), "");
  EXPECT_EQ(env_problem(param, "emulated"), "");
  EXPECT_TRUE(contains(env_problem(param, "ib"), "FERRY_NETWORK=ib is not one of auto, emulated, gin"));
  // the value the communicator reads parses (the table's words and parse_network's agree)
  ScopedEnv const unset("FERRY_NETWORK", std::nullopt);
  EXPECT_EQ(detail::parse_network(env_string("FERRY_NETWORK")), Network::automatic);
  ScopedEnv const forced("FERRY_NETWORK", "gin");
  EXPECT_EQ(detail::parse_network(env_string("FERRY_NETWORK")), Network::gin);
}

TEST(Network, GinOnlyWhereAskedOrWherePeersAreBeyondNvlink) {
  // auto: GIN exactly when the world is larger than the NVLink team
  EXPECT_FALSE(detail::wants_gin(Network::automatic, 1, 1));
  EXPECT_FALSE(detail::wants_gin(Network::automatic, 8, 8));
  EXPECT_TRUE(detail::wants_gin(Network::automatic, 16, 8));
  // gin: always, so that a missing GIN shows at world 1
  EXPECT_TRUE(detail::wants_gin(Network::gin, 1, 1));
  EXPECT_TRUE(detail::wants_gin(Network::gin, 16, 8));
  // emulated: never
  EXPECT_FALSE(detail::wants_gin(Network::emulated, 1, 1));
  EXPECT_FALSE(detail::wants_gin(Network::emulated, 16, 8));
}

TEST(Network, VersionNames) {
  EXPECT_EQ(detail::nccl_version_name(22809), "2.28.9");
  EXPECT_EQ(detail::nccl_version_name(23203), "2.32.3");
  EXPECT_EQ(detail::nccl_version_name(detail::kGinMinNcclVersion), "2.28.7");
  EXPECT_EQ(detail::nccl_version_name(detail::kGinClusterNcclVersion), "2.30.4");
}

TEST(Network, GinMissingMessageSaysWhatIsMissingAndHowToGetIt) {
  std::string const reason = "ncclDevCommCreate with GIN failed: invalid usage (5): \"GIN not supported.\"";
  std::string const message = detail::gin_missing_message(22809, reason);
  for (char const* says : {
           "GIN (NCCL's GPU-initiated networking) is needed but missing: ",
           "\"GIN not supported.\"",     // NCCL's own words, carried through
           "the loaded NCCL is 2.28.9",  // the version in use
           "2.30.4 or newer",            // the version clusters run
           "NCCL_GIN_TYPE=3",            // GDAKI
           "NCCL_GIN_TYPE=2",            // the host proxy
           "IB verbs",                   // ... over an RDMA NIC
           "RDMA NIC",                   //
           "GDRCopy",                    // the TCP-socket GIN of 2.32.3 and newer
           "NCCL_GIN_ENABLE",            // a GIN switched off
           "NCCL_DEBUG=INFO",            // where NCCL says why
           "FERRY_NETWORK=auto",         // no GIN needed on one NVLink host
       })
    EXPECT_TRUE(contains(message, says)) << "'" << says << "' not in: " << message;
  EXPECT_FALSE(contains(message, "older than")) << message;
}

TEST(Network, GinMissingMessageOnAnNcclWithoutGinNamesTheFirstVersionWithIt) {
  std::string const message = detail::gin_missing_message(22703, "this NCCL has no GIN");
  EXPECT_TRUE(contains(message, "the loaded NCCL 2.27.3 is older than 2.28.7, the first with GIN")) << message;
  EXPECT_TRUE(contains(message, "load NCCL 2.30.4 or newer")) << message;
  EXPECT_TRUE(contains(message, "this NCCL has no GIN")) << message;
}

}  // namespace
}  // namespace ferry::test

namespace ferry::test {
namespace {

TEST(SignalRanges, FirstFitReusesWhatIsGivenBackAndRefusesWhenFull) {
  detail::SignalRanges ranges(100);
  EXPECT_EQ(ranges.take(7, 0), 0u);  // no signals: nothing held
  EXPECT_EQ(ranges.take(1, 30), 0u);
  EXPECT_EQ(ranges.take(2, 30), 30u);
  EXPECT_EQ(ranges.take(3, 30), 60u);
  EXPECT_EQ(ranges.in_use(), 90u);
  ranges.give_back(2);
  EXPECT_EQ(ranges.in_use(), 60u);
  EXPECT_EQ(ranges.take(4, 20), 30u);  // the hole first
  EXPECT_EQ(ranges.take(5, 10), 50u);  // the rest of the hole
  EXPECT_EQ(ranges.take(6, 10), 90u);  // the tail
  EXPECT_EQ(ranges.in_use(), 100u);
  try {
    ranges.take(8, 1);
    FAIL() << "a full pool handed out a signal";
  } catch (ConfigError const& error) {
    EXPECT_TRUE(contains(error.what(), "no 1 free GIN signals in a row: 100 of the device communicator's 100"))
        << error.what();
  }
  ranges.give_back(1);
  ranges.give_back(99);  // owns nothing
  EXPECT_THROW(ranges.take(9, 31), ConfigError);
  EXPECT_EQ(ranges.take(9, 30), 0u);
}

TEST(SignalRanges, TheSameCallsGiveTheSameIdsOnEveryRank) {
  // each rank replays the communicator's collective sequence; the ids must agree (a signal names one counter)
  std::vector<uint32_t> firsts[2];
  for (auto& out : firsts) {
    detail::SignalRanges ranges(4096);
    out.push_back(ranges.take(0, 26));
    out.push_back(ranges.take(1, 100));
    ranges.give_back(0);
    out.push_back(ranges.take(2, 10));
    out.push_back(ranges.take(3, 20));
  }
  EXPECT_EQ(firsts[0], firsts[1]);
  EXPECT_EQ(firsts[0], (std::vector<uint32_t>{0, 26, 0, 126}));  // 20 do not fit in the 16 left of the hole
}

TEST(Network, ANodeMustBeInsideItsNvlinkTeam) {
  // 2 hosts of 8 GPUs: 2x8 fits, 1x16 does not; 4x4 splits a host, which is allowed
  for (int rank : {0, 7, 8, 15}) {
    int const first = rank / 8 * 8;
    EXPECT_NO_THROW(detail::check_node_in_team(Topology{2, 8}, rank, first, 8));
    EXPECT_NO_THROW(detail::check_node_in_team(Topology{4, 4}, rank, first, 8));
  }
  try {
    detail::check_node_in_team(Topology{1, 16}, 9, 8, 8);
    FAIL() << "a node wider than the NVLink team was accepted";
  } catch (ConfigError const& error) {
    EXPECT_TRUE(contains(error.what(),
                         "topology 1x16 puts ranks 0..15 on the node of rank 9, but only ranks 8..15 "
                         "share load/store access"))
        << error.what();
  }
}

// The emulated network's settings come from the env table (a replayable seed, the delay bound, reordering); a bad
// value is refused by name.
TEST(EmulatedNetwork, OptionsComeFromTheEnvironment) {
  transport::EmulatedOptions const defaults;
  {
    transport::EmulatedOptions const got = transport::emulated_options_from_env();
    EXPECT_EQ(got.seed, defaults.seed);
    EXPECT_EQ(got.max_delay_ns, defaults.max_delay_ns);
    EXPECT_EQ(got.reorder, defaults.reorder);
    EXPECT_STREQ(env_param("FERRY_EMULATED_SEED").default_value, std::to_string(defaults.seed).c_str());
    EXPECT_STREQ(env_param("FERRY_EMULATED_DELAY_NS").default_value, std::to_string(defaults.max_delay_ns).c_str());
  }
  {
    test::ScopedEnv const seed("FERRY_EMULATED_SEED", std::string("123456789"));
    test::ScopedEnv const delay("FERRY_EMULATED_DELAY_NS", std::string("0"));
    test::ScopedEnv const reorder("FERRY_EMULATED_REORDER", std::string("0"));
    transport::EmulatedOptions const got = transport::emulated_options_from_env();
    EXPECT_EQ(got.seed, 123456789u);
    EXPECT_EQ(got.max_delay_ns, 0u);
    EXPECT_FALSE(got.reorder);
  }
  test::ScopedEnv const bad("FERRY_EMULATED_DELAY_NS", std::string("-5"));
  try {
    transport::emulated_options_from_env();
    FAIL() << "FERRY_EMULATED_DELAY_NS=-5 was accepted";
  } catch (ConfigError const& error) {
    EXPECT_TRUE(contains(error.what(), "FERRY_EMULATED_DELAY_NS=-5")) << error.what();
  }
}

}  // namespace
}  // namespace ferry::test
