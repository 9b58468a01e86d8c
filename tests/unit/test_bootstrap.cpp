// Bootstrap tests. LocalBootstrap: ranks are threads of this process. SocketBootstrap: ranks are real processes
// started through ferry's launcher (rank cases), talking TCP over loopback.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <optional>

#include "core/launcher.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

// Deterministic bytes for (seed, rank, op index): every rank can compute every other rank's block.
std::vector<unsigned char> pattern(uint64_t seed, int rank, int op_idx, std::size_t bytes) {
  std::mt19937_64 rng(seed ^ (uint64_t(rank) * 0x9E3779B97F4A7C15ull) ^ (uint64_t(op_idx) << 40));
  std::vector<unsigned char> out(bytes);
  for (auto& byte : out) byte = static_cast<unsigned char>(rng());
  return out;
}

double seconds_since(Clock::time_point start) {
  return std::chrono::duration<double>(Clock::now() - start).count();
}

// ---- LocalBootstrap --------------------------------------------------------------------------------------------

// What one rank thread ended with: "" if it returned normally, else the exception's type tag and message.
struct ThreadOutcome {
  bool threw_bootstrap_error = false;
  std::string error;  // what() of whatever was thrown, "" if nothing
  double seconds = 0;
};

// Runs fn(bootstrap) on one thread per rank and joins them.
std::vector<ThreadOutcome> run_local(std::vector<std::unique_ptr<ferry::Bootstrap>>& bootstraps,
                                     std::function<void(int rank, std::unique_ptr<ferry::Bootstrap>&)> const& fn) {
  std::vector<ThreadOutcome> outcomes(bootstraps.size());
  std::vector<std::thread> threads;
  for (std::size_t rank = 0; rank < bootstraps.size(); ++rank) {
    threads.emplace_back([&, rank] {
      auto const start = Clock::now();
      try {
        fn(static_cast<int>(rank), bootstraps[rank]);
      } catch (ferry::BootstrapError const& error) {
        outcomes[rank].threw_bootstrap_error = true;
        outcomes[rank].error = error.what();
      } catch (std::exception const& error) {
        outcomes[rank].error = std::string("non-bootstrap exception: ") + error.what();
      }
      outcomes[rank].seconds = seconds_since(start);
    });
  }
  for (auto& thread : threads) thread.join();
  return outcomes;
}

TEST(LocalBootstrap, RanksAndWorld) {
  auto bootstraps = ferry::make_local_bootstraps(3);
  ASSERT_EQ(bootstraps.size(), 3u);
  for (int rank = 0; rank < 3; ++rank) {
    EXPECT_EQ(bootstraps[rank]->rank(), rank);
    EXPECT_EQ(bootstraps[rank]->world(), 3);
    EXPECT_EQ(bootstraps[rank]->local_rank(), rank);
    EXPECT_EQ(bootstraps[rank]->local_world(), 3);
  }
}

TEST(LocalBootstrap, RejectsBadArguments) {
  EXPECT_THROW(ferry::make_local_bootstraps(0), ferry::ConfigError);
  EXPECT_THROW(ferry::make_local_bootstraps(2, 0ms), ferry::ConfigError);
  auto bootstraps = ferry::make_local_bootstraps(2);
  int value = 0;
  EXPECT_THROW(bootstraps[0]->broadcast(&value, sizeof(value), 2), ferry::InputError);
  EXPECT_THROW(bootstraps[0]->broadcast(&value, sizeof(value), -1), ferry::InputError);
  EXPECT_THROW(bootstraps[0]->allgather(nullptr, nullptr, 4), ferry::InputError);
}

// Allgather (every block checked, in place too), broadcast from every root and barriers, repeated, for several
// worlds and sizes (0 bytes included).
TEST(LocalBootstrap, CollectivesDeliverEveryBlock) {
  uint64_t const seed = ferry::test::test_seed();
  for (int world : {1, 2, 4, 8}) {
    SCOPED_TRACE("world=" + std::to_string(world));
    auto bootstraps = ferry::make_local_bootstraps(world, 10s);
    std::atomic<int> num_mismatches{0};
    auto const outcomes = run_local(bootstraps, [&](int rank, std::unique_ptr<ferry::Bootstrap>& bootstrap) {
      int op_idx = 0;
      for (int round = 0; round < 20; ++round) {
        for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{4096}}) {
          // allgather out of place
          auto const mine = pattern(seed, rank, op_idx, bytes);
          std::vector<unsigned char> all(world * bytes, 0xEE);
          bootstrap->allgather(mine.data(), all.data(), bytes);
          for (int r = 0; r < world; ++r)
            if (!ferry::test::same_bytes(all.data() + r * bytes, pattern(seed, r, op_idx, bytes).data(), bytes))
              ++num_mismatches;
          ++op_idx;
          // allgather in place (send aliases recv + rank * bytes)
          std::vector<unsigned char> in_place(world * bytes, 0xEE);
          auto const mine2 = pattern(seed, rank, op_idx, bytes);
          std::copy(mine2.begin(), mine2.end(), in_place.begin() + rank * bytes);
          bootstrap->allgather(in_place.data() + rank * bytes, in_place.data(), bytes);
          for (int r = 0; r < world; ++r)
            if (!ferry::test::same_bytes(in_place.data() + r * bytes, pattern(seed, r, op_idx, bytes).data(), bytes))
              ++num_mismatches;
          ++op_idx;
          // broadcast from every root
          for (int root = 0; root < world; ++root) {
            auto const expected = pattern(seed, root, op_idx, bytes);
            std::vector<unsigned char> data = rank == root ? expected : std::vector<unsigned char>(bytes, 0xEE);
            bootstrap->broadcast(data.data(), bytes, root);
            if (data != expected) ++num_mismatches;
            ++op_idx;
          }
          bootstrap->barrier();
        }
      }
    });
    for (int rank = 0; rank < world; ++rank) EXPECT_EQ(outcomes[rank].error, "") << "rank " << rank;
    EXPECT_EQ(num_mismatches.load(), 0);
  }
}

