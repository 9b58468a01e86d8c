// ferry launch: runs any program as N ranks of this host, torchrun-style (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE,
// LOCAL_RANK, LOCAL_WORLD_SIZE, the NVLink-multicast safety variables and, where unset, OMP_NUM_THREADS=1 in each),
// through the launcher the other commands and the tests use: the first rank that fails ends the others after a grace
// period, so a launch never hangs. What a C++ program needs to start its ranks without torch
// (socket_bootstrap_options_from_env reads them).
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "commands.hpp"
#include "core/launcher.hpp"
#include "ferry/communicator.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "options.hpp"

namespace ferry::cli {
namespace {

// The program as the ranks will run it: as given when it names a folder, else the first executable match on PATH
// (what a shell would run). NOTE: never resolved through symlinks: a virtual environment's bin/python is a symlink to
// the base interpreter, which finds the environment's packages only when started through the link.
std::string resolve_program(std::string const& program) {
  auto executable_file = [](std::string const& path) {
    struct stat info {};
    return !path.empty() && stat(path.c_str(), &info) == 0 && S_ISREG(info.st_mode) && access(path.c_str(), X_OK) == 0;
  };
  if (program.find('/') != std::string::npos) {
    if (!executable_file(program))
      FERRY_THROW(ConfigError, "launch", "PROGRAM '", program, "' is not an executable file");
    return program;
  }
  char const* env_path = std::getenv("PATH");
  std::string const dirs = env_path ? env_path : "";
  for (std::size_t begin = 0; begin <= dirs.size();) {
    std::size_t const end = std::min(dirs.find(':', begin), dirs.size());
    std::string const dir = end > begin ? dirs.substr(begin, end - begin) : ".";
    std::string const path = dir + "/" + program;
    if (executable_file(path)) return path;
    begin = end + 1;
  }
  FERRY_THROW(ConfigError, "launch", "PROGRAM '", program, "' was not found on PATH (give a path to run a file here)");
}

}  // namespace

int launch_main(int argc, char** argv) {
  // The options come before the program: the first word that is not an option (or the one after "--") starts it.
  std::vector<char*> option_words;
  int program_at = argc;
  for (int i = 0; i < argc; ++i) {
    std::string const word = argv[i];
    if (word == "--") {
      program_at = i + 1;
      break;
    }
    if (word.rfind("--", 0) != 0) {
      program_at = i;
      break;
    }
    option_words.push_back(argv[i]);
    if (word != "--help" && word.find('=') == std::string::npos && i + 1 < argc) option_words.push_back(argv[++i]);
  }
  Options options(
      "launch",
      "ferry launch [options] [--] PROGRAM [ARGS...]: runs PROGRAM with ARGS as N ranks of this host with the "
      "torchrun environment (MASTER_ADDR, MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), NVLink "
      "multicast off, and OMP_NUM_THREADS=1 where it is unset (as torchrun does). The first rank that fails ends the "
      "others after --grace seconds; the exit status is 0 when "
      "every rank exited 0, else the exit status of the rank that failed first (128 + signal when killed).",
      {{"nproc", "0", "ranks to start (0: one per local GPU)"},
       {"master-addr", "127.0.0.1", "rendezvous address given to the ranks"},
       {"master-port", "0", "rendezvous port (0: a free one)"},
       {"timeout", "0", "kill every rank after this many seconds (0: no deadline)"},
       {"grace", "-1",
        "seconds the others may run on after a rank failed (-1: FERRY_TIMEOUT_S + 5, time for them to report their "
        "own timeout)"}});
  if (!options.parse(static_cast<int>(option_words.size()), option_words.data())) return 0;
  if (program_at >= argc)
    FERRY_THROW(ConfigError, "launch", "no PROGRAM given: ferry launch [options] [--] PROGRAM [ARGS...]");

  LaunchOptions launch;
  launch.argv.push_back(resolve_program(argv[program_at]));
  for (int i = program_at + 1; i < argc; ++i) launch.argv.emplace_back(argv[i]);
  launch.nproc = options.integer("nproc");
  if (launch.nproc < 0) FERRY_THROW(ConfigError, "launch", "--nproc=", launch.nproc, ": must be 0 or more");
  if (launch.nproc == 0) {
    launch.nproc = cuda_device_count();
    if (launch.nproc == 0)
      FERRY_THROW(ConfigError, "launch",
                  "--nproc=0 means one rank per local GPU, and this machine has none: give --nproc N");
  }
  launch.master_addr = options.str("master-addr");
  launch.master_port = options.integer("master-port");
  double const timeout = options.number("timeout");
  // NOTE: milliseconds in 64 bits, added to a clock in nanoseconds: a larger bound would wrap around
  for (char const* name : {"timeout", "grace"})
    if (options.number(name) > kMaxTimeoutSeconds)
      FERRY_THROW(ConfigError, "launch", "--", name, "=", options.number(name), ": must be at most ",
                  kMaxTimeoutSeconds, " s (about 31 years)");
  if (options.number("grace") >= 0)
    launch.grace = std::chrono::milliseconds(static_cast<int64_t>(options.number("grace") * 1000));
  if (timeout < 0) FERRY_THROW(ConfigError, "launch", "--timeout=", timeout, ": must be 0 (none) or more");
  launch.timeout = std::chrono::milliseconds(static_cast<int64_t>(timeout * 1000));

  if (omp_threads_defaulted(launch)) std::fprintf(stderr, "ferry launch: %s\n", omp_threads_notice().c_str());
  LaunchResult const result = launch_ranks(launch);
  if (result.ok()) return 0;
  std::fprintf(stderr, "%s", result.describe("ferry launch: ").c_str());
  return result.exit_status();
}

}  // namespace ferry::cli
