// Launcher tests: the children are this test binary re-executed as rank cases (tests/support/rank_case.hpp).
#include <gtest/gtest.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include "core/launcher.hpp"
#include "ferry/error.hpp"
#include "support/rank_case.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

std::string env_or_empty(char const* name) {
  char const* value = std::getenv(name);
  return value ? value : "";
}

int env_rank() {
  return std::atoi(env_or_empty("RANK").c_str());
}

// ---- rank cases ----------------------------------------------------------------------------------------------

FERRY_RANK_CASE(launcher_exit_code) {
  return 10 + env_rank();
}

// args: expected MASTER_PORT ("any" for a picked one), expected WORLD_SIZE.
FERRY_RANK_CASE(launcher_env) {
  auto const& args = ferry::test::rank_case_args();
  int num_problems = 0;
  auto const expect = [&](char const* name, std::string const& expected) {
    std::string const value = env_or_empty(name);
    if (value == expected) return;
    std::fprintf(stderr, "rank %s: %s=\"%s\", expected \"%s\"\n", env_or_empty("RANK").c_str(), name, value.c_str(),
                 expected.c_str());
    ++num_problems;
  };
  int const rank = env_rank();
  int const world = std::atoi(args.at(1).c_str());
  if (rank < 0 || rank >= world || env_or_empty("RANK") != std::to_string(rank)) {
    std::fprintf(stderr, "RANK=\"%s\" is not in [0, %d)\n", env_or_empty("RANK").c_str(), world);
    ++num_problems;
  }
  expect("WORLD_SIZE", args.at(1));
  expect("LOCAL_RANK", std::to_string(rank));
  expect("LOCAL_WORLD_SIZE", args.at(1));
  expect("MASTER_ADDR", "127.0.0.1");
  if (args.at(0) == "any") {
    int const port = std::atoi(env_or_empty("MASTER_PORT").c_str());
    if (port <= 0 || port > 65535) {
      std::fprintf(stderr, "MASTER_PORT=\"%s\" is not a port\n", env_or_empty("MASTER_PORT").c_str());
      ++num_problems;
    }
  } else {
    expect("MASTER_PORT", args.at(0));
  }
  // the multicast safety variables win even over an extra variable that tries to turn NVLS on
  expect("NCCL_NVLS_ENABLE", "0");
  expect("NVSHMEM_DISABLE_NVLS", "1");
  expect("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1");
  expect("FERRY_TEST_EXTRA", "two words");
  expect("FERRY_TEST_INHERITED", "from the parent");
  return num_problems == 0 ? 0 : 1;
}

// Rank 0 fails at once; the others take args[0] milliseconds to finish.
FERRY_RANK_CASE(launcher_one_fails) {
  if (env_rank() == 0) return 5;
  std::this_thread::sleep_for(std::chrono::milliseconds(std::atoi(ferry::test::rank_case_args().at(0).c_str())));
  return 0;
}

FERRY_RANK_CASE(launcher_sleep) {
  std::this_thread::sleep_for(30s);
  return 0;
}

FERRY_RANK_CASE(launcher_rank1_terminates) {
  if (env_rank() == 1) raise(SIGTERM);
  return 0;
}

// Writes its pid to args[0]/RANK.pid, then sleeps.
FERRY_RANK_CASE(launcher_record_pid_and_sleep) {
  std::ofstream(ferry::test::rank_case_args().at(0) + "/" + env_or_empty("RANK") + ".pid") << getpid() << "\n";
  std::this_thread::sleep_for(30s);
  return 0;
}

// ---- tests -----------------------------------------------------------------------------------------------------

ferry::LaunchOptions case_launch(char const* name, int nproc, std::vector<std::string> const& args = {}) {
  ferry::LaunchOptions options;
  options.argv = {ferry::self_executable(), std::string("--ferry-rank-case=") + name};
  options.argv.insert(options.argv.end(), args.begin(), args.end());
  options.nproc = nproc;
  options.timeout = 60s;
  return options;
}

TEST(Launcher, ExitCodesPropagatePerRank) {
  auto const result = ferry::launch_ranks(case_launch("launcher_exit_code", 3));
  ASSERT_EQ(result.ranks.size(), 3u);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(result.ranks[rank].exit_code, 10 + rank);
    EXPECT_EQ(result.ranks[rank].signal, 0);
  }
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.describe().find("rank 2: exit 12"), std::string::npos) << result.describe();
}