// Nobody leaves barrier n before every rank entered it.
TEST(LocalBootstrap, BarrierWaitsForEveryRank) {
  constexpr int kWorld = 4;
  constexpr int kRounds = 50;
  auto bootstraps = ferry::make_local_bootstraps(kWorld, 10s);
  std::atomic<int> entered{0};
  std::atomic<int> num_early{0};
  auto const outcomes = run_local(bootstraps, [&](int rank, std::unique_ptr<ferry::Bootstrap>& bootstrap) {
    for (int round = 0; round < kRounds; ++round) {
      // stagger the arrivals so an early exit would be seen
      if (round % 10 == rank) std::this_thread::sleep_for(5ms);
      entered.fetch_add(1);
      bootstrap->barrier();
      if (entered.load() < kWorld * (round + 1)) ++num_early;
    }
  });
  for (int rank = 0; rank < kWorld; ++rank) EXPECT_EQ(outcomes[rank].error, "") << "rank " << rank;
  EXPECT_EQ(num_early.load(), 0);
  EXPECT_EQ(entered.load(), kWorld * kRounds);
}

// A rank that never calls barrier (but keeps its bootstrap): the others throw BootstrapError naming it at the
// deadline, not before and not much after.
TEST(LocalBootstrap, MissingRankIsNamedAtTheDeadline) {
  constexpr int kWorld = 4;
  constexpr int kMissing = 2;
  auto bootstraps = ferry::make_local_bootstraps(kWorld, 400ms);
  auto const outcomes = run_local(bootstraps, [&](int rank, std::unique_ptr<ferry::Bootstrap>& bootstrap) {
    bootstrap->barrier();
    if (rank != kMissing) bootstrap->barrier();
  });
  EXPECT_EQ(outcomes[kMissing].error, "");
  for (int rank = 0; rank < kWorld; ++rank) {
    if (rank == kMissing) continue;
    EXPECT_TRUE(outcomes[rank].threw_bootstrap_error) << "rank " << rank << ": " << outcomes[rank].error;
    EXPECT_NE(outcomes[rank].error.find("rank 2 did not arrive at barrier"), std::string::npos) << outcomes[rank].error;
    EXPECT_NE(outcomes[rank].error.find("bootstrap error ("), std::string::npos) << outcomes[rank].error;
    EXPECT_GE(outcomes[rank].seconds, 0.35);
    EXPECT_LT(outcomes[rank].seconds, 3.0);
  }
}

// A rank that destroys its bootstrap without calling: the others fail at once, not at the deadline.
TEST(LocalBootstrap, DestroyedRankFailsTheOthersQuickly) {
  constexpr int kWorld = 3;
  auto bootstraps = ferry::make_local_bootstraps(kWorld, 20s);
  auto const outcomes = run_local(bootstraps, [&](int rank, std::unique_ptr<ferry::Bootstrap>& bootstrap) {
    if (rank == 1) {
      std::this_thread::sleep_for(50ms);
      bootstrap.reset();
      return;
    }
    int value = rank;
    std::vector<int> all(kWorld);
    bootstrap->allgather(&value, all.data(), sizeof(int));
  });
  for (int rank : {0, 2}) {
    EXPECT_TRUE(outcomes[rank].threw_bootstrap_error) << "rank " << rank << ": " << outcomes[rank].error;
    EXPECT_NE(outcomes[rank].error.find("rank 1 destroyed its bootstrap"), std::string::npos) << outcomes[rank].error;
    EXPECT_LT(outcomes[rank].seconds, 5.0);
  }
}

// Different calls at the same position: every rank gets an error naming both calls; later calls fail too.
TEST(LocalBootstrap, MismatchedCallsAreReportedAndSticky) {
  constexpr int kWorld = 3;
  auto bootstraps = ferry::make_local_bootstraps(kWorld, 2s);
  std::vector<std::string> later_errors(kWorld);
  auto const outcomes = run_local(bootstraps, [&](int rank, std::unique_ptr<ferry::Bootstrap>& bootstrap) {
    bootstrap->barrier();
    int value = 7;
    std::vector<int> all(kWorld);
    try {
      if (rank == 1) {
        // arrive last, so the op is already opened as an allgather
        std::this_thread::sleep_for(100ms);
        bootstrap->broadcast(&value, sizeof(int), 0);
      } else {
        bootstrap->allgather(&value, all.data(), sizeof(int));
      }
    } catch (ferry::BootstrapError const&) {
      try {
        bootstrap->barrier();
      } catch (ferry::BootstrapError const& later) {
        later_errors[rank] = later.what();
      }
      throw;
    }
  });
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_TRUE(outcomes[rank].threw_bootstrap_error) << "rank " << rank << ": " << outcomes[rank].error;
    EXPECT_NE(outcomes[rank].error.find("rank 1 called broadcast of 4 bytes from root 0"), std::string::npos)
        << outcomes[rank].error;
    EXPECT_NE(outcomes[rank].error.find("called allgather of 4 bytes per rank"), std::string::npos)
        << outcomes[rank].error;
    EXPECT_LT(outcomes[rank].seconds, 1.5);
    EXPECT_NE(later_errors[rank].find("already failed"), std::string::npos) << later_errors[rank];
  }
}

// ---- SocketBootstrap: rank cases (each runs in every rank process) ---------------------------------------------

int env_int_or(char const* name, int fallback) {
  char const* value = std::getenv(name);
  return value && *value ? std::atoi(value) : fallback;
}

int env_rank() {
  return env_int_or("RANK", -1);
}

uint64_t case_seed() {
  auto const& args = ferry::test::rank_case_args();
  return args.empty() ? 0 : std::stoull(args[0]);
}

