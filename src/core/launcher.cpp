#include "core/launcher.hpp"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cerrno>
#include <climits>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <thread>

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

bool LaunchResult::ok() const {
  if (timed_out) return false;
  for (auto const& rank : ranks)
    if (rank.exit_code != 0) return false;
  return true;
}

std::string LaunchResult::describe() const {
  std::string out;
  if (timed_out) out += "the launch ran past its deadline and was killed\n";
  for (std::size_t r = 0; r < ranks.size(); ++r) {
    RankExit const& rank = ranks[r];
    if (rank.exit_code == 0) continue;
    out += detail::concat("rank ", r, ": ");
    if (rank.signal)
      out +=
          detail::concat("killed by signal ", rank.signal, rank.killed_by_launcher ? " (stopped by the launcher)" : "");
    else
      out += detail::concat("exit ", rank.exit_code);
    out += "\n";
  }
  return out;
}

int pick_free_port() {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  FERRY_CHECK(fd >= 0, "socket() failed: ", std::strerror(errno));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = 0;
  socklen_t len = sizeof(addr);
  bool const ok = bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0 &&
                  getsockname(fd, reinterpret_cast<sockaddr*>(&addr), &len) == 0;
  close(fd);
  FERRY_CHECK(ok, "could not find a free TCP port on 127.0.0.1: ", std::strerror(errno));
  return ntohs(addr.sin_port);
}

std::string self_executable() {
  char path[PATH_MAX];
  ssize_t const n = readlink("/proc/self/exe", path, sizeof(path) - 1);
  FERRY_CHECK(n > 0, "readlink(/proc/self/exe) failed: ", std::strerror(errno));
  return std::string(path, static_cast<std::size_t>(n));
}

LaunchResult launch_ranks(LaunchOptions const& options) {
  FERRY_CHECK(options.nproc >= 1, "launch_ranks: nproc=", options.nproc, " must be at least 1");
  FERRY_CHECK(!options.argv.empty(), "launch_ranks: empty argv");
  int const port = options.master_port ? options.master_port : pick_free_port();

  std::vector<pid_t> pids(options.nproc, -1);
  LaunchResult result;
  result.ranks.resize(options.nproc);
  for (int rank = 0; rank < options.nproc; ++rank) {
    pid_t const pid = fork();
    FERRY_CHECK(pid >= 0, "fork() failed for rank ", rank, ": ", std::strerror(errno));
    if (pid == 0) {
      // Child: its own process group is not needed; the launcher tracks pids. Die with the parent.
      setenv("MASTER_ADDR", options.master_addr.c_str(), 1);
      setenv("MASTER_PORT", std::to_string(port).c_str(), 1);
      setenv("RANK", std::to_string(rank).c_str(), 1);
      setenv("WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
      setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
      setenv("LOCAL_WORLD_SIZE", std::to_string(options.nproc).c_str(), 1);
      for (auto const& [name, value] : options.env) setenv(name.c_str(), value.c_str(), 1);
      set_multicast_safety_env();
      std::vector<char*> argv;
      for (auto const& arg : options.argv) argv.push_back(const_cast<char*>(arg.c_str()));
      argv.push_back(nullptr);
      execv(argv[0], argv.data());
      std::fprintf(stderr, "ferry launcher: execv(%s) failed for rank %d: %s\n", argv[0], rank, std::strerror(errno));
      _exit(127);
    }
    pids[rank] = pid;
  }

  using Clock = std::chrono::steady_clock;
  auto const start = Clock::now();
  std::optional<Clock::time_point> first_failure;
  int running = options.nproc;
  while (running > 0) {
    int status = 0;
    pid_t const pid = waitpid(-1, &status, WNOHANG);
    if (pid > 0) {
      for (int rank = 0; rank < options.nproc; ++rank) {
        if (pids[rank] != pid) continue;
        RankExit& exit = result.ranks[rank];
        if (WIFEXITED(status)) {
          exit.exit_code = WEXITSTATUS(status);
        } else if (WIFSIGNALED(status)) {
          exit.exit_code = -1;
          exit.signal = WTERMSIG(status);
        }
        if (exit.exit_code != 0 && !first_failure) first_failure = Clock::now();
        pids[rank] = -1;
        --running;
      }
      continue;
    }
    auto const now = Clock::now();
    bool const past_deadline = options.timeout.count() > 0 && now - start > options.timeout;
    bool const past_grace = first_failure && now - *first_failure > options.grace;
    if (past_deadline || past_grace) {
      result.timed_out = result.timed_out || past_deadline;
      for (int rank = 0; rank < options.nproc; ++rank) {
        if (pids[rank] <= 0) continue;
        kill(pids[rank], SIGKILL);
        result.ranks[rank].killed_by_launcher = true;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return result;
}

}  // namespace ferry
