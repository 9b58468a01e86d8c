#!/usr/bin/env bash
# On the GPU machine (2 GPUs, PyTorch), from the repo root: the Python side of Ferry, checked in one go:
#   1. pip-installs the package (no network: --no-build-isolation --no-deps, nanobind and scikit-build-core already
#      there), built against the NCCL that torch loads (the communicator refuses any other version);
#   2. runs the Python tests (python/tests: the cpu-backend tests and the GPU torch tests, test_gpu_torch.py);
#   3. runs examples/moe_layer.py with torchrun on 2 GPUs (checked against the dense reference, bf16 tolerance);
#   4. runs python/bench_overhead.py with torchrun on 2 GPUs (per-call host overhead of the binding);
#   5. prints a short summary last.
# A failing step is shown (its log's tail) and the later steps still run. Logs go to $OUT when set, else
# build-py/logs. Exit status: non-zero when any step failed. Takes about 5 minutes (most of it the CUDA build); every
# step has a time limit, cut so that the whole script ends within FERRY_DEVICE_BUDGET_S (default 560 s).
#
# usage: scripts/device-python.sh [--no-install] [--probe-only]
#   --probe-only            install (unless --no-install) and run the world-2 ferry.init probe only (step 1b)
#   PYTHON=...              the interpreter (default: torch's venv, /opt/torch/.venv/bin/python3)
#   FERRY_ENABLE_CUDA=OFF   a cpu-only build (default ON: a build without the cuda backend fails instead)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# NVLink multicast stays off in everything this starts (DESIGN "Safety": it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

if [[ -z "${PYTHON:-}" ]]; then
  PYTHON=python3
  [[ -x /opt/torch/.venv/bin/python3 ]] && PYTHON=/opt/torch/.venv/bin/python3
fi
INSTALL=1
PROBE_ONLY=0
for arg in "$@"; do
  case "$arg" in
    --no-install) INSTALL=0 ;;
    --probe-only) PROBE_ONLY=1 ;;
    *) echo "usage: scripts/device-python.sh [--no-install] [--probe-only]" >&2; exit 2 ;;
  esac
