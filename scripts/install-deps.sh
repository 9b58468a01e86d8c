#!/usr/bin/env bash
# Installs what the build and `make test` need, only where it is missing: CMake >= 3.25, a C++20 compiler,
# GoogleTest (and ninja, optional), and python3-venv (the Python tests run in a virtual environment under the build
# folder: scripts/python-tests.sh). Uses apt on Debian/Ubuntu when run as root; elsewhere it says what to install.
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then missing+=(libgtest-dev); fi
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)
# NOTE: Debian's python3 has the venv module but not ensurepip (package python3-venv), without which venv fails.
if command -v python3 >/dev/null 2>&1 && ! python3 -c "import ensurepip, venv" >/dev/null 2>&1; then
  missing+=(python3-venv)
fi

[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "ferry: installing ${missing[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "ferry: missing ${missing[*]}; install them (e.g. apt-get install ${missing[*]})" >&2
  # ninja is optional (CMake falls back to make), python3-venv only needed by the Python tests; the rest are not.
  for m in "${missing[@]}"; do [ "$m" = ninja-build ] || [ "$m" = python3-venv ] || exit 1; done
fi
