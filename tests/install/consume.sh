#!/usr/bin/env bash
# Installs this build into a scratch prefix, builds examples/cpp against it with find_package(Ferry) (a project that
# knows nothing of Ferry's source tree), and runs the example: the installed headers, library, CMake package and
# link dependencies are enough to build and run a MoE round trip.
# usage: tests/install/consume.sh BUILD_DIR SOURCE_DIR [EXAMPLE ARGS...]   (the example: BUILD_DIR/install-check/consumer/)
set -euo pipefail
build=$(cd "$1" && pwd)  # absolute: cmake reads a relative CMAKE_PREFIX_PATH from the consumer's build folder
source=$(cd "$2" && pwd)
shift 2
prefix="$build/install-check/prefix"
consumer="$build/install-check/consumer"
rm -rf "$build/install-check"
cmake --install "$build" --prefix "$prefix" >/dev/null
test -f "$prefix/include/ferry/ep.hpp" && test -f "$prefix/lib/cmake/Ferry/FerryConfig.cmake"
generator=$(command -v ninja >/dev/null 2>&1 && echo Ninja || echo "Unix Makefiles")
cmake -S "$source/examples/cpp" -B "$consumer" -G "$generator" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  >"$build/install-check/configure.log" 2>&1 || { cat "$build/install-check/configure.log"; exit 1; }
cmake --build "$consumer" >"$build/install-check/build.log" 2>&1 || { cat "$build/install-check/build.log"; exit 1; }
"$consumer/moe_round_trip" "$@"