// Runs fn, which must throw BootstrapError with every needle in its message, between min_s and max_s seconds after
// the start. Returns 0 then; otherwise prints why and returns 1 (so the parent test fails).
int expect_bootstrap_error(std::function<void()> const& fn, std::vector<std::string> const& needles, double min_s,
                           double max_s) {
  auto const start = Clock::now();
  try {
    fn();
  } catch (ferry::BootstrapError const& error) {
    double const seconds = seconds_since(start);
    std::string const message = error.what();
    std::fprintf(stderr, "rank %d: BootstrapError after %.2f s: %s\n", env_rank(), seconds, message.c_str());
    int status = 0;
    for (auto const& needle : needles) {
      if (message.find(needle) != std::string::npos) continue;
      std::fprintf(stderr, "rank %d: the message lacks \"%s\"\n", env_rank(), needle.c_str());
      status = 1;
    }
    if (message.rfind("bootstrap error (", 0) != 0) {
      std::fprintf(stderr, "rank %d: the message does not start with \"bootstrap error (\"\n", env_rank());
      status = 1;
    }
    if (seconds < min_s || seconds > max_s) {
      std::fprintf(stderr, "rank %d: %.2f s is outside the expected [%.2f, %.2f] s\n", env_rank(), seconds, min_s,
                   max_s);
      status = 1;
    }
    return status;
  } catch (std::exception const& error) {
    std::fprintf(stderr, "rank %d: expected BootstrapError, got another exception: %s\n", env_rank(), error.what());
    return 1;
  }
  std::fprintf(stderr, "rank %d: expected BootstrapError, nothing was thrown\n", env_rank());
  return 1;
}

std::unique_ptr<ferry::Bootstrap> bootstrap_from_env() {
  return ferry::make_socket_bootstrap(ferry::socket_bootstrap_options_from_env());
}

// Allgather (out of place and in place), broadcast from every root and barrier at several sizes, then many small
// operations back to back; every received byte is checked against what its sender must have sent.
FERRY_RANK_CASE(socket_collectives) {
  uint64_t const seed = case_seed();
  auto bootstrap = bootstrap_from_env();
  int const rank = bootstrap->rank();
  int const world = bootstrap->world();
  int num_failures = 0;
  auto const check = [&](bool ok, char const* what, int op_idx, int other) {
    if (!ok && num_failures++ < 10)
      std::fprintf(stderr, "rank %d: %s wrong at operation %d (rank/root %d)\n", rank, what, op_idx, other);
  };
  check(rank == env_rank(), "rank()", -1, rank);
  check(world == env_int_or("WORLD_SIZE", -1), "world()", -1, world);
  check(bootstrap->local_rank() == env_int_or("LOCAL_RANK", -1), "local_rank()", -1, bootstrap->local_rank());
  check(bootstrap->local_world() == world, "local_world()", -1, bootstrap->local_world());

  int op_idx = 0;
  for (std::size_t bytes : {std::size_t{0}, std::size_t{1}, std::size_t{13}, std::size_t{4096}, std::size_t{1} << 20}) {
    auto const mine = pattern(seed, rank, op_idx, bytes);
    std::vector<unsigned char> all(world * bytes, 0xEE);
    bootstrap->allgather(mine.data(), all.data(), bytes);
    for (int r = 0; r < world; ++r)
      check(ferry::test::same_bytes(all.data() + r * bytes, pattern(seed, r, op_idx, bytes).data(), bytes),
            "allgather block", op_idx, r);
    ++op_idx;

    std::vector<unsigned char> in_place(world * bytes, 0xEE);
    auto const mine2 = pattern(seed, rank, op_idx, bytes);
    std::copy(mine2.begin(), mine2.end(), in_place.begin() + rank * bytes);
    bootstrap->allgather(in_place.data() + rank * bytes, in_place.data(), bytes);
    for (int r = 0; r < world; ++r)
      check(ferry::test::same_bytes(in_place.data() + r * bytes, pattern(seed, r, op_idx, bytes).data(), bytes),
            "in-place allgather block", op_idx, r);
    ++op_idx;

    for (int root = 0; root < world; ++root) {
      auto const expected = pattern(seed, root, op_idx, bytes);
      std::vector<unsigned char> data = rank == root ? expected : std::vector<unsigned char>(bytes, 0xEE);
      bootstrap->broadcast(data.data(), bytes, root);
      check(data == expected, "broadcast data", op_idx, root);
      ++op_idx;
    }
    bootstrap->barrier();
  }

  // many small operations back to back: the sequence numbers and frames stay in step
  for (int i = 0; i < 300; ++i) {
    int64_t const value = int64_t{rank} * 1000003 + i + int64_t(seed % 1000);
    std::vector<int64_t> values(world, -1);
    bootstrap->allgather(&value, values.data(), sizeof(value));
    for (int r = 0; r < world; ++r)
      check(values[r] == int64_t{r} * 1000003 + i + int64_t(seed % 1000), "repeated allgather", i, r);
    if (i % 3 == 0) {
      int const root = i % world;
      int64_t data = rank == root ? value : -1;
      bootstrap->broadcast(&data, sizeof(data), root);
      check(data == int64_t{root} * 1000003 + i + int64_t(seed % 1000), "repeated broadcast", i, root);
    }
    if (i % 10 == 0) bootstrap->barrier();
  }
  return num_failures == 0 ? 0 : 1;
}

