// Ending host waits early (include/ferry/interrupt.hpp): with an interrupt check set, a wait for a peer that never
// comes ends within about a second of the check saying so, with ferry::Interrupted, leaving what it waited in as
// docs/errors.md says: the cpu communicator failed (a barrier, a low-latency exchange), the socket bootstrap failed
// and its other ranks told, the launcher's ranks killed. Without a check, nothing changes: a SIGINT ends a C++ rank
// process as usual. Before, such a wait lasted until FERRY_TIMEOUT_S (28 s seen from Python).
// Checked to fail: with the check taken out of the cpu backend's waits (wait_words, agree, the barrier), the
// low-latency wait ran its whole bound (FERRY_TIMEOUT_S=4) and then masked rank 1 ("dispatch: no error").
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "core/launcher.hpp"
#include "ep/reference.hpp"
#include "ferry/bootstrap.hpp"
#include "ferry/communicator.hpp"
#include "ferry/ep.hpp"
#include "ferry/error.hpp"
#include "ferry/interrupt.hpp"
#include "support/cpu_ranks.hpp"
#include "support/host_fixtures.hpp"
#include "support/rank_case.hpp"

namespace ferry::test {
namespace {

using Clock = std::chrono::steady_clock;

// The check the tests set: true once `at` has passed (a signal that came then).
std::atomic<int64_t> g_interrupt_at{INT64_MAX};
bool interrupt_after() {
  return Clock::now().time_since_epoch().count() >= g_interrupt_at.load();
}

// Sets the check for the scope, asking waits to end `after` from now.
class ScopedInterrupt {
 public:
  explicit ScopedInterrupt(std::chrono::milliseconds after) : start_(Clock::now()) {
    g_interrupt_at = (start_ + after).time_since_epoch().count();
    set_interrupt_check(&interrupt_after);
  }
  ~ScopedInterrupt() {
    set_interrupt_check(nullptr);
    g_interrupt_at = INT64_MAX;
  }
  // seconds from the moment the check first says stop
  double since_interrupt() const {
    return std::chrono::duration<double>(Clock::now() - Clock::time_point(Clock::duration(g_interrupt_at.load())))
        .count();
  }