done
LOGS="${OUT:-build-py/logs}"
mkdir -p "$LOGS"
START=$SECONDS
BUDGET=${FERRY_DEVICE_BUDGET_S:-560}
stamp() { echo "== [$((SECONDS - START)) s] $*"; }
limit() {  # a step's time limit: at most $1 s, keeping $2 s of the budget for the steps after it
  local left=$((BUDGET - (SECONDS - START) - $2))
  ((left < $1)) && set -- "$left"
  echo $(($1 < 15 ? 15 : $1))
}
failed() {  # step, exit status, log: say so and show the end of the log
  echo "device-python: $1 FAILED (exit $2; log $3)"
  tail -n 40 "$3"
}
free_port() { "$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# 1. install
INSTALL_RC=0
if [[ $INSTALL -eq 1 ]]; then
  stamp "install ($PYTHON)"
  # The NCCL of torch's wheel (nvidia.nccl is a namespace package: no __file__)
  NCCL_ROOT=$("$PYTHON" -c "import nvidia.nccl as m, os
print(os.path.dirname(m.__file__) if getattr(m, '__file__', None) else list(m.__path__)[0])" 2>/dev/null)
  TORCH=$("$PYTHON" -c 'import torch as t; print(t.__version__, t.version.cuda, t.cuda.device_count(), "GPUs")' 2>&1)
  echo "torch $TORCH; NCCL ${NCCL_ROOT:-none in the torch wheel, CMake looks for one}"
  export CMAKE_BUILD_PARALLEL_LEVEL=${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}
  CUDA=${FERRY_ENABLE_CUDA:-ON}  # ON: no silent cpu-only build when nvcc is not found
  if "$PYTHON" -m pip --version >/dev/null 2>&1; then
    timeout "$(limit 360 200)" "$PYTHON" -m pip install --no-build-isolation --no-deps --disable-pip-version-check -v \
      . \
      -C cmake.define.FERRY_ENABLE_CUDA="$CUDA" ${NCCL_ROOT:+-C cmake.define.FERRY_NCCL_ROOT="$NCCL_ROOT"} \
      >"$LOGS/install.log" 2>&1
    INSTALL_RC=$?
  else
    # No pip in this environment: the same build through CMake, used from the build tree (docs/python.md).
    echo "(no pip for $PYTHON: building with CMake into build-py/device, used through PYTHONPATH)"
    { cmake -S . -B build-py/device -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_BUILD_TESTS=OFF \
        -DFERRY_BUILD_PYTHON=ON -DFERRY_ENABLE_CUDA="$CUDA" -DPython_EXECUTABLE="$(command -v "$PYTHON")" \
        ${NCCL_ROOT:+-DFERRY_NCCL_ROOT="$NCCL_ROOT"} &&
      timeout "$(limit 360 200)" cmake --build build-py/device --target ferry_python; } >"$LOGS/install.log" 2>&1
    INSTALL_RC=$?
    export PYTHONPATH="$PWD/build-py/device/python${PYTHONPATH:+:$PYTHONPATH}"
  fi
  grep -E "Ferry: cuda backend" "$LOGS/install.log"
  [[ $INSTALL_RC -ne 0 ]] && failed "install" "$INSTALL_RC" "$LOGS/install.log"
fi
(cd /tmp && "$PYTHON" -c "import ferry; print('ferry', ferry.__version__, 'from', ferry.__file__, '| cuda backend:',
      ferry.cuda_backend_compiled, '| GPUs:', ferry.cuda_device_count())") \
  2>&1 | tee "$LOGS/import.log"
IMPORT_RC=${PIPESTATUS[0]}

# 1b. the cuda communicator at world 2, without and with `import torch` first (the crash seen on 2026-11-30: SIGSEGV
#     in ferry.init only with torch imported). Unbuffered output, Python's fault handler and NCCL's INFO log in
#     files, so a crash leaves its last steps behind: $LOGS/probe-*.log and $LOGS/nccl-probe.*.log.
stamp "ferry.init probe (world 2, cuda, without / with torch)"
cat >"$LOGS/probe.py" <<'PYEOF'
import sys
if "torch" in sys.argv[1:]:
    import torch  # noqa: F401
import ferry
comm = ferry.init(backend="cuda")
comm.barrier()
print(f"probe rank {comm.rank}: init + barrier ok ({'with' if 'torch' in sys.argv[1:] else 'without'} torch)", flush=True)
PYEOF
# A native crash prints its frames (library+offset) through scripts/native-backtrace.c, preloaded: no gdb there.
PRELOAD=""
if cc -shared -fPIC -O1 -o "$LOGS/libnative-backtrace.so" scripts/native-backtrace.c -ldl 2>"$LOGS/preload.log"; then
  PRELOAD="$LOGS/libnative-backtrace.so"
else
  echo "(no native backtraces: $(head -c 200 "$LOGS/preload.log"))"
fi
for variant in plain torch; do
  (cd /tmp && PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 FERRY_LOG=debug NCCL_DEBUG=INFO LD_PRELOAD="$PRELOAD" \
    NCCL_DEBUG_FILE="$LOGS/nccl-probe-$variant.%p.log" timeout 60 "$PYTHON" -m ferry.launch --nproc 2 \
    "$LOGS/probe.py" $variant) >"$LOGS/probe-$variant.log" 2>&1
  echo "probe $variant: exit $? ($(grep -o 'init + barrier ok' "$LOGS/probe-$variant.log" | wc -l) of 2 ranks ok)"
  if grep -q "native-backtrace\]  #" "$LOGS/probe-$variant.log"; then
    # Frames in libraries with a symbol table get a function name (and a line where there is debug info).
    grep -m 40 "native-backtrace\]" "$LOGS/probe-$variant.log" | while read -r line; do
      echo "  $line"
      frame=$(sed -n 's/.*#[0-9]* \(\/[^ ]*\)+\(0x[0-9a-f]*\) .*/\1 \2/p' <<<"$line")
      [[ -n "$frame" ]] && command -v addr2line >/dev/null &&
        echo "      $(addr2line -f -C -i -e ${frame% *} ${frame#* } 2>/dev/null | tr '\n' ' ' | head -c 300)"
    done
  fi
done
if [[ $PROBE_ONLY -eq 1 ]]; then
  tail -n 30 "$LOGS"/probe-torch.log
  for f in "$LOGS"/nccl-probe-torch.*.log; do [[ -f "$f" ]] && { echo "== $f"; tail -n 15 "$f"; }; done
  exit 0
fi

# 2. the Python tests (GPU torch tests included; each of those starts 2 ranks through ferry.launch)
stamp "pytest python/tests"
timeout "$(limit 240 100)" "$PYTHON" -m pytest python/tests -q -rs --durations=8 -p no:cacheprovider >"$LOGS/pytest.log" 2>&1
PYTEST_RC=$?
grep -E "passed|failed|error|SKIPPED|FAILED" "$LOGS/pytest.log" | tail -n 25
[[ $PYTEST_RC -ne 0 ]] && failed "pytest" "$PYTEST_RC" "$LOGS/pytest.log"
# The GPU torch tests skip themselves without torch, the cuda backend or 2 GPUs: here they must run.
GPU_SKIPPED=$(grep -c "^SKIPPED.*test_gpu_torch" "$LOGS/pytest.log")
[[ $GPU_SKIPPED -ne 0 ]] && echo "device-python: $GPU_SKIPPED GPU torch tests were skipped (above); they must run here"

# 3. the MoE layer example on 2 GPUs through torchrun
stamp "examples/moe_layer.py (torchrun, 2 GPUs)"
timeout "$(limit 90 60)" "$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-port "$(free_port)" \
  examples/moe_layer.py >"$LOGS/moe_layer.log" 2>&1
EXAMPLE_RC=$?
grep -E "^rank [0-9]+/" "$LOGS/moe_layer.log"
[[ $EXAMPLE_RC -ne 0 ]] && failed "moe_layer.py" "$EXAMPLE_RC" "$LOGS/moe_layer.log"

# 4. per-call overhead on 2 GPUs (lazy calls, current torch stream; then an explicit stream)
stamp "python/bench_overhead.py (torchrun, 2 GPUs)"
BENCH_RC=0
for extra in "" "--explicit-stream"; do
  # shellcheck disable=SC2086
  timeout "$(limit 60 10)" "$PYTHON" -m torch.distributed.run --nproc-per-node 2 --master-port "$(free_port)" \
    python/bench_overhead.py $extra >>"$LOGS/bench_overhead.log" 2>&1 || BENCH_RC=$?
done
grep -E "^rank [0-9]+/" "$LOGS/bench_overhead.log"
[[ $BENCH_RC -ne 0 ]] && failed "bench_overhead.py" "$BENCH_RC" "$LOGS/bench_overhead.log"

# 5. summary
stamp "done"
echo
echo "================ device-python summary ================"
"$PYTHON" - "$LOGS" "$INSTALL" "$INSTALL_RC" "$IMPORT_RC" "$PYTEST_RC" "$EXAMPLE_RC" "$BENCH_RC" <<'PY'
import os, re, sys
logs = sys.argv[1]
install, install_rc, import_rc, pytest_rc, example_rc, bench_rc = map(int, sys.argv[2:8])

def read(name):
    try:
        with open(os.path.join(logs, name), errors="replace") as f:
            return f.read()
    except OSError:
        return ""

def status(rc):
    return "ok" if rc == 0 else f"FAILED (exit {rc}{', timed out' if rc == 124 else ''})"

if install:
    print(f"install                {status(install_rc)}")
imported = (read("import.log").strip().splitlines() or [""])[-1]
print(f"import ferry           {status(import_rc)}  {imported[:110]}")

text = read("pytest.log")
counts = {k: 0 for k in ("passed", "failed", "skipped", "error")}
tail = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed|skipped|errors?)", line)]
if tail:
    for number, kind in re.findall(r"(\d+) (passed|failed|skipped|errors?)", tail[-1]):
        counts["error" if kind.startswith("error") else kind] = int(number)
print(f"pytest                 {counts['passed']} passed, {counts['failed']} failed, {counts['skipped']} skipped, "
      f"{counts['error']} errors  ({status(pytest_rc)})")
gpu_skipped = [line for line in text.splitlines() if line.startswith("SKIPPED") and "test_gpu_torch" in line]
gpu_failed = [line for line in text.splitlines() if line.startswith("FAILED") and "test_gpu_torch" in line]
print(f"  GPU torch tests        {len(gpu_failed)} failed, {len(gpu_skipped)} skipped"
      f"{' (they must run on the GPU machine: FAILED)' if gpu_skipped else ''}")
for line in (gpu_failed + gpu_skipped)[:6]:
    print(f"    {line.strip()[:150]}")

text = read("moe_layer.log")
rows = re.findall(r"^rank (\d+)/\d+ \[([^\]]*)\].*max \|y - y_ref\| = ([^,]+), ([\d.]+) of the bf16 tolerance: (\w+)",
                  text, re.M)
if rows:
    worst = max(float(r[3]) for r in rows)
    err = max(float(r[2]) for r in rows)
    ok = all(r[4] == "OK" for r in rows) and len(rows) == 2
    print(f"moe_layer (2 GPUs)     max |y - y_ref| {err:.3g}, worst {worst:.2f} of the bf16 tolerance "
          f"(2^-6 * sum|w e| + 1e-6): {'OK' if ok and example_rc == 0 else 'FAILED'} [{rows[0][1]}]")
else:
    print(f"moe_layer (2 GPUs)     no result ({status(example_rc)})")

text = read("bench_overhead.log")
rows = re.findall(r"^rank (\d+)/\d+ \[([^\]]*)\]: dispatch\+combine from Python ([\d.]+) us, in C\+\+ ([\d.]+) us; "
                  r"Python overhead ([-\d.]+) us per pair \(([-\d.]+) us per call", text, re.M)
if rows:
    for label in dict.fromkeys(r[1] for r in rows):
        mine = [r for r in rows if r[1] == label]
        per_call = max(float(r[5]) for r in mine)
        print(f"overhead [{label}]  {per_call:.1f} us per call (worst rank; pair: Python "
              f"{max(float(r[2]) for r in mine):.1f} us, C++ {max(float(r[3]) for r in mine):.1f} us) vs goal 15 us: "
              f"{'OK' if per_call <= 15 else 'OVER'}")
else:
    print(f"overhead               no result ({status(bench_rc)})")
print(f"logs                   {logs}")
PY
# shellcheck disable=SC2181
[[ $? -ne 0 ]] && echo "(summary failed; logs in $LOGS)"

if [[ $INSTALL_RC -ne 0 || $IMPORT_RC -ne 0 || $PYTEST_RC -ne 0 || $GPU_SKIPPED -ne 0 || $EXAMPLE_RC -ne 0 ||
  $BENCH_RC -ne 0 ]]; then
  echo "device-python: FAILED (install $INSTALL_RC, import $IMPORT_RC, pytest $PYTEST_RC, GPU tests skipped" \
    "$GPU_SKIPPED, example $EXAMPLE_RC, bench $BENCH_RC)"
  exit 1
fi
echo "device-python: OK"