// Two launches at once (two threads) each see exactly their own ranks' exits.
TEST(Launcher, ConcurrentLaunchesKeepTheirOwnRanks) {
  constexpr int kRounds = 5;
  std::vector<ferry::LaunchResult> results(2 * kRounds);
  std::vector<std::thread> threads;
  for (int t = 0; t < 2; ++t) {
    threads.emplace_back([&, t] {
      for (int round = 0; round < kRounds; ++round) {
        auto options = case_launch("launcher_exit_code", 3);
        options.timeout = 20s;
        results[t * kRounds + round] = ferry::launch_ranks(options);
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (auto const& result : results) {
    ASSERT_EQ(result.ranks.size(), 3u);
    EXPECT_FALSE(result.timed_out);
    for (int rank = 0; rank < 3; ++rank) EXPECT_EQ(result.ranks[rank].exit_code, 10 + rank) << result.describe();
  }
}

TEST(Launcher, SuccessIsOk) {
  auto options = case_launch("launcher_rank1_terminates", 1);
  auto const result = ferry::launch_ranks(options);
  ASSERT_EQ(result.ranks.size(), 1u);
  EXPECT_EQ(result.ranks[0].exit_code, 0);
  EXPECT_TRUE(result.ok());
  EXPECT_EQ(result.describe(), "");
}

TEST(Launcher, SetsTheTorchrunAndSafetyVariables) {
  setenv("FERRY_TEST_INHERITED", "from the parent", 1);
  for (int const port : {0, 23456}) {
    SCOPED_TRACE("master_port=" + std::to_string(port));
    auto options = case_launch("launcher_env", 4, {port ? std::to_string(port) : "any", "4"});
    options.master_port = port;
    options.env = {{"FERRY_TEST_EXTRA", "two words"}, {"NCCL_NVLS_ENABLE", "1"}};
    auto const result = ferry::launch_ranks(options);
    EXPECT_TRUE(result.ok()) << result.describe();
  }
  unsetenv("FERRY_TEST_INHERITED");
}

TEST(Launcher, OneFailureEndsTheOthersAfterTheGrace) {
  auto options = case_launch("launcher_one_fails", 3, {"30000"});
  options.grace = 300ms;
  auto const start = Clock::now();
  auto const result = ferry::launch_ranks(options);
  double const seconds = seconds_since(start);
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_EQ(result.ranks[0].exit_code, 5);
  EXPECT_FALSE(result.ranks[0].killed_by_launcher);
  for (int rank : {1, 2}) {
    EXPECT_EQ(result.ranks[rank].exit_code, -1) << "rank " << rank;
    EXPECT_EQ(result.ranks[rank].signal, SIGKILL) << "rank " << rank;
    EXPECT_TRUE(result.ranks[rank].killed_by_launcher) << "rank " << rank;
  }
  EXPECT_FALSE(result.timed_out);
  EXPECT_GE(seconds, 0.3);
  EXPECT_LT(seconds, 5.0);
  EXPECT_NE(result.describe().find("rank 0: exit 5"), std::string::npos) << result.describe();
  EXPECT_NE(result.describe().find("rank 1: killed by signal 9 (stopped by the launcher)"), std::string::npos)
      << result.describe();
}

// Within the grace the others may finish on their own (and report their own errors).
TEST(Launcher, GraceLetsTheOthersFinish) {
  auto options = case_launch("launcher_one_fails", 3, {"200"});
  options.grace = 10s;
  auto const start = Clock::now();
  auto const result = ferry::launch_ranks(options);
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_EQ(result.ranks[0].exit_code, 5);
  for (int rank : {1, 2}) {
    EXPECT_EQ(result.ranks[rank].exit_code, 0) << "rank " << rank;
    EXPECT_FALSE(result.ranks[rank].killed_by_launcher) << "rank " << rank;
  }
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(Launcher, TimeoutKillsEveryRank) {
  auto options = case_launch("launcher_sleep", 3);
  options.timeout = 500ms;
  auto const start = Clock::now();
  auto const result = ferry::launch_ranks(options);
  double const seconds = seconds_since(start);
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_TRUE(result.timed_out);
  EXPECT_FALSE(result.ok());
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(result.ranks[rank].signal, SIGKILL) << "rank " << rank;
    EXPECT_TRUE(result.ranks[rank].killed_by_launcher) << "rank " << rank;
  }
  EXPECT_GE(seconds, 0.5);
  EXPECT_LT(seconds, 5.0);
  EXPECT_NE(result.describe().find("past its deadline"), std::string::npos) << result.describe();
}

TEST(Launcher, DeathBySignalIsReported) {
  auto const result = ferry::launch_ranks(case_launch("launcher_rank1_terminates", 3));
  ASSERT_EQ(result.ranks.size(), 3u);
  EXPECT_EQ(result.ranks[0].exit_code, 0);
  EXPECT_EQ(result.ranks[1].exit_code, -1);
  EXPECT_EQ(result.ranks[1].signal, SIGTERM);
  EXPECT_FALSE(result.ranks[1].killed_by_launcher);
  EXPECT_EQ(result.ranks[2].exit_code, 0);
  EXPECT_NE(result.describe().find("rank 1: killed by signal 15"), std::string::npos) << result.describe();
}

TEST(Launcher, ProgramThatCannotStartExits127) {
  ferry::LaunchOptions options;
  options.argv = {"/nonexistent/ferry-test-program"};
  options.nproc = 2;
  options.timeout = 10s;
  auto const result = ferry::launch_ranks(options);
  ASSERT_EQ(result.ranks.size(), 2u);
  for (auto const& rank : result.ranks) EXPECT_EQ(rank.exit_code, 127);
}

TEST(Launcher, RejectsBadOptions) {
  ferry::LaunchOptions options;
  options.argv = {ferry::self_executable()};
  options.nproc = 0;
  EXPECT_THROW(ferry::launch_ranks(options), ferry::Error);
  options.nproc = 1;
  options.argv.clear();
  EXPECT_THROW(ferry::launch_ranks(options), ferry::Error);
}

// The ranks die with their launcher: killing it (Ctrl-C, a test timeout) leaves no rank running.
TEST(Launcher, RanksDieWithTheLauncher) {
  std::string dir = testing::TempDir() + "ferry_launcher_XXXXXX";
  ASSERT_NE(mkdtemp(dir.data()), nullptr);
  constexpr int kRanks = 2;
  pid_t const launcher = fork();
  ASSERT_GE(launcher, 0);
  if (launcher == 0) {
    // the launcher process: starts sleeping ranks and waits for them
    auto options = case_launch("launcher_record_pid_and_sleep", kRanks, {dir});
    ferry::launch_ranks(options);
    _exit(0);
  }
  // wait for both ranks to report their pids
  std::vector<pid_t> ranks;
  auto const start = Clock::now();
  while (ranks.size() < kRanks && seconds_since(start) < 20) {
    ranks.clear();
    for (int rank = 0; rank < kRanks; ++rank) {
      pid_t pid = 0;
      std::ifstream(dir + "/" + std::to_string(rank) + ".pid") >> pid;
      if (pid > 0) ranks.push_back(pid);
    }
    std::this_thread::sleep_for(20ms);
  }
  kill(launcher, SIGKILL);
  waitpid(launcher, nullptr, 0);
  ASSERT_EQ(ranks.size(), static_cast<std::size_t>(kRanks)) << "the ranks did not start";
  // a rank is gone once its /proc entry is gone or a zombie (waiting for init to reap it)
  auto const alive = [](pid_t pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string pid_field, comm, state;
    if (!(stat >> pid_field >> comm >> state)) return false;
    return state != "Z" && state != "X";
  };
  auto const killed_at = Clock::now();
  bool any_alive = true;
  while (any_alive && seconds_since(killed_at) < 5) {
    any_alive = false;
    for (pid_t pid : ranks) any_alive = any_alive || alive(pid);
    if (any_alive) std::this_thread::sleep_for(20ms);
  }
  for (pid_t pid : ranks) {
    EXPECT_FALSE(alive(pid)) << "rank pid " << pid << " outlived its launcher";
    if (alive(pid)) kill(pid, SIGKILL);
  }
  for (int rank = 0; rank < kRanks; ++rank) std::remove((dir + "/" + std::to_string(rank) + ".pid").c_str());
  rmdir(dir.c_str());
}

}  // namespace
