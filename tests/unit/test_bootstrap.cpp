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

#include "ferry/bootstrap.hpp"
#include "ferry/error.hpp"

namespace {

using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

uint64_t fresh_seed() {
  uint64_t const seed = (uint64_t{std::random_device{}()} << 32) ^ std::random_device{}();
  std::printf("seed=%llu\n", static_cast<unsigned long long>(seed));
  return seed;
}

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
  uint64_t const seed = fresh_seed();
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
            if (std::memcmp(all.data() + r * bytes, pattern(seed, r, op_idx, bytes).data(), bytes) != 0)
              ++num_mismatches;
          ++op_idx;
          // allgather in place (send aliases recv + rank * bytes)
          std::vector<unsigned char> in_place(world * bytes, 0xEE);
          auto const mine2 = pattern(seed, rank, op_idx, bytes);
          std::copy(mine2.begin(), mine2.end(), in_place.begin() + rank * bytes);
          bootstrap->allgather(in_place.data() + rank * bytes, in_place.data(), bytes);
          for (int r = 0; r < world; ++r)
            if (std::memcmp(in_place.data() + r * bytes, pattern(seed, r, op_idx, bytes).data(), bytes) != 0)
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

}  // namespace