// Nobody leaves a barrier before the last rank entered it (steady_clock is CLOCK_MONOTONIC: one clock per host).
FERRY_RANK_CASE(socket_barrier_orders) {
  auto bootstrap = bootstrap_from_env();
  int const rank = bootstrap->rank();
  int const world = bootstrap->world();
  int num_failures = 0;
  for (int round = 0; round < 4; ++round) {
    std::this_thread::sleep_for(((rank + round) % world) * 30ms);
    int64_t const enter = Clock::now().time_since_epoch().count();
    bootstrap->barrier();
    int64_t const leave = Clock::now().time_since_epoch().count();
    std::vector<int64_t> enters(world);
    bootstrap->allgather(&enter, enters.data(), sizeof(enter));
    int64_t const last_enter = *std::max_element(enters.begin(), enters.end());
    if (leave < last_enter) {
      std::fprintf(stderr, "rank %d: left barrier %d %lld ns before the last rank entered it\n", rank, round,
                   static_cast<long long>(last_enter - leave));
      ++num_failures;
    }
  }
  return num_failures == 0 ? 0 : 1;
}

// The last rank never starts its bootstrap: the others fail at the deadline, naming it. (Rank 0 gives up 2 s after
// it started listening; the bounds leave room for the ranks starting a little apart.)
FERRY_RANK_CASE(socket_missing_rank) {
  int const world = env_int_or("WORLD_SIZE", -1);
  if (env_rank() == world - 1) return 0;
  std::string const needle = "rank " + std::to_string(world - 1) + " did not connect";
  return expect_bootstrap_error([] { bootstrap_from_env(); }, {needle, "WORLD_SIZE=" + std::to_string(world)}, 1.0,
                                5.0);
}

// Rank 2 joins but never calls the allgather the others call: they fail at the deadline, naming it.
FERRY_RANK_CASE(socket_missing_in_collective) {
  auto bootstrap = bootstrap_from_env();
  bootstrap->barrier();
  if (bootstrap->rank() == 2) {
    std::this_thread::sleep_for(3500ms);
    return 0;
  }
  int const value = bootstrap->rank();
  std::vector<int> all(bootstrap->world());
  return expect_bootstrap_error([&] { bootstrap->allgather(&value, all.data(), sizeof(int)); },
                                {"rank 2 did not arrive at allgather of 4 bytes per rank"}, 1.0, 5.0);
}

// Rank 2 dies while the others wait in an allgather: they fail at once (the timeout is 30 s), naming it.
FERRY_RANK_CASE(socket_rank_dies) {
  auto bootstrap = bootstrap_from_env();
  int const value = bootstrap->rank();
  std::vector<int> all(bootstrap->world());
  bootstrap->allgather(&value, all.data(), sizeof(int));
  if (bootstrap->rank() == 2) {
    std::this_thread::sleep_for(200ms);
    _exit(3);
  }
  return expect_bootstrap_error([&] { bootstrap->allgather(&value, all.data(), sizeof(int)); },
                                {"rank 2 closed its connection"}, 0.0, 3.0);
}

// Rank 2 dies at a random point of a stream of 2 MiB allgathers (sending, or receiving): the others still fail
// fast and name it.
FERRY_RANK_CASE(socket_rank_dies_mid_transfer) {
  auto bootstrap = bootstrap_from_env();
  int const world = bootstrap->world();
  constexpr std::size_t kBytes = std::size_t{2} << 20;
  std::vector<char> block(kBytes, static_cast<char>(bootstrap->rank()));
  std::vector<char> all(world * kBytes);
  bootstrap->barrier();
  if (bootstrap->rank() == 2) {
    std::thread([] {
      std::this_thread::sleep_for(std::chrono::milliseconds(20 + std::random_device{}() % 60));
      _exit(3);
    }).detach();
  }
  return expect_bootstrap_error(
      [&] {
        auto const start = Clock::now();
        while (seconds_since(start) < 10) bootstrap->allgather(block.data(), all.data(), kBytes);
      },
      {"rank 2"}, 0.0, 3.0);
}

// Rank 0 dies between operations: the others report that the master closed the connection, at once.
FERRY_RANK_CASE(socket_master_dies) {
  auto bootstrap = bootstrap_from_env();
  bootstrap->barrier();
  if (bootstrap->rank() == 0) {
    std::this_thread::sleep_for(200ms);
    _exit(4);
  }
  int const value = bootstrap->rank();
  std::vector<int> all(bootstrap->world());
  return expect_bootstrap_error([&] { bootstrap->allgather(&value, all.data(), sizeof(int)); },
                                {"rank 0 (master) closed the connection"}, 0.0, 3.0);
}

// Rank 2 calls broadcast where the others call allgather: everybody gets both calls named; later calls fail too.
FERRY_RANK_CASE(socket_mismatch) {
  auto bootstrap = bootstrap_from_env();
  bootstrap->barrier();
  int value = 7;
  std::vector<int> all(bootstrap->world());
  int status = expect_bootstrap_error(
      [&] {
        if (bootstrap->rank() == 2)
          bootstrap->broadcast(&value, sizeof(int), 1);
        else
          bootstrap->allgather(&value, all.data(), sizeof(int));
      },
      {"rank 2 called broadcast of 4 bytes from root 1", "rank 0 called allgather of 4 bytes per rank"}, 0.0, 3.0);
  status |=
      expect_bootstrap_error([&] { bootstrap->barrier(); }, {"already failed", "rank 2 called broadcast"}, 0.0, 0.5);
  return status;
}

// Rank 1 believes the world has 3 ranks; rank 0 has 2: both are told, with both numbers.
FERRY_RANK_CASE(socket_wrong_world) {
  auto options = ferry::socket_bootstrap_options_from_env();
  if (options.rank == 1) options.world = 3;
  return expect_bootstrap_error([&] { ferry::make_socket_bootstrap(options); },
                                {"rank 1 was started with WORLD_SIZE=3 but rank 0 has WORLD_SIZE=2"}, 0.0, 3.0);
}

// Ranks 1 and 2 both claim rank 1: everybody is told.
FERRY_RANK_CASE(socket_duplicate_rank) {
  auto options = ferry::socket_bootstrap_options_from_env();
  if (options.rank == 2) options.rank = 1;
  return expect_bootstrap_error([&] { ferry::make_socket_bootstrap(options); },
                                {"two processes connected as rank 1", "distinct RANK"}, 0.0, 3.0);
}

