#include "ranks.hpp"

#include <cstdio>
#include <cstdlib>
#include <exception>

#include "core/launcher.hpp"
#include "ferry/error.hpp"

namespace ferry::cli {

int choose_nproc(int nproc_option, Backend backend, int cpu_default) {
  FERRY_CHECK_CONFIG(nproc_option >= 0, "--nproc=", nproc_option,
                     " must be 0 (one rank per GPU, or the cpu backend's default) or more");
  if (nproc_option > 0) return nproc_option;
  return backend == Backend::cuda ? cuda_device_count() : cpu_default;
}

bool is_rank_process() {
  char const* rank = std::getenv("RANK");
  return rank != nullptr && *rank != '\0';
}

int launch_self(std::string const& command, int argc, char** argv, int nproc) {
  LaunchOptions options;
  options.argv = {self_executable(), command};
  for (int i = 0; i < argc; ++i) options.argv.emplace_back(argv[i]);
  options.nproc = nproc;  // grace: the launcher's default (the others report their own error first)
  LaunchResult const result = launch_ranks(options);
  if (result.ok()) return 0;
  std::fprintf(stderr, "%s", result.describe("ferry " + command + ": ").c_str());
  return result.exit_status();
}

int run_rank(std::string const& command, std::function<int()> const& fn) {
  try {
    return fn();
  } catch (std::exception const& error) {
    std::fprintf(stderr, "ferry %s: rank %s: %s\n", command.c_str(), std::getenv("RANK") ? std::getenv("RANK") : "?",
                 error.what());
    return 1;
  }
}

}  // namespace ferry::cli
