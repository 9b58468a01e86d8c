// How a ferry subcommand runs on several ranks: started by hand (no RANK in the environment) it launches one
// process per rank of itself through ferry's launcher and reports how they ended; started by the launcher (or
// torchrun, or a multi-node job) it is one rank and joins through the socket bootstrap.
#pragma once

#include <functional>
#include <string>

#include "ferry/communicator.hpp"

namespace ferry::cli {

// The ranks a subcommand starts for --nproc: the value when positive; 0: one per GPU on the cuda backend,
// cpu_default on the cpu backend. A negative value is a ConfigError naming it.
int choose_nproc(int nproc_option, Backend backend, int cpu_default);

// True when this process is one rank of a launched job (RANK is set).
bool is_rank_process();

// In the launching process: starts nproc copies of this executable with the same arguments, waits, prints one line
// per failed rank, and returns LaunchResult::exit_status (0 when every rank succeeded, else the status of the rank that
// failed first).
int launch_self(std::string const& command, int argc, char** argv, int nproc);

// Runs fn in a rank process, turning an escaping ferry::Error into a one-line message and exit code 1.
int run_rank(std::string const& command, std::function<int()> const& fn);

}  // namespace ferry::cli
