#!/usr/bin/env bash
# On the GPU machine, from the repo root: build Ferry (build-device/), run a short `ferry bench` (normal mode with wire
# formats at 128 / 4096 tokens, then normal vs low-latency at 1 / 128 tokens, every row checked), the GPU tests one
# by one while the time budget lasts, the C++ example against the installed package (examples/cpp, cuda backend) and,
# with --p2p, `ferry p2p` (on one GPU: the emulated transport on virtual ranks); keep every log (in $OUT when set,
# else build-device/logs), and print a short summary last.
# The budget keeps the whole check inside one device call: a test is started only with 30 s of budget left, and the
# summary names the tests the budget left out.
# Exit status: non-zero when the build, a GPU test, the example or ferry p2p failed (a bench that is missing or fails,
# or a test the budget left out, is reported, not fatal).
#
# usage: scripts/device-check.sh [--tests REGEX] [--no-tests] [--p2p] [--no-bench] [--p2p-args "ARGS"] [--budget S]
#                                [--python] [--no-example] [--resume STATUS_FILE]
#   --resume FILE           an earlier call's gpu-tests.status (copied into the checkout: a call carries nothing
#                           else): the tests it lists as passed or skipped are not run again and count as it says, so
#                           that the GPU tests that one call's budget left out run in the next call (with
#                           --no-bench --no-example); the summary then covers both calls
#   --no-example            skip the installed-package example (a call that only reruns GPU tests)
#   --python                also build the Python module (ferry_python, against the image's torch) and run the Python
#                           files with GPU cases (test_autograd, test_deep_ep_compat, test_gpu_torch),
#                           examples/train_moe.py on one GPU (twice in-process: the loss curves must be equal) and,
#                           budget left, python/bench_deep_ep_overhead.py at 1 and 128 tokens (figures, not checks)
#   --budget S              seconds for the whole check (default 570: the device tool's 600 s per call, less a margin)
#   FERRY_TEST_WORLD=N      the EP GPU tests (normal, LL, quantized, trace) at N ranks, one per GPU (default: every
#                           GPU of the machine, at most 8; 1 on a one-GPU machine: every expert local, the timeout
#                           cases skip)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2

# NVLink multicast stays off in everything this starts (DESIGN "Safety": it can take the host's GPUs out of service).
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

BUILD=build-device
LOGS="${OUT:-$BUILD/logs}"
TEST_REGEX=""
RUN_TESTS=1 RUN_P2P=0 RUN_BENCH=1 RUN_PYTHON=0 RUN_EXAMPLE_ASKED=1
P2P_ARGS=""
BUDGET=570
RESUME=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --tests) TEST_REGEX="$2"; shift 2 ;;
    --no-tests) RUN_TESTS=0; shift ;;
    --p2p) RUN_P2P=1; shift ;;
    --no-p2p) RUN_P2P=0; shift ;;  # the default; kept for older command lines
    --no-bench) RUN_BENCH=0; shift ;;
    --p2p-args) P2P_ARGS="$2"; RUN_P2P=1; shift 2 ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --python) RUN_PYTHON=1; shift ;;
    --no-example) RUN_EXAMPLE_ASKED=0; shift ;;
    --resume) RESUME="$2"; shift 2 ;;
    -h|--help) sed -n '2,26p' "$0"; exit 0 ;;
    *) echo "device-check: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
mkdir -p "$LOGS"
if [[ -n "$RESUME" && ! -f "$RESUME" ]]; then
  echo "device-check: --resume $RESUME: no such file (copy an earlier call's gpu-tests.status into the checkout)" >&2
  exit 2
fi
START=$SECONDS
# the EP tests at the machine's world unless told otherwise (the tests' own default is 2 ranks, which skips on one GPU)
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
if [[ -z "${FERRY_TEST_WORLD:-}" && $GPUS -ge 1 ]]; then
  export FERRY_TEST_WORLD=$((GPUS < 8 ? GPUS : 8))
