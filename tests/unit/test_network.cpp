// FERRY_NETWORK and the words of GIN's refusal (src/comm/network.hpp): which worlds set GIN up, and that the
// ConfigError a communicator raises where GIN is missing says what is missing and how to get it. The message checks
// fail when a piece of advice is dropped from gin_missing_message (dropping "GDRCopy" failed the test once, as it
// should).
#include <gtest/gtest.h>

#include <optional>
#include <string>

#include "comm/network.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

using detail::Network;

TEST(Network, ParsesTheThreeValuesAndRefusesOthers) {
  EXPECT_EQ(detail::network_of("auto"), Network::automatic);
  EXPECT_EQ(detail::network_of("emulated"), Network::emulated);
  EXPECT_EQ(detail::network_of("gin"), Network::gin);
  for (Network network : {Network::automatic, Network::emulated, Network::gin})
    EXPECT_EQ(detail::network_of(detail::network_name(network)), network);
  try {
    detail::network_of("rdma");
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
  // the value the communicator reads parses (the table's words and network_of's agree)
  ScopedEnv const unset("FERRY_NETWORK", std::nullopt);
  EXPECT_EQ(detail::network_of(env_string("FERRY_NETWORK")), Network::automatic);
  ScopedEnv const forced("FERRY_NETWORK", "gin");
  EXPECT_EQ(detail::network_of(env_string("FERRY_NETWORK")), Network::gin);
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
