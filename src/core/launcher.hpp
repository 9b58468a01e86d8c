// Starts one process per rank on this host (what `ferry` and the multi-GPU tests use), torchrun-style: each child
// gets MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, the NVLink-multicast safety
// variables, and OMP_NUM_THREADS=1 where it is unset. The first child that fails (or the deadline) ends the others, so
// a launch never hangs.
#pragma once

#include <chrono>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace ferry {

struct LaunchOptions {
  std::vector<std::string> argv;  // program and arguments, the same for every rank
  int nproc = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;                                   // 0: pick a free port
  std::vector<std::pair<std::string, std::string>> env;  // extra variables for every child
  std::chrono::milliseconds timeout{0};                  // 0: none; else SIGKILL everything past it
  // How long the others may run on after one child failed before they are killed, so that they report their own
  // error (a TimeoutError naming the rank that died comes within FERRY_TIMEOUT_S). None: default_grace().
  std::optional<std::chrono::milliseconds> grace;
};

// The grace of every launcher (`ferry launch`, `ferry bench`/`tune`/`p2p`, `python -m ferry.launch`): FERRY_TIMEOUT_S
// (read as the library reads it: ConfigError for a value it refuses) + 5 s.
std::chrono::milliseconds default_grace();

struct RankExit {
  int exit_code = -1;  // exit status, or -1 if killed by a signal
  int signal = 0;      // the signal that ended it, 0 if none
  bool killed_by_launcher = false;
};

struct LaunchResult {
  std::vector<RankExit> ranks;
  int first_failed = -1;  // the rank that failed first (the lowest of those reaped together), -1 if none failed
  bool timed_out = false;
  bool ok() const;
  // One line per failed rank ("rank 1: exit 3 (failed first)", "rank 0: killed by signal 9 (stopped by the
  // launcher)"), each starting with `prefix` (a launcher's "ferry launch: ").
  std::string describe(std::string const& prefix = "") const;
  // What a launcher exits with: 0 when ok, else the status of the rank that failed first (its exit code, or
  // 128 + signal), else (the deadline killed every rank) 128 + the signal.
  int exit_status() const;
};

// Blocks until every child has ended. Throws Error if a process cannot be started.
LaunchResult launch_ranks(LaunchOptions const& options);

// True when launch_ranks gives every rank OMP_NUM_THREADS=1: more than one rank, and neither this process's
// environment nor options.env sets it (an empty value counts as unset). Why, as torchrun does: each rank's OpenMP pool
// (torch on the cpu, BLAS) starts a thread per core, and N ranks of them on one host oversubscribe it many times over
// (the 2-rank training example ran 30x slower). The launchers print omp_threads_notice() then.
bool omp_threads_defaulted(LaunchOptions const& options);
std::string omp_threads_notice();

// A TCP port on 127.0.0.1 that was free a moment ago.
int pick_free_port();

// Path of the running executable (/proc/self/exe).
std::string self_executable();

// The variables that keep NVLink multicast off, set in every process Ferry starts (and by the cuda communicator).
void set_multicast_safety_env();

}  // namespace ferry