// ---- SocketBootstrap: tests ------------------------------------------------------------------------------------

ferry::test::RankCaseOptions case_options(int bootstrap_timeout_s, uint64_t seed = 0) {
  ferry::test::RankCaseOptions options;
  options.args = {std::to_string(seed)};
  options.env = {{"FERRY_BOOTSTRAP_TIMEOUT_S", std::to_string(bootstrap_timeout_s)}};
  options.timeout = 60s;
  return options;
}

// Expects exit code 0 from every rank except those listed.
void expect_exit_codes(ferry::LaunchResult const& result, int nproc, std::vector<std::pair<int, int>> const& special) {
  ASSERT_EQ(result.ranks.size(), static_cast<std::size_t>(nproc));
  EXPECT_FALSE(result.timed_out);
  for (int rank = 0; rank < nproc; ++rank) {
    int expected = 0;
    for (auto const& [r, code] : special)
      if (r == rank) expected = code;
    EXPECT_EQ(result.ranks[rank].exit_code, expected) << "rank " << rank << "\n" << result.describe();
  }
}

class SocketBootstrapWorld : public testing::TestWithParam<int> {};

TEST_P(SocketBootstrapWorld, CollectivesDeliverEveryBlock) {
  int const world = GetParam();
  auto const result =
      ferry::test::run_rank_case("socket_collectives", world, case_options(30, ferry::test::test_seed()));
  expect_exit_codes(result, world, {});
}

INSTANTIATE_TEST_SUITE_P(Worlds, SocketBootstrapWorld, testing::Values(1, 2, 4, 8));

TEST(SocketBootstrap, BarrierWaitsForTheLastRank) {
  expect_exit_codes(ferry::test::run_rank_case("socket_barrier_orders", 4, case_options(30)), 4, {});
}

TEST(SocketBootstrap, MissingRankIsNamedAtTheDeadline) {
  expect_exit_codes(ferry::test::run_rank_case("socket_missing_rank", 4, case_options(2)), 4, {});
}

TEST(SocketBootstrap, RankMissingFromACollectiveIsNamed) {
  expect_exit_codes(ferry::test::run_rank_case("socket_missing_in_collective", 3, case_options(2)), 3, {});
}

TEST(SocketBootstrap, RankDyingInAllgatherIsNamedQuickly) {
  auto const start = Clock::now();
  expect_exit_codes(ferry::test::run_rank_case("socket_rank_dies", 4, case_options(30)), 4, {{2, 3}});
  // the launcher would let the others run 5 s after rank 2 failed; they must have ended by themselves
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(SocketBootstrap, RankDyingMidTransferIsNamedQuickly) {
  auto const start = Clock::now();
  expect_exit_codes(ferry::test::run_rank_case("socket_rank_dies_mid_transfer", 4, case_options(30)), 4, {{2, 3}});
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(SocketBootstrap, MasterDyingIsReportedQuickly) {
  auto const start = Clock::now();
  expect_exit_codes(ferry::test::run_rank_case("socket_master_dies", 3, case_options(30)), 3, {{0, 4}});
  EXPECT_LT(seconds_since(start), 5.0);
}

TEST(SocketBootstrap, MismatchedCallsAreNamed) {
  expect_exit_codes(ferry::test::run_rank_case("socket_mismatch", 3, case_options(30)), 3, {});
}

TEST(SocketBootstrap, WrongWorldSizeIsRejected) {
  expect_exit_codes(ferry::test::run_rank_case("socket_wrong_world", 2, case_options(30)), 2, {});
}

TEST(SocketBootstrap, DuplicateRankIsRejected) {
  expect_exit_codes(ferry::test::run_rank_case("socket_duplicate_rank", 3, case_options(30)), 3, {});
}

// In-process tests (no peers needed, or a hand-made peer).

ferry::SocketBootstrapOptions loopback_options(int rank, int world, int port, std::chrono::milliseconds timeout) {
  ferry::SocketBootstrapOptions options;
  options.master_addr = "127.0.0.1";
  options.master_port = port;
  options.rank = rank;
  options.world = world;
  options.local_rank = rank;
  options.local_world = world;
  options.timeout = timeout;
  return options;
}

TEST(SocketBootstrap, WorldOfOneWorksAlone) {
  auto bootstrap = ferry::make_socket_bootstrap(loopback_options(0, 1, 1, 1s));
  int const value = 42;
  int out = 0;
  bootstrap->allgather(&value, &out, sizeof(int));
  EXPECT_EQ(out, 42);
  int data = 5;
  bootstrap->broadcast(&data, sizeof(int), 0);
  EXPECT_EQ(data, 5);
  EXPECT_NO_THROW(bootstrap->barrier());
  EXPECT_THROW(bootstrap->broadcast(&data, sizeof(int), 1), ferry::InputError);
}

TEST(SocketBootstrap, RejectsBadOptions) {
  EXPECT_THROW(ferry::make_socket_bootstrap(loopback_options(0, 0, 29500, 1s)), ferry::BootstrapError);
  EXPECT_THROW(ferry::make_socket_bootstrap(loopback_options(2, 2, 29500, 1s)), ferry::BootstrapError);
  EXPECT_THROW(ferry::make_socket_bootstrap(loopback_options(-1, 2, 29500, 1s)), ferry::BootstrapError);
  EXPECT_THROW(ferry::make_socket_bootstrap(loopback_options(1, 2, 0, 1s)), ferry::BootstrapError);
  EXPECT_THROW(ferry::make_socket_bootstrap(loopback_options(1, 2, 70000, 1s)), ferry::BootstrapError);
  EXPECT_THROW(ferry::make_socket_bootstrap(loopback_options(1, 2, 29500, 0ms)), ferry::BootstrapError);
  auto options = loopback_options(1, 2, 29500, 1s);
  options.local_rank = 2;
  EXPECT_THROW(ferry::make_socket_bootstrap(options), ferry::BootstrapError);
}

// Nobody listens: the connect retries end at the deadline with what to check.
TEST(SocketBootstrap, ConnectTimeoutSaysWhatToCheck) {
  int const port = ferry::pick_free_port();
  auto const start = Clock::now();
  try {
    ferry::make_socket_bootstrap(loopback_options(1, 2, port, 500ms));
    ADD_FAILURE() << "connected to a port nobody listens on";
  } catch (ferry::BootstrapError const& error) {
    std::string const message = error.what();
    EXPECT_NE(message.find("could not connect to rank 0 (master) at 127.0.0.1:" + std::to_string(port)),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("Connection refused"), std::string::npos) << message;
    EXPECT_NE(message.find("MASTER_ADDR/MASTER_PORT"), std::string::npos) << message;
  }
  EXPECT_GE(seconds_since(start), 0.45);
  EXPECT_LT(seconds_since(start), 3.0);
}

TEST(SocketBootstrap, PortInUseSaysPickAnother) {
  int const fd = socket(AF_INET, SOCK_STREAM, 0);
  ASSERT_GE(fd, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0);
  ASSERT_EQ(listen(fd, 1), 0);
  ASSERT_EQ(getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len), 0);
  int const port = ntohs(addr.sin_port);
  try {
    ferry::make_socket_bootstrap(loopback_options(0, 2, port, 1s));
    ADD_FAILURE() << "rank 0 listened on a port already in use";
  } catch (ferry::BootstrapError const& error) {
    EXPECT_NE(std::string(error.what()).find("pick another MASTER_PORT"), std::string::npos) << error.what();
  }
  close(fd);
}

// A process that is not a Ferry rank connects to rank 0's port: rank 0 refuses it, says so, and tells it why.
TEST(SocketBootstrap, ForeignConnectionIsRejected) {
  int const port = ferry::pick_free_port();
  std::string master_error;
  std::thread master([&] {
    try {
      ferry::make_socket_bootstrap(loopback_options(0, 2, port, 5s));
    } catch (ferry::BootstrapError const& error) {
      master_error = error.what();
    }
  });
  // connect (rank 0 may not be listening yet) and send a frame's worth of garbage
  int fd = -1;
  auto const start = Clock::now();
  while (seconds_since(start) < 4) {
    fd = socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in addr{};
    addr.sin_family = AF_INET;
    addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    addr.sin_port = htons(static_cast<uint16_t>(port));
    if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) break;
    close(fd);
    fd = -1;
    std::this_thread::sleep_for(10ms);
  }
  ASSERT_GE(fd, 0) << "could not connect to rank 0";
  std::string const garbage(48, 'x');
  ASSERT_EQ(send(fd, garbage.data(), garbage.size(), MSG_NOSIGNAL), static_cast<ssize_t>(garbage.size()));
  std::string answer;
  char buf[4096];
  for (ssize_t n; (n = recv(fd, buf, sizeof(buf), 0)) > 0;) answer.append(buf, static_cast<std::size_t>(n));
  close(fd);
  master.join();
  EXPECT_NE(master_error.find("not a Ferry rank"), std::string::npos) << master_error;
  EXPECT_NE(master_error.find("MASTER_PORT"), std::string::npos) << master_error;
  // the answer is an abort frame whose text is the same reason
  EXPECT_NE(answer.find("not a Ferry rank"), std::string::npos) << answer.size() << " bytes";
}

