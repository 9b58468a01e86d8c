#!/usr/bin/env bash
# Runs the Python tests (python/tests) against the module built in the CMake build directory $1 (default: build), as
# `make test` does after the C++ tests:
#   1. a virtual environment, BUILD/venv (python3 -m venv --system-site-packages: a system torch or numpy is still
#      seen), created once; into it, from PyPI, what pyproject.toml declares and is missing: nanobind (a build
#      requirement: to build the module), numpy (the package's dependency), pytest (the extra "test") and torch (the
#      extra "torch": ferry.deep_ep, ferry.autograd and the torch examples take torch tensors; their tests run on the
#      cpu backend with torch CPU tensors). PyPI's torch brings its CUDA libraries (about 3 GB, a few minutes once;
#      the venv is kept). Nothing is installed into the Python you run this with;
#   2. reconfigures that build with -DFERRY_BUILD_PYTHON=ON and the environment's python, and builds the target
#      ferry_python: the module (linked against the library the build already compiled) and the package files, in
#      BUILD/python/ferry;
#   3. runs pytest with BUILD/python first on PYTHONPATH. pytest's exit status 5 (no tests collected) is success.
#      With FERRY_CTEST_JUNIT set (make test: ctest's --output-junit file), the line before pytest's summary says
#      what was skipped, in ctest and pytest, and why.
# Nothing to do when there are no Python tests. PYTHON picks the interpreter the environment is made from (default
# python3); FERRY_VENV another place for the environment (make test-sanitize reuses the main build's, torch and all);
# FERRY_PYTEST_PRELOAD libraries preloaded into pytest alone (make test-sanitize: the sanitizers' runtimes, which an
# instrumented module needs loaded first).
set -euo pipefail
cd "$(dirname "$0")/.."
if ! ls python/tests/test_*.py >/dev/null 2>&1; then
  echo "python tests: none (python/tests/test_*.py)"
  exit 0
fi

BUILD=${1:-build}
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

# "module requirement" per line, from pyproject.toml: the build's requirements but scikit-build-core (CMake builds the
# module here), the dependencies, and the extras test and torch
wanted=$("$PYTHON_PATH" - <<'PY'
import re

text = open("pyproject.toml").read()
try:
    import tomllib

    data = tomllib.loads(text)
    lists = [data["build-system"]["requires"], data["project"]["dependencies"],
             data["project"]["optional-dependencies"]["test"], data["project"]["optional-dependencies"]["torch"]]
except ModuleNotFoundError:  # Python < 3.11: the same one-line arrays, read as text
    lists = [re.findall(r'"([^"]+)"', re.search(rf"^{key} = \[(.*)\]", text, re.M).group(1))
             for key in ("requires", "dependencies", "test", "torch")]
for requirement in (r for values in lists for r in values):
    name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
    if name != "scikit-build-core":
        print(name.replace("-", "_"), requirement)
PY
)
missing=()
while read -r module requirement; do
  "$PYTHON_PATH" -c "import $module" >/dev/null 2>&1 || missing+=("$requirement")
done <<<"$wanted"
if [ ${#missing[@]} -gt 0 ]; then
  echo "python tests: installing ${missing[*]} into $VENV (pip)"
  "$PYTHON_PATH" -m pip install --quiet --disable-pip-version-check "${missing[@]}"
fi

start=$(date +%s)
cmake -S . -B "$BUILD" -DFERRY_BUILD_PYTHON=ON -DPython_EXECUTABLE="$PYTHON_PATH" >/dev/null
cmake --build "$BUILD" --target ferry_python -j "$(nproc)"
echo "python tests: module built in $(($(date +%s) - start)) s ($BUILD/python/ferry)"

export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
status=0
env ${FERRY_PYTEST_PRELOAD:+"LD_PRELOAD=$FERRY_PYTEST_PRELOAD"} "$PYTHON_PATH" -m pytest -q -rs python/tests ||
  status=$?
if [ "$status" -eq 5 ]; then
  echo "python tests: pytest collected no tests"
  status=0
fi
exit "$status"