fi
echo "device-check: $GPUS GPU(s); EP tests at world ${FERRY_TEST_WORLD:-2} (FERRY_TEST_WORLD)"
stamp() { echo "== [$((SECONDS - START)) s] $*"; }
left() { echo $((BUDGET - (SECONDS - START))); }

# 1. configure + build (cmake picks the PyTorch wheel's NCCL, the libnccl a torch process loads)
stamp "configure + build into $BUILD"
PY=python3
[[ -x /opt/torch/.venv/bin/python3 ]] && PY=/opt/torch/.venv/bin/python3
PY_ARGS=()
[[ $RUN_PYTHON -eq 1 ]] && PY_ARGS=(-DFERRY_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$PY")
cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release "${PY_ARGS[@]}" >"$LOGS/configure.log" 2>&1
BUILD_RC=$?
grep -E "Ferry: cuda backend" "$LOGS/configure.log"
if [[ $BUILD_RC -ne 0 ]]; then
  tail -n 40 "$LOGS/configure.log"
  echo "device-check: configure failed (logs in $LOGS)"
  exit 2
fi
# Keep going past a failed target (-k 0): the GPU tests and the bench still run when only another target broke.
cmake --build "$BUILD" -j "$(nproc)" -- -k 0 >"$LOGS/build.log" 2>&1
BUILD_RC=$?
if [[ $BUILD_RC -ne 0 ]]; then
  grep -E "FAILED|error" "$LOGS/build.log" | head -n 20
  echo "device-check: the build failed (continuing with what was built; logs in $LOGS)"
fi
[[ -x "$BUILD/tests/ferry_gpu_tests" ]] || RUN_TESTS=0
[[ -x "$BUILD/ferry" ]] || { RUN_P2P=0; RUN_BENCH=0; }

# 2. a short ferry bench first (a minute or two; guarded: a feature it lacks must not stop the check)
BENCH_RC=0
if [[ $RUN_BENCH -eq 1 ]]; then
  stamp "ferry bench"
  timeout 240 "$BUILD/ferry" bench --tokens 128,4096 --graph --check --baseline nccl --json "$LOGS/bench.json" \
    --dispatch bf16,fp8,mxfp4,bf16 --combine bf16,bf16,bf16,fp8 --iters 10 >"$LOGS/bench.log" 2>&1
  BENCH_RC=$?
  tail -n 30 "$LOGS/bench.log"
  # low-latency mode beside normal mode at decode sizes (its goals: docs/perf.md)
  stamp "ferry bench --mode both (small batches)"
  timeout 120 "$BUILD/ferry" bench --mode both --tokens 1,128 --graph --check --baseline nccl --iters 10 \
    --json "$LOGS/bench-ll.json" >"$LOGS/bench-ll.log" 2>&1 || BENCH_RC=$?
  tail -n 12 "$LOGS/bench-ll.log"
  # the training passes beside the forward legs of the same bytes (docs/training.md, docs/perf.md)
  stamp "ferry bench --backward"
  timeout 120 "$BUILD/ferry" bench --backward --layout expert --tokens 128,4096 --check --iters 10 \
    --json "$LOGS/bench-backward.json" >"$LOGS/bench-backward.log" 2>&1 || BENCH_RC=$?
  grep -E "^(leg|dispatch|combine|backward)" "$LOGS/bench-backward.log" | tail -n 12
fi

# 3. GPU tests, one ctest run each (each starts one process per rank; a hang is bounded by the tests' own timeouts
#    and by the budget): status per test in gpu-tests.status (passed, failed, skipped, disabled, cut, not-run)
TESTS_RC=0
: >"$LOGS/gpu-tests.log"
: >"$LOGS/gpu-tests.status"
if [[ $RUN_TESTS -eq 1 ]]; then
  stamp "GPU tests (budget: $(left) s left)"
  mapfile -t NAMES < <(cd "$BUILD" && ctest -N -L gpu ${TEST_REGEX:+-R "$TEST_REGEX"} | sed -n 's/^ *Test *#[0-9]*: //p')
  # the fast-path walk (minutes: hundreds of virtual-rank cases) last, so that a short budget leaves it out, not the
  # correctness tests
  if [[ ${#NAMES[@]} -gt 0 ]]; then
    mapfile -t NAMES < <(printf '%s\n' "${NAMES[@]}" | grep -v '^FastPathVirtualRanks\.'
      printf '%s\n' "${NAMES[@]}" | grep '^FastPathVirtualRanks\.')
  fi
  RESERVE=$((40 + RUN_PYTHON * 200))  # the example and the summary (and --python: its tests, train_moe, the layer benches)
  for entry in "${NAMES[@]}"; do
    name="${entry%% *}"
    if [[ "$entry" == *"(Disabled)"* ]]; then echo "$name disabled" >>"$LOGS/gpu-tests.status"; continue; fi
    earlier=$([[ -n "$RESUME" ]] && awk -v n="$name" '$1 == n && ($2 == "passed" || $2 == "skipped") {print $2}' "$RESUME")
    if [[ -n "$earlier" ]]; then
      echo "$name $earlier" >>"$LOGS/gpu-tests.status"
      printf '%-60s %s\n' "$name" "$earlier (earlier call)"
      continue
    fi
    budget=$(($(left) - RESERVE))
    if [[ $budget -lt 30 ]]; then echo "$name not-run" >>"$LOGS/gpu-tests.status"; continue; fi
    limit=$((budget < 450 ? budget : 450))
    out=$(cd "$BUILD" && ctest -R "^${name}\$" --output-on-failure --timeout "$limit" 2>&1)
    rc=$?
    echo "$out" >>"$LOGS/gpu-tests.log"
    if grep -q '\*\*\*Skipped' <<<"$out"; then
      status=skipped
    elif [[ $rc -eq 0 ]]; then
      status=passed
    elif grep -q '\*\*\*Timeout' <<<"$out" && [[ $limit -lt 450 ]]; then
      status="cut"  # stopped by the budget, not by its own limit
    else
      status=failed
      TESTS_RC=1
    fi
    echo "$name $status" >>"$LOGS/gpu-tests.status"
    printf '%-60s %s\n' "$name" "$status"
  done
fi

# 4. the installed C++ package: examples/cpp built against `cmake --install` of this build, run on the cuda backend
#    (one process alone; one per GPU through `ferry launch` when there are more)
EXAMPLE_RC=0
RUN_EXAMPLE=$((RUN_TESTS && RUN_EXAMPLE_ASKED))
if [[ $RUN_EXAMPLE -eq 1 && $(left) -lt 30 ]]; then
  echo "device-check: no time left for the installed-package example (budget)"
  RUN_EXAMPLE=0
fi
if [[ $RUN_EXAMPLE -eq 1 ]]; then
  stamp "examples/cpp against the installed package"
  tests/install/consume.sh "$BUILD" "$PWD" --cuda >"$LOGS/example.log" 2>&1 || EXAMPLE_RC=$?
  if [[ $EXAMPLE_RC -eq 0 && $GPUS -ge 2 ]]; then
    "$BUILD/ferry" launch --nproc "$GPUS" --timeout 120 "$BUILD/install-check/consumer/moe_round_trip" --cuda \
      >>"$LOGS/example.log" 2>&1 || EXAMPLE_RC=$?
  fi
  tail -n 4 "$LOGS/example.log"
fi

# 4b. --python: the Python tests on the GPU and the training example on one GPU
PY_RC=0
if [[ $RUN_PYTHON -eq 1 && $(left) -lt 60 ]]; then
  echo "device-check: no time left for the Python tests (budget)"
  RUN_PYTHON=0
fi
if [[ $RUN_PYTHON -eq 1 ]]; then
  stamp "Python tests (GPU) and examples/train_moe.py"
  export PYTHONPATH="$PWD/$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
  # the files with GPU cases (the others run their cpu worlds in CI already)
  timeout $(($(left) - 40)) "$PY" -m pytest -q python/tests/test_autograd.py python/tests/test_deep_ep_compat.py \
    python/tests/test_gpu_torch.py >"$LOGS/python-tests.log" 2>&1 || PY_RC=$?
  tail -n 3 "$LOGS/python-tests.log"
  timeout 150 "$PY" -m torch.distributed.run --nproc-per-node 1 examples/train_moe.py --check-determinism \
    >"$LOGS/train-moe.log" 2>&1 || PY_RC=$?
  tail -n 8 "$LOGS/train-moe.log"
  # the DeepEP-compatible layer's host time per call over the native calls, at 1 and 128 tokens (docs/python.md; a
  # figure, not a check)
  : >"$LOGS/deep-ep-overhead.log"
  for tokens in 1 128; do
    if [[ $(left) -gt 70 ]]; then
      timeout 60 "$PY" -m torch.distributed.run --nproc-per-node 1 python/bench_deep_ep_overhead.py --tokens "$tokens" \
        --graph >>"$LOGS/deep-ep-overhead.log" 2>&1 ||
        echo "device-check: bench_deep_ep_overhead.py --tokens $tokens exit $? (see deep-ep-overhead.log)"
    fi
  done
fi

# 5. ferry p2p (--p2p: the transport's figures, docs/perf.md)
P2P_RC=0
if [[ $RUN_P2P -eq 1 ]]; then
  stamp "ferry p2p"
  # one GPU has no NVLink pair: the emulated transport's protocol on two virtual ranks instead, labelled so
  if [[ $GPUS -lt 2 && -z "$P2P_ARGS" ]]; then
    P2P_ARGS="--transport emulated --one-gpu --sizes 4KiB,1MiB,16MiB --ctas 8,32,132 --iters 10"
    echo "device-check: $GPUS GPU: ferry p2p $P2P_ARGS (emulated figures: neither NVLink nor network)"
  fi
  # shellcheck disable=SC2086
  timeout 180 "$BUILD/ferry" p2p --json "$LOGS/p2p.json" $P2P_ARGS >"$LOGS/p2p.log" 2>&1
  P2P_RC=$?
  cat "$LOGS/p2p.log"
fi

# 6. summary
stamp "done"
echo
echo "================ device-check summary ================"
python3 - "$LOGS" "$BUILD_RC" "$TESTS_RC" "$P2P_RC" "$BENCH_RC" "$RUN_TESTS" "$RUN_P2P" "$RUN_BENCH" "$EXAMPLE_RC" "$RUN_EXAMPLE" <<'PY' || echo "(summary failed; logs in $LOGS)"
import json, os, re, sys
logs, build_rc, tests_rc, p2p_rc, bench_rc = sys.argv[1], *map(int, sys.argv[2:6])
run_tests, run_p2p, run_bench = (a == "1" for a in sys.argv[6:9])
example_rc, run_example = int(sys.argv[9]), sys.argv[10] == "1"

def load(name):
    try:
        with open(os.path.join(logs, name)) as f:
            return json.load(f)
    except Exception:
        return None

print(f"build                  {'ok' if build_rc == 0 else f'FAILED (exit {build_rc}), see build.log'}")
if run_tests:
    example = "ok" if example_rc == 0 else f"FAILED (exit {example_rc}), see example.log"
    print(f"example (installed)    {example if run_example else 'not run'}")
    status = {}
    with open(os.path.join(logs, "gpu-tests.status")) as f:
        for line in f:
            name, _, state = line.strip().partition(" ")
            if name:
                status[name] = state
    count = lambda state: sum(1 for s in status.values() if s == state)
    print(f"gpu tests              {count('passed')} passed, {count('failed')} failed, {count('skipped')} skipped, "
          f"{count('cut') + count('not-run')} left out by the budget (of {len(status) - count('disabled')}; "
          f"{count('disabled')} disabled)")
    for state, label in (("failed", "failed"), ("skipped", "skipped"), ("cut", "cut by the budget"),
                         ("not-run", "not run (budget)")):
        for name in (n for n, s in status.items() if s == state):
            print(f"  {label}: {name}")
if run_p2p:
    p2p = load("p2p.json")
    if p2p is None:
        print(f"p2p                    no result (exit {p2p_rc}); see p2p.log")
    else:
        recs = p2p["records"]
        # records before the transport field are lsa's; an emulated figure is labelled so, never a network one
        net = lambda r: "" if r.get("transport", "lsa") == "lsa" else \
            f" [{r['transport'].upper()}{', 1 GPU' if r.get('one_gpu') else ''}]"
        def best(op, direction, size):
            rows = [r for r in recs if r["op"] == op and r["direction"] == direction and r["bytes"] == size]
            return max(rows, key=lambda r: r["gbps"]) if rows else None
        for op in ("push", "pull", "copy_engine", "put_signal"):
            size = max((r["bytes"] for r in recs if r["op"] == op), default=0)  # the largest measured (default 256MiB)
            one, bi = best(op, "oneway", size), best(op, "bidir", size)
            if one or bi:
                parts = []
                if one: parts.append(f"oneway {one['gbps']:.1f} GB/s" + (f" @{one['ctas']} CTAs" if one['ctas'] else ""))
                if bi: parts.append(f"bidir {bi['gbps']:.1f}/dir = {bi.get('gbps_sum', 2 * bi['gbps']):.1f} GB/s sum"
                                    + (f" @{bi['ctas']} CTAs" if bi['ctas'] else ""))
                print(f"p2p {op:<11} {size >> 20 and f'{size >> 20}MiB' or f'{size >> 10}KiB'} {'; '.join(parts)}"
                      + net(one or bi))
        for r in recs:
            if r["op"] == "latency":
                print(f"p2p latency            one-way {r['latency_us']:.2f} us" + net(r))
        if any(r["op"] == "push" for r in recs):
            print(f"  (targets: push 256MiB >= 350 oneway, >= 690 bidir sum; latency <= 1.5 us)")
if run_bench:
    for name, label in (("bench.json", ""), ("bench-ll.json", ""), ("bench-backward.json", "")):
        bench = load(name)
        if bench is None:
            print(f"bench                  no result in {name} (exit {bench_rc}); see {name[:-5]}.log")
            continue
        for r in bench.get("records", []):
            speed = r.get("speedup_vs_baseline")
            print(f"bench {r.get('mode','?'):<6} {r.get('leg','?'):<8} {r.get('format','?'):<6} tokens {r.get('tokens','?'):>5} "
                  f"graph {str(r.get('graph','?')):<5} {r.get('median_us', 0):9.1f} us "
                  f"nvlink {r.get('nvlink_gbps', 0):7.1f} GB/s check {r.get('check','?')}"
                  + (f" x{speed:.2f} vs nccl" if isinstance(speed, (int, float)) else "") + label)
print(f"logs                   {logs}")
PY

if [[ $RUN_PYTHON -eq 1 ]]; then
  echo "python (GPU)           $([[ $PY_RC -eq 0 ]] && echo ok || echo "FAILED (exit $PY_RC), see python-tests.log, train-moe.log")"
  grep -h '^rank' "$LOGS/deep-ep-overhead.log" 2>/dev/null | tr ';' '\n' | sed 's/^ */deep_ep overhead       /'
fi
if [[ $BUILD_RC -ne 0 || $TESTS_RC -ne 0 || $P2P_RC -ne 0 || $EXAMPLE_RC -ne 0 || $PY_RC -ne 0 ]]; then
  echo "device-check: FAILED (build exit $BUILD_RC, gpu tests exit $TESTS_RC, p2p exit $P2P_RC, example exit $EXAMPLE_RC, python exit $PY_RC)"
  exit 1
fi
echo "device-check: OK"