// ---- two jobs, one port --------------------------------------------------------------------------------------

// One rank of a job started by hand, on a thread: its bootstrap (made in the thread), or what that threw.
class HandRank {
 public:
  explicit HandRank(ferry::SocketBootstrapOptions const& options)
      : thread_([this, options] {
          try {
            bootstrap_ = ferry::make_socket_bootstrap(options);
          } catch (ferry::BootstrapError const& error) {
            error_ = error.what();
          }
        }) {}
  ~HandRank() {
    if (thread_.joinable()) thread_.join();
  }
  // Waits for the rendezvous to end; the bootstrap, or null with error() saying why.
  ferry::Bootstrap* joined() {
    if (thread_.joinable()) thread_.join();
    return bootstrap_.get();
  }
  std::string const& error() {
    joined();
    return error_;
  }

 private:
  std::unique_ptr<ferry::Bootstrap> bootstrap_;
  std::string error_;
  std::thread thread_;
};

ferry::SocketBootstrapOptions job_rank(int rank, int port, std::string const& run_id,
                                       std::chrono::milliseconds timeout) {
  auto options = loopback_options(rank, 2, port, timeout);
  options.run_id = run_id;
  return options;
}

// The ranks of the jobs that are made, each on its thread, allgather a value that names its job and rank (job 0xA0:
// 0xA0, 0xA1; job 0xB0: 0xB0, 0xB1). Returns, per rank, the values it got, or its error.
std::vector<std::string> job_allgathers(std::vector<std::pair<ferry::Bootstrap*, int>> const& ranks) {
  std::vector<std::string> out(ranks.size());
  std::vector<std::thread> threads;
  for (std::size_t i = 0; i < ranks.size(); ++i)
    threads.emplace_back([&, i] {
      int const mine = ranks[i].second;
      std::vector<int> all(2, -1);
      try {
        ranks[i].first->allgather(&mine, all.data(), sizeof(int));
        char text[32];
        std::snprintf(text, sizeof(text), "%X %X", all[0], all[1]);
        out[i] = text;
      } catch (ferry::BootstrapError const& error) {
        out[i] = std::string("BootstrapError: ") + error.what();
      }
    });
  for (auto& thread : threads) thread.join();
  return out;
}

