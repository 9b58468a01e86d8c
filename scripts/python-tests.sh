#!/usr/bin/env bash
# Runs the Python tests (python/tests) against the module built in the CMake build directory BUILD (default: build), as
# `make test` does after the C++ tests:
#   1. a virtual environment, BUILD/venv (python3 -m venv --system-site-packages: a system torch or numpy is still
#      seen), created once; into it, from PyPI, what pyproject.toml declares and is missing: nanobind (a build
#      requirement: to build the module), numpy (the package's dependency), pytest (the extra "test") and torch (the
#      extra "torch": ferry.deep_ep, ferry.autograd and the torch examples take torch tensors; their tests run on the
#      cpu backend with torch CPU tensors). PyPI's torch brings its CUDA libraries (about 3 GB, a few minutes once;
#      the venv is kept). Nothing is installed into the Python you run this with;
#   2. configures that build with -DFERRY_BUILD_PYTHON=ON and the environment's python (unless it already is), and
#      builds the target ferry_python: the module (linked against the library the build already compiled) and the
#      package files, in BUILD/python/ferry;
#   3. runs pytest with BUILD/python first on PYTHONPATH. pytest's exit status 5 (no tests collected) is success.
#      With FERRY_CTEST_JUNIT set (ctest's --output-junit file), the lines before pytest's summary say what was
#      skipped, in ctest and pytest, and why; FERRY_PYTEST_JUNIT writes pytest's results there (make test:
#      scripts/run-tests.sh prints that summary once both ran).
#
#   scripts/python-tests.sh [BUILD [PYTEST_ARGS...]]   (default: build, python/tests)
#   scripts/python-tests.sh --prepare [BUILD]   step 1, with torch's install left running in the background (its log:
#                                              VENV/torch-install.log), and step 2's configure where BUILD is
#                                              configured already; the next run without --prepare waits for the
#                                              install. make test prepares after configuring: the download overlaps
#                                              the build, and the build compiles the module with the rest.
#
# Nothing to do when there are no Python tests. PYTHON picks the interpreter the environment is made from (default
# python3); FERRY_VENV another place for the environment (make test-sanitize reuses the main build's, torch and all);
# FERRY_PYTEST_PRELOAD libraries preloaded into pytest alone (make test-sanitize: the sanitizers' runtimes, which an
# instrumented module needs loaded first).
set -euo pipefail
cd "$(dirname "$0")/.."
PREPARE=0
if [ "${1:-}" = --prepare ]; then
  PREPARE=1
  shift
fi
if ! ls python/tests/test_*.py >/dev/null 2>&1; then
  echo "python tests: none (python/tests/test_*.py)"
  exit 0
fi

