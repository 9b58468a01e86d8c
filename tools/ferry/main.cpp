// ferry: the command-line tool. `ferry bench`, `ferry p2p`, `ferry tune` start one process per local GPU themselves (or
// join a job launched by torchrun from the environment); `ferry launch` starts any program that way.
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <string>

#include "build_info.hpp"
#include "commands.hpp"
#include "ferry/env.hpp"
#include "ferry/error.hpp"
#include "ferry/version.hpp"

namespace {

void print_usage() {
  std::printf(
      "usage: ferry <command> [options]\n\n"
      "commands:\n"
      "  bench   time dispatch and combine (normal and low-latency modes), check them against the reference, compare\n"
      "          with NCCL\n"
#if FERRY_HAVE_CUDA
      "  p2p     NVLink put / get bandwidth and one-way latency between two GPUs, next to the copy engine\n"
#endif
      "  tune    sweep launch geometries per token bucket and merge the picks into the tuning table (--verify checks)\n"
      "  model   predict traffic and time of dispatch / combine on N nodes x M GPUs (a model, with its inputs)\n"
      "  trace   decode ferry bench --trace DIR: Chrome trace + per-phase table (builds with -DFERRY_TRACE=ON)\n"
      "  launch  run any program as N ranks of this host with the torchrun environment (C++ programs without torch)\n"
      "  env     the FERRY_* environment parameters, their defaults and the values in force\n"
      "  version this ferry's version (also --version), the commit it was built from, and its backends\n\n"
      "`ferry <command> --help` lists a command's options with their defaults.\n");
}

// The kernels' nvcc --Ofast-compile level when the build chose one (FERRY_CUDA_FAST_COMPILE, a CI setting), else "".
constexpr char kKernelFastCompile[] = FERRY_KERNEL_FAST_COMPILE;

// One line: the version (CMakeLists.txt's project(VERSION), as the library reports it), then the build's details.
void print_version() {
  char const* commit = ferry::cli::git_commit();
  std::printf("ferry %s (%s%s, %s%s%s)\n", ferry::version(), *commit ? "commit " : "no git commit recorded", commit,
              FERRY_HAVE_CUDA ? "cuda and cpu backends" : "cpu backend only: built without the cuda backend",
              FERRY_HAVE_CUDA && *kKernelFastCompile ? ", kernels at nvcc --Ofast-compile=" : "",
              FERRY_HAVE_CUDA ? kKernelFastCompile : "");
}

// Whether the command's arguments choose the cpu backend (--backend cpu, --backend=cpu): no kernel is timed then.
bool names_cpu_backend(int argc, char** argv) {
  for (int i = 2; i < argc; ++i) {
    if (std::strcmp(argv[i], "--backend=cpu") == 0) return true;
    if (std::strcmp(argv[i], "--backend") == 0 && i + 1 < argc && std::strcmp(argv[i + 1], "cpu") == 0) return true;
  }
  return false;
}

// A command that times kernels says so when they were built for compile speed (once, not per rank; not for a run on
// the cpu backend, which times no kernel).
void warn_if_kernels_not_optimised(std::string const& command, int argc, char** argv) {
  bool const times_kernels = command == "bench" || command == "tune" || command == "p2p";
  char const* rank = std::getenv("RANK");
  if (!FERRY_HAVE_CUDA || !*kKernelFastCompile || !times_kernels || (rank && *rank)) return;
  if (names_cpu_backend(argc, argv)) return;
  std::fprintf(stderr,
               "ferry %s: this build's kernels were compiled with nvcc --Ofast-compile=%s (FERRY_CUDA_FAST_COMPILE, a "
               "CI setting): cuda timings are not representative; reconfigure with -DFERRY_CUDA_FAST_COMPILE= for a "
               "release build\n",
               command.c_str(), kKernelFastCompile);
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0) {
    print_usage();
    return argc < 2 ? 2 : 0;
  }
  std::string const command = argv[1];
  if (command == "--version" || command == "version") {
    print_version();
    return 0;
  }
  try {
    if (command == "env") return ferry::cli::env_main(argc - 2, argv + 2);  // reports refused values itself
    ferry::check_env();  // every other command refuses a bad FERRY_* value before it starts anything
    warn_if_kernels_not_optimised(command, argc, argv);
    if (command == "bench") return ferry::cli::bench_main(argc - 2, argv + 2);
    if (command == "launch") return ferry::cli::launch_main(argc - 2, argv + 2);
    if (command == "tune") return ferry::cli::tune_main(argc - 2, argv + 2);
    if (command == "trace") return ferry::cli::trace_main(argc - 2, argv + 2);
    if (command == "model") return ferry::cli::model_main(argc - 2, argv + 2);
#if FERRY_HAVE_CUDA
    if (command == "p2p") return ferry::cli::p2p_main(argc - 2, argv + 2);
#endif
  } catch (std::exception const& error) {
    // One line: what is wrong and what is allowed (the error's own message).
    std::fprintf(stderr, "ferry %s: %s\n", command.c_str(), error.what());
    return 2;
  }
  std::fprintf(stderr, "ferry: unknown command '%s'; run ferry --help\n", command.c_str());
  return 2;
}
