// Subcommands of the ferry CLI. Each takes the arguments after its name and returns the process exit code.
#pragma once

namespace ferry::cli {

int bench_main(int argc, char** argv);
int env_main(int argc, char** argv);
int launch_main(int argc, char** argv);  // tools/ferry/launch.cpp
int tune_main(int argc, char** argv);    // tools/ferry/tune.cpp
int trace_main(int argc, char** argv);   // tools/ferry/trace.cpp
int model_main(int argc, char** argv);   // tools/ferry/model.cpp
#if FERRY_HAVE_CUDA
int p2p_main(int argc, char** argv);  // tools/ferry/p2p.cu
#endif

}  // namespace ferry::cli
