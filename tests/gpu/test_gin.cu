// The cuda communicator's GIN setup (FERRY_NETWORK, src/comm/cuda/gin_setup.cu), at world 1 on one GPU: forced
// with FERRY_NETWORK=gin it either brings GIN up (a machine with an RDMA NIC: the Gin a kernel would get has
// contexts and the region's window) or fails at construction with the ConfigError that says what is missing and how
// to get it (a machine without one: the GPU machines of CI). auto and emulated never set GIN up at world 1, and
// gin_transport refuses a communicator without it. Which of the two outcomes happened is printed.
#include <gtest/gtest.h>

#include "ferry/communicator.hpp"
#include "support/rank_case.hpp"

#if FERRY_HAVE_CUDA
#include <cstdio>
#include <cstdlib>
#include <memory>
#include <string>

#include "comm/cuda/cuda_communicator.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"
#include "support/host_fixtures.hpp"
#endif

namespace ferry::test {
namespace test_gin {  // named, not anonymous: FERRY_CI_BUILD compiles several files as one

#if FERRY_HAVE_CUDA

std::unique_ptr<Communicator> make_comm_with(char const* network) {
  setenv("FERRY_NETWORK", network, 1);
  return Communicator::create(make_socket_bootstrap(socket_bootstrap_options_from_env()),
                              CommunicatorOptions{Backend::cuda, -1});
}

FERRY_RANK_CASE(gin_network_choice) {
  // 1. auto and emulated at world 1: no GIN, and no Gin to be had
  for (char const* network : {"auto", "emulated"}) {
    auto comm = make_comm_with(network);
    FERRY_CHECK(detail::network_transport(*comm) != transport::Kind::gin, "FERRY_NETWORK=", network, " set GIN up at world 1");
    SymmetricRegion const region = comm->alloc_symmetric(1 << 16);
    bool refused = false;
    try {
      detail::gin_transport(*comm, region, 0, 8);
    } catch (ConfigError const& error) {
      refused = contains(error.what(), "has no GIN");
    }
    FERRY_CHECK(refused, "gin_transport over a communicator without GIN (FERRY_NETWORK=", network,
                ") was not refused with a ConfigError");
  }

  // 2. gin: GIN up, or the clear refusal at construction
  std::unique_ptr<Communicator> comm;
  try {
    comm = make_comm_with("gin");
  } catch (ConfigError const& error) {
    std::string const what = error.what();
    std::printf("gin_network_choice: no GIN on this machine; the construction error is:\n%s\n", what.c_str());
    for (char const* says : {"GIN (NCCL's GPU-initiated networking) is needed but missing", "the loaded NCCL",
                             "NCCL_GIN_TYPE", "RDMA NIC", "GDRCopy", "FERRY_NETWORK"})
      FERRY_CHECK(contains(what, says), "'", says, "' missing from the GIN refusal: ", what);
    return 0;
  }
  FERRY_CHECK(detail::network_transport(*comm) == transport::Kind::gin, "FERRY_NETWORK=gin built a communicator without GIN");
  SymmetricRegion const region = comm->alloc_symmetric(1 << 16);
  transport::Gin const gin = detail::gin_transport(*comm, region, 4096, 64);
  FERRY_CHECK(gin.num_contexts >= 1 && gin.window != nullptr && gin.local_window == region.local &&
                  gin.world == comm->world() && gin.rank == comm->rank(),
              "the Gin over a region: ", gin.num_contexts, " contexts, window ", static_cast<void*>(gin.window),
              ", world ", gin.world);
  std::printf("gin_network_choice: GIN is up (%d contexts)\n", gin.num_contexts);
  return 0;
}

#endif

TEST(GinSetup, ForcedAtWorldOneGivesGinOrSaysWhatIsMissing) {
  FERRY_REQUIRE_GPUS(1);
  LaunchResult const result = run_rank_case("gin_network_choice", 1);
  EXPECT_TRUE(result.ok()) << result.describe();
}

}  // namespace test_gin
}  // namespace ferry::test
