// The env table's rules (src/core/env.cpp): one rule per variable, applied by the library's accessors and by
// `ferry env` with the same message. Before the rules, `ferry env` showed FERRY_TIMEOUT_S=abc or -1 as in force and
// FERRY_LOG=verbose was accepted silently: these tests failed so.
#include <gtest/gtest.h>

#include <chrono>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "ep/reference.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/env.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "support/cpu_ranks.hpp"
#include "support/host_fixtures.hpp"

namespace ferry::test {
namespace {

// The refusal the library raises for name=value ("" when it accepts it).
std::string library_refusal(char const* name, std::string const& value) {
  ScopedEnv const set(name, value);
  try {
    check_env();
  } catch (Error const& error) {
    return error.what();
  }
  return "";
}

TEST(EnvRules, EveryDefaultFollowsItsOwnRule) {
  for (EnvParam const& param : env_params())
    EXPECT_EQ(env_problem(param, param.default_value), "") << param.name << " default " << param.default_value;
}

TEST(EnvRules, BadValuesAreRefusedNamingVariableValueAndWhatToDo) {
  struct Case {
    char const* name;
    char const* value;
    char const* says;
  };
  for (Case const& c : {
           Case{"FERRY_TIMEOUT_S", "abc",
                "FERRY_TIMEOUT_S=abc is not a number; it must be a positive number of seconds"},
           Case{"FERRY_TIMEOUT_S", "-1", "FERRY_TIMEOUT_S=-1 must be a positive number of seconds"},
           Case{"FERRY_TIMEOUT_S", "0", "FERRY_TIMEOUT_S=0 must be a positive number of seconds"},
           Case{"FERRY_TIMEOUT_S", "inf", "FERRY_TIMEOUT_S=inf is not a number"},
           Case{"FERRY_LOG", "verbose", "FERRY_LOG=verbose is not one of error, warn, info, debug"},
           Case{"FERRY_NORMAL_LANDING", "maybe", "FERRY_NORMAL_LANDING=maybe is not one of auto, on, off"},
           Case{"FERRY_DISPATCH_BLOCKS", "-4", "FERRY_DISPATCH_BLOCKS=-4 is outside [0, 65536]: it must be a count"},
           Case{"FERRY_NCCL_VERSION_CHECK", "yes", "FERRY_NCCL_VERSION_CHECK=yes is not a whole number"},
       }) {
    std::string const refusal = library_refusal(c.name, c.value);
    EXPECT_TRUE(contains(refusal, c.says)) << c.name << "=" << c.value << ": '" << c.says << "' not in: " << refusal;
    EXPECT_TRUE(contains(refusal, "unset it")) << refusal;
  }
  // the accessor of the variable refuses it too, as ConfigError
  ScopedEnv const timeout("FERRY_TIMEOUT_S", "-1");
  EXPECT_THROW(env_double("FERRY_TIMEOUT_S"), ConfigError);
  ScopedEnv const log("FERRY_LOG", "verbose");
  EXPECT_THROW(env_string("FERRY_LOG"), ConfigError);
}

TEST(EnvRules, GoodValuesPass) {
  for (auto const& [name, value] : {std::pair{"FERRY_TIMEOUT_S", "2.5"}, std::pair{"FERRY_LOG", "debug"},
                                    std::pair{"FERRY_NORMAL_LANDING", "off"}, std::pair{"FERRY_COMBINE_BLOCKS", "0"}})
    EXPECT_EQ(library_refusal(name, value), "") << name << "=" << value;
  ScopedEnv const timeout("FERRY_TIMEOUT_S", "2.5");
  EXPECT_EQ(env_double("FERRY_TIMEOUT_S"), 2.5);
}

// `ferry env` flags a refused value with the library's own message and exits 1; values in force are listed as before.
TEST(EnvCli, FlagsWhatTheLibraryRefusesWithItsMessage) {
  for (auto const& [name, value] :
       {std::pair{"FERRY_TIMEOUT_S", "abc"}, std::pair{"FERRY_TIMEOUT_S", "-1"}, std::pair{"FERRY_LOG", "verbose"}}) {
    ScopedEnv const set(name, std::string(value));
    std::string const problem = env_problem(env_param(name), value);
    ASSERT_FALSE(problem.empty()) << name << "=" << value;
    CliRun const run = run_ferry("env");
    EXPECT_EQ(run.code, 1) << run.output;
    EXPECT_TRUE(contains(run.output, std::string(value) + " (refused)")) << run.output;
    EXPECT_TRUE(contains(run.output, "ferry env: refused: " + problem)) << run.output;
  }
  ScopedEnv const good("FERRY_TIMEOUT_S", std::string("7"));
  CliRun const run = run_ferry("env");
  EXPECT_EQ(run.code, 0) << run.output;
  EXPECT_FALSE(contains(run.output, "refused")) << run.output;
}

// A variable Ferry no longer reads is refused when set, never ignored (a pin that did nothing would mislead): by the
// library where a job starts, by `ferry env` (which does not list it as a parameter) and by every other command
// (EnvCli.OtherCommandsRefuseABadValueBeforeStarting).
// Checked to fail: with check_env's loop over the removed variables taken out, FERRY_DISPATCH_WARPS=8 passed; with
// `ferry env`'s, it exited 0.
TEST(EnvRules, RemovedVariablesAreRefusedNeverIgnored) {
  ASSERT_FALSE(removed_env_params().empty());
  for (RemovedEnvParam const& removed : removed_env_params()) {
    for (EnvParam const& param : env_params()) EXPECT_STRNE(param.name, removed.name) << "removed yet declared";
    std::string const refusal = library_refusal(removed.name, "8");
    EXPECT_TRUE(contains(refusal, std::string(removed.name) + "=8 is no longer read: " + removed.why + "; unset it"))
        << refusal;
    EXPECT_TRUE(contains(refusal, "env error")) << refusal;
    EXPECT_EQ(library_refusal(removed.name, ""), "") << removed.name << " set empty is unset";
    ScopedEnv const set(removed.name, std::string("16"));
    CliRun const run = run_ferry("env");
    EXPECT_EQ(run.code, 1) << run.output;
    EXPECT_TRUE(contains(run.output, "ferry env: refused: " + removed_env_problem(removed, "16"))) << run.output;
  }
  EXPECT_TRUE(contains(library_refusal("FERRY_COMBINE_WARPS", "16"), "every kernel is compiled for 16 warps"));
}

// Every other command refuses a bad value, or a removed variable, before it starts anything (exit 2, one line).
TEST(EnvCli, OtherCommandsRefuseABadValueBeforeStarting) {
  ScopedEnv const rank("RANK", std::nullopt);
  for (auto const& [name, value, says] :
       {std::tuple{"FERRY_LOG", "verbose", "FERRY_LOG=verbose is not one of error, warn, info, debug"},
        std::tuple{"FERRY_DISPATCH_WARPS", "16", "FERRY_DISPATCH_WARPS=16 is no longer read"}}) {
    ScopedEnv const set(name, std::string(value));
    CliRun const run = run_ferry("bench --backend cpu --tokens 16 --hidden 256 --iters 1");
    EXPECT_EQ(run.code, 2) << run.output;
    EXPECT_TRUE(contains(run.output, says)) << run.output;
    EXPECT_FALSE(contains(run.output, "rank 0")) << run.output;
  }
}

// A bound past what the waits' 64-bit nanoseconds hold (about 9.2e9 s) wrapped around, and every wait timed out at
// once. Every bound is refused past kMaxTimeoutSeconds, by the library and by `ferry env`, with one message.
// Checked to fail: with the ceiling taken out of the table's rule, FERRY_TIMEOUT_S=9.3e9 was accepted (and the
// barrier of TheLongestBoundStillWaits, run with it, failed at once: "timed out after 9.3e+09 s").
TEST(EnvRules, TimeoutsPastTheCeilingAreRefused) {
  for (char const* value : {"9.3e9", "1e10", "1e300"}) {
    std::string const refusal = library_refusal("FERRY_TIMEOUT_S", value);
    EXPECT_TRUE(contains(
        refusal, std::string("FERRY_TIMEOUT_S=") + value + " must be a positive number of seconds, at most 1e9"))
        << refusal;
    ScopedEnv const set("FERRY_TIMEOUT_S", std::string(value));
    CliRun const run = run_ferry("env");
    EXPECT_EQ(run.code, 1) << run.output;
    EXPECT_TRUE(contains(run.output, "ferry env: refused: " + env_problem(env_param("FERRY_TIMEOUT_S"), value)))
        << run.output;
  }
  EXPECT_EQ(library_refusal("FERRY_TIMEOUT_S", "1e9"), "");
  std::string const bootstrap = library_refusal("FERRY_BOOTSTRAP_TIMEOUT_S", "9300000000");
  EXPECT_TRUE(contains(bootstrap, "FERRY_BOOTSTRAP_TIMEOUT_S=9300000000 is outside [1, 1000000000]")) << bootstrap;
  EXPECT_EQ(library_refusal("FERRY_BOOTSTRAP_TIMEOUT_S", "1000000000"), "");
  {
    ScopedEnv const set("FERRY_BOOTSTRAP_TIMEOUT_S", std::string("9300000000"));
    EXPECT_THROW(env_int("FERRY_BOOTSTRAP_TIMEOUT_S"), BootstrapError);  // a rendezvous variable
  }
  // the C++ option the variable fills
  SocketBootstrapOptions options;
  options.world = 2;
  options.rank = 1;
  options.local_rank = 1;
  options.local_world = 2;
  options.timeout = std::chrono::milliseconds(9'300'000'000'000);
  EXPECT_EQ(expect_error<BootstrapError>([&] { make_socket_bootstrap(options); },
                                         {"ms is more than the longest bound a wait takes, 1000000000 s"}),
            "");
  CliRun const launch = run_ferry("launch --nproc 1 --timeout 1e10 true");
  EXPECT_NE(launch.code, 0) << launch.output;
  EXPECT_TRUE(contains(launch.output, "--timeout=1e+10: must be at most 1e+09 s")) << launch.output;
}

// The largest bound accepted still waits: a peer 300 ms late is waited for by the communicator's barrier and by a
// low-latency call's own exchange with rank masking (the two host waits of the cpu backend that add the bound to a
// clock), instead of a timeout at once.
TEST(EnvRules, TheLongestBoundStillWaits) {
  ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string("1e9"));
  EpConfig const config = small_masked_ll_config();
  std::vector<std::string> const failures = run_cpu_ranks(2, [&](int rank, std::shared_ptr<Communicator> const& comm) {
    auto const late = [&] {
      if (rank == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
    };
    auto const start = std::chrono::steady_clock::now();
    late();
    comm->barrier();
    EpBuffer buffer(comm, config);
    ref::RankInput in;
    in.num_tokens = 2;
    in.x.assign(static_cast<std::size_t>(2 * config.hidden), 0);
    in.topk_idx = {0, 2, 1, 3};
    in.topk_weights.assign(4, 0.5f);
    late();
    buffer.dispatch(host_dispatch_args(in));
    FERRY_CHECK(std::chrono::steady_clock::now() - start >= std::chrono::milliseconds(550), "rank ", rank,
                " did not wait for rank 1");
  });
  for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
}

}  // namespace
}  // namespace ferry::test
