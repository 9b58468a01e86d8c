#!/usr/bin/env bash
# make test's tests, after its build: ctest and the Python tests (scripts/python-tests.sh, two streams) at the same
# time, since on a machine of few cores much of each is waiting (ranks timing out on purpose, subprocesses starting,
# nvcc in the GIN header check) and the others fill it. ctest's output comes as it runs, then pytest's, then what was
# skipped and why (python/tests/skip_summary.py, from the junit files). Exit status: 0 when all passed.
#
#   scripts/run-tests.sh BUILD [JOBS]   (JOBS: ctest -j, default nproc)
set -uo pipefail
cd "$(dirname "$0")/.."
BUILD=${1:?usage: scripts/run-tests.sh BUILD [JOBS]}
case "$BUILD" in /*) ;; *) BUILD="$PWD/$BUILD" ;; esac
JOBS=${2:-$(nproc)}
rm -f "$BUILD"/ctest-junit.xml "$BUILD"/pytest-junit-*.xml "$BUILD"/python-tests-*.log

# The Python tests in two streams of about equal time (measured alone: autograd's and the launcher's tests, which run
# the examples, are half of it); a test file not named here goes to the second.
FIRST=(python/tests/test_autograd.py python/tests/test_launch.py python/tests/test_deep_ep_legacy.py
  python/tests/test_dispatch_combine.py)
SECOND=()
for file in python/tests/test_*.py; do
  [[ " ${FIRST[*]} " == *" $file "* ]] || SECOND+=("$file")
done
echo "run-tests: the Python tests run beside ctest, in two streams (their output follows ctest's)"
pids=()
for stream in 1 2; do
  if [ "$stream" = 1 ]; then files=("${FIRST[@]}"); else files=("${SECOND[@]}"); fi
  FERRY_PYTEST_JUNIT=$BUILD/pytest-junit-$stream.xml scripts/python-tests.sh "$BUILD" "${files[@]}" \
    >"$BUILD/python-tests-$stream.log" 2>&1 &
  pids+=($!)
done
# a Ctrl-C or a failure of this script ends the Python tests too
trap 'kill "${pids[@]}" 2>/dev/null' EXIT

(cd "$BUILD" && ctest --output-on-failure --timeout 600 -j "$JOBS" --output-junit ctest-junit.xml)
ctest_status=$?
echo "run-tests: ctest done (exit status $ctest_status); the Python tests:"
python_status=0
for stream in 1 2; do
  wait "${pids[$((stream - 1))]}" || python_status=1
  echo "---- python tests, stream $stream of 2 ($BUILD/python-tests-$stream.log)"
  cat "$BUILD/python-tests-$stream.log"
done
trap - EXIT
PYTHON=$(sed -n 's/^Python_EXECUTABLE:[A-Z]*=//p' "$BUILD/CMakeCache.txt" 2>/dev/null)
"${PYTHON:-python3}" python/tests/skip_summary.py "$BUILD/ctest-junit.xml" "$BUILD"/pytest-junit-1.xml \
  "$BUILD"/pytest-junit-2.xml
if [ "$ctest_status" -ne 0 ] || [ "$python_status" -ne 0 ]; then
  echo "run-tests: FAILED (ctest exit status $ctest_status; Python tests: see above)" >&2
  exit 1
fi
echo "run-tests: ctest and the Python tests passed"