// Two jobs of 2 ranks on one port with run ids (torchrun's TORCHELASTIC_RUN_ID), ranks started by hand in the order
// that mixed them before: job B's rank 1 connects to job A's rank 0 first. It is refused (another run id) and A's
// rendezvous goes on; B's rank 0 finds the port held and is told by whom; A meets its own rank 1 and computes with
// its own ranks only. Before, B's rank 1 became A's rank 1, and A's allgather returned B's value.
// Checked to fail: with is_other_job's refusal taken out of the rendezvous, B's rank 1 joined job A ("no error").
TEST(SocketBootstrap, TwoJobsWithRunIdsNeverMeet) {
  int const port = ferry::pick_free_port();
  std::string const held = "MASTER_PORT=" + std::to_string(port) + " is held by another Ferry job";
  HandRank a0(job_rank(0, port, "job-a", 5s));
  HandRank b1(job_rank(1, port, "job-b", 5s));
  EXPECT_EQ(b1.joined(), nullptr) << "job B's rank 1 joined job A";
  for (std::string const& part : {std::string("rank 1 (WORLD_SIZE=2, TORCHELASTIC_RUN_ID=job-b) could not join"), held,
                                  std::string("TORCHELASTIC_RUN_ID=job-a"), std::string("its own MASTER_PORT")})
    EXPECT_TRUE(ferry::test::contains(b1.error(), part)) << part << " not in: " << b1.error();
  HandRank b0(job_rank(0, port, "job-b", 5s));
  EXPECT_EQ(b0.joined(), nullptr) << "job B's rank 0 listened on a held port";
  EXPECT_TRUE(ferry::test::contains(b0.error(), "rank 0 could not listen on MASTER_PORT=" + std::to_string(port)))
      << b0.error();
  EXPECT_TRUE(ferry::test::contains(b0.error(), held)) << b0.error();
  HandRank a1(job_rank(1, port, "job-a", 5s));
  ASSERT_NE(a0.joined(), nullptr) << a0.error();
  ASSERT_NE(a1.joined(), nullptr) << a1.error();
  for (std::string const& got : job_allgathers({{a0.joined(), 0xA0}, {a1.joined(), 0xA1}})) EXPECT_EQ(got, "A0 A1");
}

// Without run ids (ranks started by hand, MASTER_PORT as the default): a job started after another's rendezvous
// window is refused, both its ranks, naming the job that holds the port; the running job goes on. Before, rank 0 had
// closed the port after the rendezvous, and the second job met on it.
// Checked to fail: with the port closed after the rendezvous (no doorman), job B's two ranks met on it (both made
// their bootstrap: "b0.joined() Which is: 0x7fc0d4000da0").
TEST(SocketBootstrap, ALaterJobOnAHeldPortIsRefused) {
  int const port = ferry::pick_free_port();
  HandRank a0(job_rank(0, port, "", 1s));
  HandRank a1(job_rank(1, port, "", 1s));
  ASSERT_NE(a0.joined(), nullptr) << a0.error();
  ASSERT_NE(a1.joined(), nullptr) << a1.error();
  std::this_thread::sleep_for(1200ms);  // past job A's rendezvous window (rank 0's start + 1 s)
  HandRank b0(job_rank(0, port, "", 1s));
  HandRank b1(job_rank(1, port, "", 1s));
  EXPECT_EQ(b0.joined(), nullptr);
  EXPECT_EQ(b1.joined(), nullptr);
  std::string const running = "MASTER_PORT=" + std::to_string(port) +
                              " is held by another Ferry job, which is running (rank 0 is process " +
                              std::to_string(getpid());
  EXPECT_TRUE(ferry::test::contains(b0.error(), running)) << b0.error();
  EXPECT_TRUE(ferry::test::contains(b1.error(), running)) << b1.error();
  EXPECT_TRUE(ferry::test::contains(b1.error(), "TORCHELASTIC_RUN_ID unset) could not join")) << b1.error();
  EXPECT_NO_THROW(a0.joined()->check_alive());
  EXPECT_NO_THROW(a1.joined()->check_alive());
  for (std::string const& got : job_allgathers({{a0.joined(), 0xA0}, {a1.joined(), 0xA1}})) EXPECT_EQ(got, "A0 A1");
}

// Without run ids, in the order that mixed the jobs in 5 of 6 trials: B's rank 1 reaches A's rank 0 first and is
// taken as A's rank 1 (nothing tells them apart). The clash shows when B's rank 0 finds the port held and asks who
// holds it, and again when A's own rank 1 asks for a rank A already has: within A's rendezvous window, so A stops on
// every rank (its collectives and check_alive raise the clash), and B's rank 0 and A's rank 1 are refused with it.
// No job computes: before, A (with B's rank 1) and B (with A's rank 1) both met and returned each other's values.
// Checked to fail: with stop_job's abort taken out, A's rank 0 and B's rank 1 allgathered "A0 B1".
TEST(SocketBootstrap, InterleavedJobsWithoutRunIdsStopInsteadOfMixing) {
  int const port = ferry::pick_free_port();
  HandRank a0(job_rank(0, port, "", 10s));
  HandRank b1(job_rank(1, port, "", 10s));
  ASSERT_NE(b1.joined(), nullptr) << b1.error();  // indistinguishable from A's rank 1: it joins job A
  ASSERT_NE(a0.joined(), nullptr) << a0.error();
  HandRank b0(job_rank(0, port, "", 10s));
  HandRank a1(job_rank(1, port, "", 10s));
  std::string const clash = "two jobs share MASTER_PORT=" + std::to_string(port);
  EXPECT_EQ(b0.joined(), nullptr);
  EXPECT_TRUE(ferry::test::contains(b0.error(), clash)) << b0.error();
  EXPECT_EQ(a1.joined(), nullptr);
  EXPECT_TRUE(ferry::test::contains(a1.error(), clash)) << a1.error();
  // the stopped job's ranks learn it between collectives too (an EpBuffer call checks), within a second
  auto const start = Clock::now();
  std::string alive_error;
  while (alive_error.empty() && seconds_since(start) < 2) {
    try {
      b1.joined()->check_alive();
    } catch (ferry::BootstrapError const& error) {
      alive_error = error.what();
    }
    std::this_thread::sleep_for(10ms);
  }
  EXPECT_TRUE(ferry::test::contains(alive_error, clash)) << alive_error;
  EXPECT_THROW(a0.joined()->check_alive(), ferry::BootstrapError);
  for (std::string const& got : job_allgathers({{a0.joined(), 0xA0}, {b1.joined(), 0xB1}}))
    EXPECT_TRUE(ferry::test::contains(got, "BootstrapError") && ferry::test::contains(got, clash)) << got;
}