 private:
  Clock::time_point start_;
};

// Rank 0 waits in a low-latency exchange (rank masking: the buffer's own waits) and in the communicator's barrier
// for rank 1, which never comes: each wait ends within a second of the check, with Interrupted, and the communicator
// says it failed at every later call.
TEST(Interrupt, CpuWaitsForALatePeerEndSoon) {
  ScopedEnv const timeout("FERRY_TIMEOUT_S", std::string("4"));
  for (bool barrier : {false, true}) {
    std::atomic<bool> done{false};
    std::vector<std::string> const failures = run_cpu_ranks(2, [&](int rank,
                                                                   std::shared_ptr<Communicator> const& comm) {
      EpBuffer buffer(comm, small_masked_ll_config());
      if (rank == 1) {  // never comes to the call; stays until rank 0 is done so that its memory stays mapped
        while (!done) std::this_thread::sleep_for(std::chrono::milliseconds(5));
        return;
      }
      ScopedInterrupt const interrupt(std::chrono::milliseconds(300));
      ref::RankInput in;
      in.num_tokens = 1;
      in.x.assign(64, 0);
      in.topk_idx = {0, 2};
      in.topk_weights = {0.5f, 0.5f};
      std::string const problem = expect_error<Interrupted>(
          [&] {
            if (barrier)
              comm->barrier();
            else
              buffer.dispatch(host_dispatch_args(in));
          },
          {"was interrupted", "create a new one"});
      double const late = interrupt.since_interrupt();
      done = true;
      FERRY_CHECK(problem.empty(), barrier ? "barrier: " : "dispatch: ", problem);
      FERRY_CHECK(late < 1.0, "the wait ended ", late, " s after the check asked");
      FERRY_CHECK(comm->failed(), "the communicator is not failed after the interrupted wait");
      FERRY_CHECK(expect_error<Error>([&] { comm->barrier(); }, {"communicator failed earlier", "interrupted"}).empty(),
                  "a later call does not say the communicator failed");
    });
    for (int r = 0; r < 2; ++r) EXPECT_EQ(failures[static_cast<std::size_t>(r)], "") << "rank " << r;
  }
}

// The socket bootstrap: rank 0 waiting for a rank that never connects, and a collective whose peer never calls.
TEST(Interrupt, BootstrapWaitsEndSoon) {
  SocketBootstrapOptions options;
  options.master_port = pick_free_port();
  options.world = 2;
  options.local_world = 2;
  options.timeout = std::chrono::seconds(30);
  {
    ScopedInterrupt const interrupt(std::chrono::milliseconds(300));
    EXPECT_EQ(expect_error<Interrupted>([&] { make_socket_bootstrap(options); }, {"interrupted"}), "");
    EXPECT_LT(interrupt.since_interrupt(), 1.0);
  }
  // a collective: rank 1 joins, then never calls; rank 0's allgather is interrupted, and rank 1 is told
  options.master_port = pick_free_port();
  std::unique_ptr<Bootstrap> rank1;
  std::thread joiner([&] {
    SocketBootstrapOptions mine = options;
    mine.rank = 1;
    mine.local_rank = 1;
    rank1 = make_socket_bootstrap(mine);
  });
  std::unique_ptr<Bootstrap> rank0 = make_socket_bootstrap(options);
  joiner.join();
  ScopedInterrupt const interrupt(std::chrono::milliseconds(300));
  int const value = 0;
  int all[2];
  EXPECT_EQ(expect_error<Interrupted>([&] { rank0->allgather(&value, all, sizeof(int)); }, {"interrupted"}), "");
  EXPECT_LT(interrupt.since_interrupt(), 1.0);
  EXPECT_EQ(expect_error<BootstrapError>([&] { rank1->barrier(); }, {"rank 0 was interrupted"}), "");
}

// The launcher: its ranks (sleeping) are killed, and the wait ends.
TEST(Interrupt, LauncherWaitEndsAndItsRanksAreKilled) {
  LaunchOptions launch;
  launch.argv = {"/bin/sleep", "30"};
  launch.nproc = 2;
  ScopedInterrupt const interrupt(std::chrono::milliseconds(300));
  EXPECT_EQ(expect_error<Interrupted>([&] { launch_ranks(launch); }, {"every rank still running was killed"}), "");
  EXPECT_LT(interrupt.since_interrupt(), 1.0);
}

// Without a check (a C++ program), a SIGINT during a wait ends the rank process as usual: Ferry swallows nothing.
FERRY_RANK_CASE(interrupt_waits_for_a_late_peer) {
  std::shared_ptr<Communicator> const comm = connect_rank(Backend::cpu);
  if (comm->rank() == 1) {  // late past the signal, then gone
    std::this_thread::sleep_for(std::chrono::seconds(3));
    return 0;
  }
  std::thread([] {
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
    kill(getpid(), SIGINT);
  }).detach();
  comm->barrier();  // waits for rank 1 until the signal ends the process
  return 3;
}

TEST(Interrupt, WithoutACheckSigintEndsACppRankAsUsual) {
  RankCaseOptions options;
  options.env = {{"FERRY_TIMEOUT_S", "30"}};
  options.timeout = std::chrono::seconds(60);
  LaunchResult const result = run_rank_case("interrupt_waits_for_a_late_peer", 2, options);
  ASSERT_EQ(result.ranks.size(), 2u);
  EXPECT_EQ(result.ranks[0].signal, SIGINT) << result.describe();
  EXPECT_EQ(result.ranks[1].exit_code, 0) << result.describe();
}

}  // namespace
}  // namespace ferry::test
