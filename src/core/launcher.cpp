#include "core/launcher.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <optional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "core/interrupt.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"

namespace ferry {

namespace {
constexpr std::pair<char const*, char const*> kSafetyEnv[] = {
    {"NCCL_NVLS_ENABLE", "0"},
    {"NVSHMEM_DISABLE_NVLS", "1"},
    {"TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"},
};
}  // namespace

void set_multicast_safety_env() {
  for (auto const& [name, value] : kSafetyEnv) setenv(name, value, 1);
}

std::chrono::milliseconds default_grace() {
  return std::chrono::milliseconds(static_cast<int64_t>(1000 * (env_double("FERRY_TIMEOUT_S") + 5)));
}

bool LaunchResult::ok() const {
  if (timed_out) return false;
  for (auto const& rank : ranks)
    if (rank.exit_code != 0) return false;
  return true;
}

std::string LaunchResult::describe(std::string const& prefix) const {
  std::string out;
  if (timed_out) out += prefix + "the launch ran past its deadline and was killed\n";
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    RankExit const& rank = ranks[r];
    if (rank.exit_code == 0) continue;
    out += detail::concat(prefix, "rank ", r, ": ");
    if (rank.signal)
      out +=
          detail::concat("killed by signal ", rank.signal, rank.killed_by_launcher ? " (stopped by the launcher)" : "");
    else
      out += detail::concat("exit ", rank.exit_code);
    out += static_cast<int>(r) == first_failed ? " (failed first)\n" : "\n";
  }
  return out;
}

bool omp_threads_defaulted(LaunchOptions const& options) {
  if (options.nproc < 2) return false;
  char const* set = std::getenv("OMP_NUM_THREADS");
  if (set && *set) return false;
  for (auto const& [name, value] : options.env)
    if (name == "OMP_NUM_THREADS" && !value.empty()) return false;
  return true;
}

std::string omp_threads_notice() {
  return "OMP_NUM_THREADS=1 for each rank (it was unset): each rank's OpenMP pool would otherwise start a thread per "
         "core; set OMP_NUM_THREADS to choose another count";
}

int LaunchResult::exit_status() const {
  if (ok()) return 0;
  auto status = [](RankExit const& rank) {
    return rank.signal ? 128 + rank.signal : rank.exit_code > 0 ? rank.exit_code : 1;
  };
  if (first_failed >= 0) return status(ranks[static_cast<std::size_t>(first_failed)]);
  for (RankExit const& rank : ranks)
    if (rank.exit_code != 0) return status(rank);
  return 1;
}

namespace {

// True when a listening socket could bind `port` on every interface right now (rank 0 listens on all of them).
bool port_is_free(int port) {
  int const fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return false;
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  addr.sin_port = htons(static_cast<uint16_t>(port));
  bool const ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  close(fd);
  return ok;
}

// The kernel's ephemeral port range (ports it hands out for bind(0) and outgoing connections).
std::pair<int, int> ephemeral_range() {
  std::ifstream file("/proc/sys/net/ipv4/ip_local_port_range");
  int lo = 32768, hi = 60999;
  file >> lo >> hi;
  return {lo, hi};
}

}  // namespace

int pick_free_port() {
  // NOTE: below the ephemeral range: a port the kernel handed out once (bind to port 0) is handed out again to the
  // next bind(0) or outgoing connection, and NCCL opens many of those; between this check and rank 0's listen such
  // a socket took the port on the GPU machine. Ports below the range are never handed out by the kernel.
  auto const [lo, hi] = ephemeral_range();
  int const first = std::max(1024, lo - 16384);
  int const last = std::max(first, lo - 1);
  std::random_device seed;
  std::mt19937 random(seed());
  std::uniform_int_distribution<int> pick(first, last);
  for (int attempt = 0; attempt < 200; ++attempt) {
    int const port = pick(random);
    if (port_is_free(port)) return port;
  }
  FERRY_THROW(Error, "ferry", "could not find a free TCP port in [", first, ", ", last, "] (below the ephemeral range ",
              lo, "-", hi, "); set MASTER_PORT yourself");
}

std::string self_executable() {
  char path[PATH_MAX];
  ssize_t const n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  FERRY_CHECK(n > 0, "readlink(/proc/self/exe) failed: ", std::strerror(errno));
  return std::string(path, static_cast<std::size_t>(n));
}

namespace {

// The child's environment: the parent's, with name=value set (replacing an earlier value of name).
void set_env_entry(std::vector<std::string>& env, std::string const& name, std::string const& value) {
  std::string const prefix = name + "=";
  std::erase_if(env, [&](std::string const& entry) { return entry.compare(0, prefix.size(), prefix) == 0; });
  env.push_back(prefix + value);
}

// Ends and reaps the children started so far (a launch that cannot start every rank runs none).
void kill_started(std::vector<pid_t> const& pids) {
  for (pid_t const pid : pids)
    if (pid > 0) kill(pid, SIGKILL);
  for (pid_t const pid : pids)
    if (pid > 0) waitpid(pid, nullptr, 0);
}

}  // namespace

