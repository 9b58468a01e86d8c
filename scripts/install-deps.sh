#!/usr/bin/env bash
# Installs what the build needs, only where it is missing: CMake >= 3.25, a C++20 compiler, GoogleTest (and ninja,
# optional). Uses apt on Debian/Ubuntu when run as root; elsewhere it says what to install.
set -euo pipefail

missing=()
command -v cmake >/dev/null 2>&1 || missing+=(cmake)
command -v g++ >/dev/null 2>&1 || missing+=(g++)
command -v make >/dev/null 2>&1 || missing+=(make)
if [ ! -f /usr/include/gtest/gtest.h ] && [ ! -f /usr/local/include/gtest/gtest.h ]; then missing+=(libgtest-dev); fi
command -v ninja >/dev/null 2>&1 || missing+=(ninja-build)

[ ${#missing[@]} -eq 0 ] && exit 0

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  echo "ferry: installing ${missing[*]} (apt)"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq "${missing[@]}" >/dev/null
else
  echo "ferry: missing ${missing[*]}; install them (e.g. apt-get install ${missing[*]})" >&2
  # ninja is optional (CMake falls back to make); the rest are not.
  for m in "${missing[@]}"; do [ "$m" = ninja-build ] || exit 1; done
fi
