// Multi-process tests: a "rank case" is a function that runs in every rank process. The gtest process starts one
// child per rank through ferry's own launcher (the same one `ferry bench` uses); each child re-executes the test
// binary with --ferry-rank-case=NAME and runs the registered function.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/launcher.hpp"
#include "ferry/communicator.hpp"

// In a gtest body (the caller includes gtest): skip, with a message naming both counts, below n visible GPUs.
#define FERRY_REQUIRE_GPUS(n)                                                                   \
  do {                                                                                          \
    int const ferry_gpus_ = ::ferry::cuda_device_count();                                       \
    if (ferry_gpus_ < (n)) GTEST_SKIP() << ::ferry::test::needs_gpus_message((n), ferry_gpus_); \
  } while (0)

namespace ferry::test {

// The skip message of a test below its GPU count: "needs 1 GPU, found 0", "needs 2 GPUs, found 1".
inline std::string needs_gpus_message(int needed, int found) {
  return "needs " + std::to_string(needed) + (needed == 1 ? " GPU" : " GPUs") + ", found " + std::to_string(found);
}

// Returns the process exit code (0 = pass). Exceptions escaping it are printed and turned into exit code 1.
using RankCaseFn = int (*)();

struct RankCaseRegistrar {
  RankCaseRegistrar(char const* name, RankCaseFn fn);
};

// Arguments after --ferry-rank-case=NAME on the child's command line.
std::vector<std::string> const& rank_case_args();

// This test process's seed for random inputs: FERRY_TEST_SEED when set (to replay a run), else a fresh random one;
// the same for every call, printed once with how to replay it.
uint64_t test_seed();

// In a rank case: the value of its --seed=N argument (throws when the case was started without one).
uint64_t seed_arg();

// In a rank case: the communicator of `backend` over the socket bootstrap ferry's launcher set up in the environment.
std::shared_ptr<Communicator> connect_rank(Backend backend);

struct RankCaseOptions {
  std::vector<std::string> args;
  std::vector<std::pair<std::string, std::string>> env;
  std::chrono::milliseconds timeout{std::chrono::seconds(120)};
};

// Starts nproc children running the case; blocks until they end.
LaunchResult run_rank_case(char const* name, int nproc, RankCaseOptions const& options = {});

// main() of a test binary: runs a rank case when asked, gtest otherwise.
int test_main(int argc, char** argv);

}  // namespace ferry::test

#define FERRY_RANK_CASE(name)                                                         \
  static int name##_rank_case();                                                      \
  static ::ferry::test::RankCaseRegistrar name##_registrar(#name, &name##_rank_case); \
  static int name##_rank_case()