// ---- socket_bootstrap_options_from_env -------------------------------------------------------------------------

// Sets (or, for nullopt, unsets) variables for the scope and restores them after.
class EnvGuard {
 public:
  explicit EnvGuard(std::vector<std::pair<std::string, std::optional<std::string>>> const& values) {
    for (auto const& [name, value] : values) {
      char const* old = std::getenv(name.c_str());
      saved_.emplace_back(name, old ? std::optional<std::string>(old) : std::nullopt);
      if (value)
        setenv(name.c_str(), value->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
  }
  ~EnvGuard() {
    for (auto const& [name, value] : saved_) {
      if (value)
        setenv(name.c_str(), value->c_str(), 1);
      else
        unsetenv(name.c_str());
    }
  }

 private:
  std::vector<std::pair<std::string, std::optional<std::string>>> saved_;
};

std::vector<std::pair<std::string, std::optional<std::string>>> torchrun_env(
    std::vector<std::pair<std::string, std::optional<std::string>>> const& changes) {
  std::vector<std::pair<std::string, std::optional<std::string>>> env = {{"MASTER_ADDR", "10.1.2.3"},
                                                                         {"MASTER_PORT", "1234"},
                                                                         {"RANK", "5"},
                                                                         {"WORLD_SIZE", "8"},
                                                                         {"LOCAL_RANK", "1"},
                                                                         {"LOCAL_WORLD_SIZE", "4"},
                                                                         {"FERRY_BOOTSTRAP_TIMEOUT_S", "7"}};
  for (auto const& [name, value] : changes)
    for (auto& entry : env)
      if (entry.first == name) entry.second = value;
  return env;
}

std::string env_error(std::vector<std::pair<std::string, std::optional<std::string>>> const& changes) {
  EnvGuard guard(torchrun_env(changes));
  try {
    ferry::socket_bootstrap_options_from_env();
  } catch (ferry::BootstrapError const& error) {
    return error.what();
  }
  return "(no BootstrapError)";
}

TEST(SocketBootstrapEnv, ReadsTheTorchrunVariables) {
  EnvGuard guard(torchrun_env({}));
  auto const options = ferry::socket_bootstrap_options_from_env();
  EXPECT_EQ(options.master_addr, "10.1.2.3");
  EXPECT_EQ(options.master_port, 1234);
  EXPECT_EQ(options.rank, 5);
  EXPECT_EQ(options.world, 8);
  EXPECT_EQ(options.local_rank, 1);
  EXPECT_EQ(options.local_world, 4);
  EXPECT_EQ(options.timeout, 7s);
  EXPECT_EQ(options.run_id, "");
  EnvGuard const run_id(
      std::vector<std::pair<std::string, std::optional<std::string>>>{{"TORCHELASTIC_RUN_ID", "job-7"}});
  EXPECT_EQ(ferry::socket_bootstrap_options_from_env().run_id, "job-7");
}

TEST(SocketBootstrapEnv, DefaultsForTheOptionalVariables) {
  EnvGuard guard(torchrun_env({{"MASTER_ADDR", std::nullopt},
                               {"MASTER_PORT", std::nullopt},
                               {"LOCAL_WORLD_SIZE", std::nullopt},
                               {"FERRY_BOOTSTRAP_TIMEOUT_S", std::nullopt}}));
  auto const options = ferry::socket_bootstrap_options_from_env();
  EXPECT_EQ(options.master_addr, "127.0.0.1");
  EXPECT_EQ(options.master_port, 29500);
  EXPECT_EQ(options.local_world, 8);
  EXPECT_EQ(options.timeout, 60s);
}

TEST(SocketBootstrapEnv, MissingOrMalformedVariablesAreNamed) {
  EXPECT_NE(env_error({{"RANK", std::nullopt}}).find("RANK is not set"), std::string::npos);
  EXPECT_NE(env_error({{"WORLD_SIZE", std::nullopt}}).find("WORLD_SIZE is not set"), std::string::npos);
  EXPECT_NE(env_error({{"LOCAL_RANK", std::nullopt}}).find("LOCAL_RANK is not set"), std::string::npos);
  EXPECT_NE(env_error({{"RANK", "two"}}).find("RANK=two is not a whole number"), std::string::npos);
  EXPECT_NE(env_error({{"MASTER_PORT", "12ab"}}).find("MASTER_PORT=12ab is not a whole number"), std::string::npos);
  EXPECT_NE(env_error({{"RANK", "8"}}).find("rank=8 is outside [0, world=8); check RANK and WORLD_SIZE"),
            std::string::npos);
  EXPECT_NE(env_error({{"MASTER_PORT", "70000"}}).find("check MASTER_PORT"), std::string::npos);
  EXPECT_NE(env_error({{"LOCAL_RANK", "4"}}).find("check LOCAL_RANK and LOCAL_WORLD_SIZE"), std::string::npos);
  EXPECT_NE(
      env_error({{"FERRY_BOOTSTRAP_TIMEOUT_S", "0"}})
          .find("FERRY_BOOTSTRAP_TIMEOUT_S=0 is outside [1, 1000000000]: it must be a positive number of seconds"),
      std::string::npos);
}

}  // namespace