BUILD=${1:-build}
shift || true
# what pytest runs: the arguments after BUILD (files, -k ...), else every test
[ $# -gt 0 ] || set -- python/tests
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
PYTHON=${PYTHON:-python3}
VENV=${FERRY_VENV:-$BUILD/venv}

if [ ! -x "$VENV/bin/python" ]; then
  echo "python tests: creating the virtual environment $VENV ($PYTHON -m venv --system-site-packages)"
  if ! "$PYTHON" -m venv --system-site-packages "$VENV"; then
    rm -rf "$VENV"
    echo "python tests: '$PYTHON -m venv' failed; on Debian/Ubuntu install python3-venv (scripts/install-deps.sh" \
      "does as root), or set PYTHON to an interpreter with the venv module" >&2
    exit 1
  fi
fi
PYTHON_PATH="$VENV/bin/python"

# "group module requirement" per line, from pyproject.toml: the build's requirements but scikit-build-core (CMake
# builds the module here), the dependencies and the extra test ("small"), and the extra torch ("large")
wanted=$("$PYTHON_PATH" - <<'PY'
import re

text = open("pyproject.toml").read()
try:
    import tomllib

    data = tomllib.loads(text)
    groups = {"small": data["build-system"]["requires"] + data["project"]["dependencies"]
                       + data["project"]["optional-dependencies"]["test"],
              "large": data["project"]["optional-dependencies"]["torch"]}
except ModuleNotFoundError:  # Python < 3.11: the same one-line arrays, read as text
    def array(key):
        return re.findall(r'"([^"]+)"', re.search(rf"^{key} = \[(.*)\]", text, re.M).group(1))

    groups = {"small": array("requires") + array("dependencies") + array("test"), "large": array("torch")}
for group, requirements in groups.items():
    for requirement in requirements:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        if name != "scikit-build-core":
            print(group, name.replace("-", "_"), requirement)
PY
)
missing() {  # the requirements of group $1 whose module does not import
  local group module requirement
  while read -r group module requirement; do
    [ "$group" = "$1" ] || continue
    "$PYTHON_PATH" -c "import $module" >/dev/null 2>&1 || echo "$requirement"
  done <<<"$wanted"
}
pip_install() {
  "$PYTHON_PATH" -m pip install --quiet --disable-pip-version-check "$@"
}

# torch's install in the background (--prepare): running while its pid lives, then its exit status in a file
LARGE_LOG="$VENV/torch-install.log"
LARGE_PID="$VENV/torch-install.pid"
LARGE_STATUS="$VENV/torch-install.status"
large_in_flight() {
  [ -f "$LARGE_PID" ] && [ ! -f "$LARGE_STATUS" ] && kill -0 "$(cat "$LARGE_PID")" 2>/dev/null
}

mapfile -t small < <(missing small)
if [ ${#small[@]} -gt 0 ]; then
  echo "python tests: installing ${small[*]} into $VENV (pip)"
  pip_install "${small[@]}"
fi
if ! large_in_flight; then
  mapfile -t large < <(missing large)
  if [ ${#large[@]} -gt 0 ] && [ "$PREPARE" = 1 ]; then
    echo "python tests: installing ${large[*]} into $VENV in the background (pip; log $LARGE_LOG)"
    rm -f "$LARGE_STATUS"
    (
      status=0
      # --no-compile: no bytecode for torch's thousands of modules while the build has the cores (the ones imported
      # are compiled by their first import)
      pip_install --no-compile "${large[@]}" || status=$?
      echo "$status" >"$LARGE_STATUS"
    ) </dev/null >"$LARGE_LOG" 2>&1 &
    echo $! >"$LARGE_PID"
  elif [ ${#large[@]} -gt 0 ]; then
    echo "python tests: installing ${large[*]} into $VENV (pip)"
    pip_install "${large[@]}"
  fi
fi
# the build compiles the module with this environment's python: configured so unless it already is
configure_for_module() {
  local cache="$BUILD/CMakeCache.txt"
  if ! grep -qx "FERRY_BUILD_PYTHON:BOOL=ON" "$cache" 2>/dev/null ||
    [ "$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$cache" 2>/dev/null)" != "$PYTHON_PATH" ]; then
    cmake -S . -B "$BUILD" -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PYTHON_PATH" >/dev/null
  fi
}
if [ "$PREPARE" = 1 ]; then
  if [ -f "$BUILD/CMakeCache.txt" ]; then configure_for_module; fi
  exit 0
fi

if large_in_flight; then
  start=$(date +%s)
  echo "python tests: waiting for the background install (log $LARGE_LOG)"
  while large_in_flight; do sleep 2; done
  echo "python tests: it ended $(($(date +%s) - start)) s later"
fi
if [ -f "$LARGE_STATUS" ] && [ "$(cat "$LARGE_STATUS")" != 0 ]; then
  tail -n 20 "$LARGE_LOG" >&2
  echo "python tests: the background install failed (exit status $(cat "$LARGE_STATUS"); log $LARGE_LOG)" >&2
  rm -f "$LARGE_STATUS" "$LARGE_PID"
  exit 1
fi
rm -f "$LARGE_STATUS" "$LARGE_PID"
mapfile -t large < <(missing large)
if [ ${#large[@]} -gt 0 ]; then  # a background install that was killed, or never started
  echo "python tests: installing ${large[*]} into $VENV (pip)"
  pip_install "${large[@]}"
fi

start=$(date +%s)
# one build at a time in a build folder (make test runs two streams of tests: scripts/run-tests.sh)
exec 9>"$BUILD/.python-tests.lock"
flock 9
configure_for_module
cmake --build "$BUILD" --target ferry_python -j "$(nproc)"
flock -u 9
echo "python tests: module built in $(($(date +%s) - start)) s ($BUILD/python/ferry)"

export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
status=0
env ${FERRY_PYTEST_PRELOAD:+"LD_PRELOAD=$FERRY_PYTEST_PRELOAD"} "$PYTHON_PATH" -m pytest -q -rs \
  ${FERRY_PYTEST_JUNIT:+"--junitxml=$FERRY_PYTEST_JUNIT"} "$@" || status=$?
if [ "$status" -eq 5 ]; then
  echo "python tests: pytest collected no tests"
  status=0
fi
exit "$status"