LaunchResult launch_ranks(LaunchOptions const& options) {
  FERRY_CHECK(options.nproc >= 1, "launch_ranks: nproc=", options.nproc, " must be at least 1");
  FERRY_CHECK(!options.argv.empty(), "launch_ranks: empty argv");
  std::chrono::milliseconds const grace = options.grace ? *options.grace : default_grace();
  int const port = options.master_port ? options.master_port : pick_free_port();

  // Build every child's argv and environment before forking: between fork and exec the child may only make
  // async-signal-safe calls (setenv or malloc there can deadlock when the parent has other threads, e.g. Python).
  std::vector<char*> argv;
  for (auto const& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
  argv.push_back(nullptr);
  std::vector<std::string> base_env;
  for (char** entry = environ; *entry; ++entry) base_env.emplace_back(*entry);
  if (omp_threads_defaulted(options)) set_env_entry(base_env, "OMP_NUM_THREADS", "1");
  std::vector<std::vector<std::string>> child_env(options.nproc);
  std::vector<std::vector<char*>> child_envp(options.nproc);
  for (int rank = 0; rank < options.nproc; ++rank) {
    std::vector<std::string>& env = child_env[rank];
    env = base_env;
    set_env_entry(env, "MASTER_ADDR", options.master_addr);
    set_env_entry(env, "MASTER_PORT", std::to_string(port));
    set_env_entry(env, "RANK", std::to_string(rank));
    set_env_entry(env, "WORLD_SIZE", std::to_string(options.nproc));
    set_env_entry(env, "LOCAL_RANK", std::to_string(rank));
    set_env_entry(env, "LOCAL_WORLD_SIZE", std::to_string(options.nproc));
    for (auto const& [name, value] : options.env) set_env_entry(env, name, value);
    for (auto const& [name, value] : kSafetyEnv) set_env_entry(env, name, value);
    for (auto& entry : env) child_envp[rank].push_back(entry.data());
    child_envp[rank].push_back(nullptr);
  }
  std::string const exec_failed = "ferry launcher: execve(" + options.argv[0] + ") failed for a rank\n";

  // What the launching process printed so far comes out before the ranks' output (stdio buffers are not flushed
  // across exec).
  std::fflush(nullptr);
  pid_t const parent = getpid();
  std::vector<pid_t> pids(options.nproc, -1);
  LaunchResult result;
  result.ranks.resize(options.nproc);
  for (int rank = 0; rank < options.nproc; ++rank) {
    pid_t const pid = fork();
    if (pid < 0) {
      int const error = errno;
      kill_started(pids);
      FERRY_THROW(Error, "ferry", "fork() failed for rank ", rank, ": ", std::strerror(error),
                  "; no rank was left running");
    }
    if (pid == 0) {
      // Child: die with the launcher, so a killed launcher (Ctrl-C, a test timeout) leaves no rank behind.
      prctl(PR_SET_PDEATHSIG, SIGKILL);
      if (getppid() != parent) _exit(126);  // the launcher died before prctl took effect
      execve(argv[0], argv.data(), child_envp[rank].data());
      ssize_t const ignored = write(STDERR_FILENO, exec_failed.data(), exec_failed.size());
      (void)ignored;
      _exit(127);
    }
    pids[rank] = pid;
  }

  using Clock = std::chrono::steady_clock;
  auto const start = Clock::now();
  std::optional<Clock::time_point> first_failure;
  int running = options.nproc;
  while (running > 0) {
    // Reap only this launch's children (waitpid(-1) would steal those of another launch or of the caller).
    bool reaped = false;
    for (int rank = 0; rank < options.nproc; ++rank) {
      if (pids[rank] <= 0) continue;
      int status = 0;
      pid_t const got = waitpid(pids[rank], &status, WNOHANG);
      if (got == 0 || (got < 0 && errno == EINTR)) continue;
      RankExit& exit = result.ranks[rank];
      if (got < 0) {
        // ECHILD: reaped behind our back (the caller ignores SIGCHLD); its status is lost, count it as failed
        exit.exit_code = -1;
      } else if (WIFEXITED(status)) {
        exit.exit_code = WEXITSTATUS(status);
      } else if (WIFSIGNALED(status)) {
        exit.exit_code = -1;
        exit.signal = WTERMSIG(status);
      }
      if (exit.exit_code != 0 && !first_failure) {
        first_failure = Clock::now();
        result.first_failed = rank;
      }
      pids[rank] = -1;
      --running;
      reaped = true;
    }
    if (reaped) continue;
    auto const now = Clock::now();
    bool const past_deadline = options.timeout.count() > 0 && now - start > options.timeout;
    bool const past_grace = first_failure && now - *first_failure > grace;
    if (past_deadline || past_grace) {
      result.timed_out = result.timed_out || past_deadline;
      for (int rank = 0; rank < options.nproc; ++rank) {
        if (pids[rank] <= 0) continue;
        kill(pids[rank], SIGKILL);
        result.ranks[rank].killed_by_launcher = true;
      }
    }
    if (detail::interrupt_requested()) {  // a signal the caller asked to end waits for (include/ferry/interrupt.hpp)
      kill_started(pids);
      FERRY_THROW(Interrupted, "launch",
                  "interrupted (a signal: KeyboardInterrupt in Python) while waiting for the ranks; every rank "
                  "still running was killed");
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return result;
}

}  // namespace ferry
