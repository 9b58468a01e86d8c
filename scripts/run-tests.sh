#!/usr/bin/env bash
# make test's tests, after its build: ctest and the Python tests (scripts/python-tests.sh) at the same time, since on
# a machine of few cores much of either is waiting (ranks timing out on purpose, subprocesses starting, nvcc in the
# GIN header check) and the other fills it. ctest's output comes as it runs, then pytest's, then what was skipped in
# both and why (python/tests/skip_summary.py, from the two junit files). Exit status: 0 when both passed.
#
#   scripts/run-tests.sh BUILD [JOBS]   (JOBS: ctest -j, default nproc)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: scripts/run-tests.sh BUILD [JOBS]}
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
JOBS=${2:-$(nproc)}
PYTHON_LOG=$BUILD/python-tests.log
rm -f "$BUILD/ctest-junit.xml" "$BUILD/pytest-junit.xml"

echo "run-tests: the Python tests run beside ctest (their output follows ctest's; log $PYTHON_LOG)"
FERRY_PYTEST_JUNIT=$BUILD/pytest-junit.xml scripts/python-tests.sh "$BUILD" >"$PYTHON_LOG" 2>&1 &
python_pid=$!
# a Ctrl-C or a failure of this script ends the Python tests too
trap 'kill "$python_pid" 2>/dev/null' EXIT

(cd "$BUILD" && ctest --output-on-failure --timeout 600 -j "$JOBS" --output-junit ctest-junit.xml)
ctest_status=$?
if kill -0 "$python_pid" 2>/dev/null; then echo "run-tests: ctest done; waiting for the Python tests"; fi
wait "$python_pid"
python_status=$?
trap - EXIT
cat "$PYTHON_LOG"
PYTHON=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)
"${PYTHON:-python3}" python/tests/skip_summary.py "$BUILD/ctest-junit.xml" "$BUILD/pytest-junit.xml"
if [ "$ctest_status" -ne 0 ] || [ "$python_status" -ne 0 ]; then
  echo "run-tests: FAILED (ctest exit status $ctest_status, Python tests $python_status)" >&2
  exit 1
fi
echo "run-tests: ctest and the Python tests passed"
