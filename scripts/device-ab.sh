#!/usr/bin/env bash
# On the GPU machine, from the repo root: an A/B of `ferry bench` between a base tree (A: a tarball of another commit,
# e.g. `git archive PARENT -o build-ab/base.tar`, carried to the machine) and this tree (B), same seeds, every row
# checked, rounds interleaved so that a drift of the machine falls on every side (each round starts one side later:
# A B, B A, ...; A B C, B C A, C A B, ...); then a table of the medians of each leg, A, B and B / A, each the median
# over the rounds. This tree's CLI (and module) is built into build-device/ (which scripts/device-check.sh then
# completes), the base's into /tmp/ferry-ab-base/. Or, with no build on the GPU machine, the ferry CLIs built here
# (`scripts/device-prebuilt.sh pack-cli`): then each side is one CLI, A the base and every other (B, C, ...) against it,
# e.g. the commits of a bisection.
#
# usage: scripts/device-ab.sh BASE_TAR | --prebuilt DIR [--rounds N] [--iters N] [--seed S] [--quick] [--runs "ARGS"]
#                              [--also "ARGS"] [--host-time] [--kernel-time] [--host-only]
#                              [--source-counters "KERNEL|ARGS"] [--budget S]
#   default workloads: normal mode 128 and 4096 tokens, low-latency mode 1, 128 and 512 tokens, dispatch and combine
#   in bf16 and fp8 (hidden 7168, topk 8, 256 experts, random routing, graph mode); --quick: normal 128 and LL 1/128,
#   bf16 only
#   --runs "ARGS": a workload in place of the default ones, `ferry bench ARGS` (repeatable), e.g. the legs in question
#   alone for more rounds: "--mode ll --tokens 1 --dispatch bf16,fp8 --combine bf16"
#   --also "ARGS": one more workload, `ferry bench ARGS` (repeatable), e.g. "--mode normal --layout expert --tokens
#   128,4096 --dispatch bf16,fp8 --combine bf16,fp8" (the expand); the table keys rows by layout too
#   --host-time: also builds the Python module of both trees and runs this tree's python/bench_overhead.py at 1 token
#   (world 1, lazy calls) with each module, A B A B, in normal mode and in low-latency mode: the host time of a
#   dispatch + combine pair from Python and from C++ (the same script on both sides: only the library differs)
#   --host-only: with --host-time, no `ferry bench` rounds: the budget goes to host-time rounds (N of --rounds)
#   --kernel-time: also the kernels' own time, without the gaps a graph's launches leave between them: ncu
#   (--clock-control none --cache-control none) on `ferry bench --mode ll --tokens 1` in bf16 and fp8, every side, two
#   rounds; per kernel (its name with template arguments) the median over a run's launches of its duration, warp
#   instructions, grid and registers per thread, then the median of the runs (about 8 s per side, workload and round)
#   --kernel-runs "ARGS": --kernel-time on `ferry bench ARGS` in place of the two default workloads (repeatable)
#   --kernel-stalls: with --kernel-time, also why warps waited (ncu's warp-state counters, stalled warps per issued
#   instruction by reason; the reasons that differ most between the sides are printed; about 14 s per side,
#   workload and round)
#   --source-counters "KERNEL|ARGS": ncu's per-instruction counters (SourceCounters) of KERNEL (its function name, e.g.
#   dispatch_kernel) over 20 launches of `ferry bench ARGS` (e.g. "--mode normal --tokens 128 --dispatch fp8 --combine
#   fp8"), A and B (repeatable); the exports go to source-counters.tgz ($OUT's, on the GPU machine) and
#   scripts/ncu-source-diff.py compares them (its summary is printed here): where B's instructions and stalls differ
#   from A's (about 40 s each)
#   --prebuilt DIR: the sides are DIR/a.xz (A), DIR/b.xz, ... (what each was built from in DIR/NAME.txt; their NCCL
#   version in DIR/nccl-version: the device's libnccl of that version is loaded); not with --host-time. A side may
#   be another's CLI in another environment: DIR/NAME.env, its first line cli=SIDE, then VAR=VALUE lines (e.g.
#   cli=b and CUDA_MODULE_LOADING=EAGER)
#   --budget S: seconds the script may take (default 570, under a device call's 600): a round (or a host-time round)
#   that the last one's duration says would not fit is not started, and the table is made of the rounds that ran
# The base's build is kept in /tmp/ferry-ab-base and reused by a later call with the same tarball (a warm machine),
# as build-device/ is: a second call spends its time on rounds, not on builds.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
help() { awk 'NR == 1 {next} /^#/ {print; next} {exit}' "$0"; }  # the comment above

[[ "${1:-}" == -h || "${1:-}" == --help ]] && { help; exit 0; }
BASE_TAR="" PREBUILT=""
if [[ "${1:-}" == --prebuilt ]]; then
  PREBUILT="${2:-}"
  [[ -f "$PREBUILT/a.xz" ]] || { echo "device-ab: --prebuilt DIR needs DIR/a.xz, the base's CLI (see --help)" >&2; exit 2; }
  shift 2
else
  BASE_TAR="${1:-}"
  [[ -f "$BASE_TAR" ]] || { echo "device-ab: give the base tree's tarball as the first argument (see --help)" >&2; exit 2; }
  shift
fi
ROUNDS=2 ITERS=30 SEED=7 QUICK=0 HOST_TIME=0 HOST_ONLY=0 KERNEL_TIME=0 KERNEL_STALLS=0 BUDGET=570
ALSO=()
ONLY=()
SOURCE_COUNTERS=()
KERNEL_RUNS=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --rounds) ROUNDS="$2"; shift 2 ;;
    --iters) ITERS="$2"; shift 2 ;;
    --seed) SEED="$2"; shift 2 ;;
    --quick) QUICK=1; shift ;;
    --host-time) HOST_TIME=1; shift ;;
    --host-only) HOST_ONLY=1; shift ;;
    --kernel-time) KERNEL_TIME=1; shift ;;
    --kernel-runs) KERNEL_TIME=1; KERNEL_RUNS+=("$2"); shift 2 ;;
    --kernel-stalls) KERNEL_TIME=1; KERNEL_STALLS=1; shift ;;
    --budget) BUDGET="$2"; shift 2 ;;
    --also) ALSO+=("$2"); shift 2 ;;
    --runs) ONLY+=("$2"); shift 2 ;;
    --source-counters) SOURCE_COUNTERS+=("$2"); shift 2 ;;
    -h|--help) help; exit 0 ;;
    *) echo "device-ab: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
[[ $HOST_ONLY -eq 1 && $HOST_TIME -eq 0 ]] && { echo "device-ab: --host-only needs --host-time" >&2; exit 2; }
[[ -n "$PREBUILT" && $HOST_TIME -eq 1 ]] &&
  { echo "device-ab: --host-time builds each side's Python module: not with --prebuilt" >&2; exit 2; }
# On the GPU machine (OUT set) the logs go to a scratch folder and come back as one archive, $OUT/ab-logs.tgz, with
# the source counters' exports beside it: a device call returns at most 8 files, and a run writes two per side and
# round besides the kernel-time exports.
if [[ -n "${OUT:-}" ]]; then
  LOGS=/tmp/ferry-ab-logs
  rm -rf "$LOGS"
  pack_logs() {
    [[ -f "$LOGS/source-counters.tgz" ]] && mv "$LOGS/source-counters.tgz" "$OUT/"
    tar -czf "$OUT/ab-logs.tgz" -C "$LOGS" . || echo "device-ab: the logs could not be packed; they are in $LOGS"
  }
  trap pack_logs EXIT
else
  LOGS="build-device/ab-logs"
fi
mkdir -p "$LOGS"
START=$SECONDS
stamp() { echo "== [$((SECONDS - START)) s] $*"; }

# Whether `seconds` more fit in the budget (with 15 s kept for the table).
fits() { (( SECONDS - START + $1 + 15 <= BUDGET )); }

BASE=/tmp/ferry-ab-base
SIDES=(a b)
# the sides in round ROUND's order: each round starts one side later (A B C, B C A, C A B, ...), so that no side always
# runs first, after the idle machine
sides_of_round() {
  local n=${#SIDES[@]} k
  for ((k = 0; k < n; ++k)); do echo "${SIDES[$((($1 - 1 + k) % n))]}"; done
}
# the ferry CLI of a side
bin_of() {
  if [[ -n "$PREBUILT" ]]; then echo "/tmp/ferry-ab-bin/$1"; elif [[ $1 == a ]]; then echo "$BASE/build/ferry"; else
    echo build-device/ferry; fi
}
if [[ -n "$PREBUILT" ]]; then
  rm -rf /tmp/ferry-ab-bin && mkdir -p /tmp/ferry-ab-bin
  SIDES=()
  for packed in "$PREBUILT"/[a-z].xz; do
    side=$(basename "$packed" .xz)
    xz -dc "$packed" >"/tmp/ferry-ab-bin/$side" && chmod +x "/tmp/ferry-ab-bin/$side" ||
      { echo "device-ab: cannot unpack $packed"; exit 2; }
    SIDES+=("$side")
    echo "device-ab: side ${side^^}: $(cat "$PREBUILT/$side.txt" 2>/dev/null)"
  done
  # A side NAME.env without NAME.xz: another side's CLI (its first line, cli=SIDE) run with the environment of its
  # other lines (VAR=VALUE each), e.g. the same build with CUDA_MODULE_LOADING=EAGER, in the same rounds.
  for env_file in "$PREBUILT"/[a-z].env; do
    [[ -f "$env_file" ]] || continue
    side=$(basename "$env_file" .env)
    [[ -f "$PREBUILT/$side.xz" ]] && { echo "device-ab: $env_file beside $side.xz; an env side has no CLI of its own"; exit 2; }
    cli=$(sed -n '1s/^cli=\([a-z]\)$/\1/p' "$env_file")
    [[ -n "$cli" && -x "/tmp/ferry-ab-bin/$cli" ]] ||
      { echo "device-ab: $env_file: its first line must be cli=SIDE, a side packed in $PREBUILT"; exit 2; }
    assignments=()
    while read -r line; do
      [[ "$line" =~ ^[A-Za-z_][A-Za-z0-9_]*=[^[:space:]]*$ ]] ||
        { echo "device-ab: $env_file: '$line' is not VAR=VALUE"; exit 2; }
      assignments+=("$line")
    done < <(tail -n +2 "$env_file")
    printf '#!/bin/sh\nexec env %s /tmp/ferry-ab-bin/%s "$@"\n' "${assignments[*]}" "$cli" >"/tmp/ferry-ab-bin/$side"
    chmod +x "/tmp/ferry-ab-bin/$side"
    SIDES+=("$side")
    echo "device-ab: side ${side^^}: side ${cli^^}'s CLI with ${assignments[*]}"
  done
  [[ ${#SIDES[@]} -ge 2 ]] || { echo "device-ab: --prebuilt $PREBUILT has one side; pack another"; exit 2; }
  nccl=$(scripts/device-prebuilt.sh nccl-dir "$(cat "$PREBUILT/nccl-version" 2>/dev/null)")
  [[ -n "$nccl" ]] && export LD_LIBRARY_PATH="$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  stamp "unpacked ${SIDES[*]} (no build); libnccl from ${nccl:-the default search path}"
else
  TAR_SUM=$(sha256sum "$BASE_TAR" | cut -d' ' -f1)
  if [[ -f "$BASE/.tar-sha256" && "$(cat "$BASE/.tar-sha256")" == "$TAR_SUM" ]]; then
    stamp "the base tree of this tarball is already in $BASE: its build is reused"
  else
    rm -rf "$BASE" && mkdir -p "$BASE" && tar -xf "$BASE_TAR" -C "$BASE" || { echo "device-ab: cannot unpack $BASE_TAR"; exit 2; }
    echo "$TAR_SUM" >"$BASE/.tar-sha256"
  fi
  stamp "configure + build: this tree (build-device) and the base ($BASE/build)"
  PY=python3
  [[ -x /opt/torch/.venv/bin/python3 ]] && PY=/opt/torch/.venv/bin/python3
  PY_ARGS=()
  TARGETS=(--target ferry_cli)
  if [[ $HOST_TIME -eq 1 ]]; then
    PY_ARGS=(-DFERRY_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$PY")
    TARGETS=(--target ferry_cli ferry_python)
  fi
  cmake -S . -B build-device -G Ninja -DCMAKE_BUILD_TYPE=Release "${PY_ARGS[@]}" >"$LOGS/configure-b.log" 2>&1 ||
    { tail "$LOGS/configure-b.log"; exit 2; }
  cmake -S "$BASE" -B "$BASE/build" -G Ninja -DCMAKE_BUILD_TYPE=Release "${PY_ARGS[@]}" >"$LOGS/configure-a.log" 2>&1 ||
    { tail "$LOGS/configure-a.log"; exit 2; }
  JOBS=$(nproc)
  # the same targets on both sides, half the cores each (the GPU tests are device-check.sh's, which builds them after)
  (cmake --build build-device -j $((JOBS / 2)) "${TARGETS[@]}" >"$LOGS/build-b.log" 2>&1; echo $? >"$LOGS/build-b.rc") &
  (cmake --build "$BASE/build" -j $((JOBS / 2)) "${TARGETS[@]}" >"$LOGS/build-a.log" 2>&1; echo $? >"$LOGS/build-a.rc") &
  wait
  for side in a b; do
    if [[ "$(cat "$LOGS/build-$side.rc")" != 0 ]]; then
      grep -E "FAILED|error" "$LOGS/build-$side.log" | head -n 10
      [[ -x "$(bin_of "$side")" ]] || { echo "device-ab: build $side failed"; exit 1; }
    fi
  done
  stamp "built"
fi

if [[ $QUICK -eq 1 ]]; then
  RUNS=("--mode normal --tokens 128 --dispatch bf16 --combine bf16" "--mode ll --tokens 1,128 --dispatch bf16 --combine bf16")
else
  RUNS=("--mode normal --tokens 128,4096 --dispatch bf16,fp8 --combine bf16,fp8"
        "--mode ll --tokens 1,128,512 --dispatch bf16,fp8 --combine bf16,fp8")
fi
[[ ${#ONLY[@]} -gt 0 ]] && RUNS=("${ONLY[@]}")
RUNS+=("${ALSO[@]}")
ROUND_S=0  # the last round's duration: a round that would not fit in the budget is not started
ROUNDS_RUN=0
LEG_ROUNDS=$ROUNDS
[[ $HOST_ONLY -eq 1 ]] && LEG_ROUNDS=0
for ((round = 1; round <= LEG_ROUNDS; ++round)); do
  if ! fits "$ROUND_S"; then
    echo "device-ab: round $round and later not run: $((BUDGET - (SECONDS - START))) s of the budget left, a round took ${ROUND_S} s"
    break
  fi
  round_start=$SECONDS
  for side in $(sides_of_round "$round"); do
    bin=$(bin_of "$side")
    for i in "${!RUNS[@]}"; do
      # shellcheck disable=SC2086
      timeout 150 "$bin" bench ${RUNS[$i]} --graph --check --iters "$ITERS" --seed "$SEED" \
        --json "$LOGS/$side-$round-$i.json" >"$LOGS/$side-$round-$i.log" 2>&1 || echo "device-ab: run $side $round $i exit $?"
    done
  done
  ROUND_S=$((SECONDS - round_start))
  ROUNDS_RUN=$round
  stamp "round $round done"
done

NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1)
if [[ ${#SOURCE_COUNTERS[@]} -gt 0 ]]; then
  if [[ -z "$NCU" ]]; then
    echo "device-ab: --source-counters needs ncu, which this machine lacks"
  else
    exports=()
    for i in "${!SOURCE_COUNTERS[@]}"; do
      kernel="${SOURCE_COUNTERS[$i]%%|*}"
      bench_args="${SOURCE_COUNTERS[$i]#*|}"
      for side in "${SIDES[@]}"; do
        if ! fits 45; then
          echo "device-ab: source counters of $kernel ($side) and later not run:" \
            "$((BUDGET - (SECONDS - START))) s of the budget left"
          break 2
        fi
        bin=$(bin_of "$side")
        report="/tmp/ferry-ab-sc-$i-$side"
        # shellcheck disable=SC2086
        timeout 150 "$NCU" --clock-control none --cache-control none -k "$kernel" --launch-skip 5 -c 20 \
          --section SourceCounters -o "$report" -f "$bin" bench $bench_args --iters 25 --warmup 2 --seed "$SEED" \
          >"$LOGS/sc-$i-$side.log" 2>&1 || echo "device-ab: ncu source counters $i $side exit $?"
        "$NCU" -i "$report.ncu-rep" --page source --csv --print-source sass >"$LOGS/sc-$i-$side.csv" \
          2>>"$LOGS/sc-$i-$side.log" && exports+=("sc-$i-$side.csv")
      done
      echo "== source counters $i: $kernel, ferry bench $bench_args"
      # its two summary lines (a note comes before them when A's and B's kernel names differ), or its error
      for side in "${SIDES[@]:1}"; do
        [[ ${#SIDES[@]} -gt 2 ]] && echo "A against ${side^^} (as B):"
        python3 scripts/ncu-source-diff.py "$LOGS/sc-$i-a.csv" "$LOGS/sc-$i-$side.csv" --top 8 2>&1 |
          grep -E '^  [AB]: |ncu-source-diff'
      done
    done
    # one file for the device call to bring back, not two per workload
    if [[ ${#exports[@]} -gt 0 ]] && tar -czf "$LOGS/source-counters.tgz" -C "$LOGS" "${exports[@]}"; then
      rm -f "${exports[@]/#/$LOGS/}"
    fi
  fi
  stamp "source counters done"
fi

if [[ $KERNEL_TIME -eq 1 ]]; then
  [[ ${#KERNEL_RUNS[@]} -eq 0 ]] && KERNEL_RUNS=("--mode ll --tokens 1 --dispatch bf16 --combine bf16"
    "--mode ll --tokens 1 --dispatch fp8 --combine fp8")
  if [[ -z "$NCU" ]]; then
    echo "device-ab: --kernel-time needs ncu, which this machine lacks"
  elif ! fits $((2 * ${#SIDES[@]} * ${#KERNEL_RUNS[@]} * (KERNEL_STALLS == 1 ? 14 : 8))); then
    echo "device-ab: kernel time not run: $((BUDGET - (SECONDS - START))) s of the budget left"
  else
    METRICS=gpu__time_duration.sum,sm__inst_executed.sum,launch__grid_size,launch__registers_per_thread
    [[ $KERNEL_STALLS -eq 1 ]] && METRICS+=',regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
    for round in 1 2; do
      for side in $(sides_of_round "$round"); do
        bin=$(bin_of "$side")
        for w in "${!KERNEL_RUNS[@]}"; do
          # shellcheck disable=SC2086  # a workload is a list of arguments
          timeout 100 "$NCU" --clock-control none --cache-control none -c 60 --csv \
            --metrics "$METRICS" \
            "$bin" bench ${KERNEL_RUNS[$w]} --iters 10 --seed "$SEED" \
            >"$LOGS/ncu-$side-$w-$round.csv" 2>"$LOGS/ncu-$side-$w-$round.err" ||
            echo "device-ab: ncu $side workload $w round $round exit $?"
        done
      done
    done
    python3 - "$LOGS" "${#KERNEL_RUNS[@]}" "${SIDES[@]}" "${KERNEL_RUNS[@]}" <<'PY'
import collections, csv, glob, os, re, statistics, sys
logs, n = sys.argv[1], int(sys.argv[2])
sides, workloads = sys.argv[3:len(sys.argv) - n], sys.argv[len(sys.argv) - n:]
metrics = ("gpu__time_duration.sum", "sm__inst_executed.sum", "launch__grid_size", "launch__registers_per_thread")
STALL = "smsp__average_warps_issue_stalled_"

def short(name):  # the kernel's function name and template arguments, without namespaces and casts
    name = re.sub(r"\((?:ferry::)?[\w:]+\)", "", name)
    name = re.sub(r"^void\s+", "", name)
    return re.sub(r"\b(?:[a-z_]\w*::)+", "", name).replace(" ", "")[:70]

# A kernel is matched across the sides by its function name and the order in which its instances first ran (the
# sides' template arguments may differ: a later tree adds some); shown by its name with A's template arguments.
# (workload, function, instance) -> metric -> [median of each run]
runs = collections.defaultdict(lambda: collections.defaultdict(list))
shown = {}
for path in sorted(glob.glob(os.path.join(logs, "ncu-*-*-*.csv"))):
    side, w = os.path.basename(path).split("-")[1:3]
    values = collections.defaultdict(lambda: collections.defaultdict(list))
    order = collections.defaultdict(list)  # function -> its instances' names, in the order they first ran
    with open(path) as f:
        for r in csv.DictReader(line for line in f if line.startswith('"')):
            if r.get("Metric Name") in metrics or r.get("Metric Name", "").startswith(STALL):
                name = short(r["Kernel Name"])
                function = name.split("<")[0]
                if name not in order[function]:
                    order[function].append(name)
                key = (function, order[function].index(name))
                shown.setdefault((int(w), key, side), name)
                values[key][r["Metric Name"]].append(float(r["Metric Value"].replace(",", "")))
    for key, got in values.items():
        for name, v in got.items():
            runs[(int(w), key, side)][name].append(statistics.median(v))
print("kernel time (ncu; median of each run's launches, then of the runs; grid in CTAs, registers per thread)")
for w, args in enumerate(workloads):
    print(f"ferry bench {args}")
    kernels = sorted({k for (x, k, _) in runs if x == w})
    if not kernels:
        print("  no kernels (see ncu-*.err)")
    for k in kernels:
        got = [runs.get((w, k, x)) for x in sides]
        print("  " + next(shown[(w, k, x)] for x in sides if (w, k, x) in shown))
        # each side's duration, instructions, grid and registers (None: the kernel did not run there)
        vals = [[statistics.median(g[m]) if g[m] else float("nan") for m in metrics] if g else None for g in got]
        cols = [f"{x.upper()}: " + (f"{v[0]:.0f} ns {v[1]:.0f} instr {v[2]:.0f}x{v[3]:.0f}" if v else "-")
                for x, v in zip(sides, vals)]
        ratios = " ".join(f"{x.upper()}/A {v[0] / vals[0][0]:.3f}" for x, v in zip(sides[1:], vals[1:]) if v and vals[0])
        print("    " + " | ".join(cols) + (f" | {ratios}" if ratios else ""))
        if all(got):  # stalled warps per issued instruction, the six reasons that differ most between the sides
            reasons = sorted({m for g in got for m in g if m.startswith(STALL)})
            per = {m: [statistics.median(g[m]) if g.get(m) else 0.0 for g in got] for m in reasons}
            top = sorted(per, key=lambda m: max(per[m]) - min(per[m]), reverse=True)[:6]
            for m in top:
                name = m[len(STALL):].replace("_per_issue_active.ratio", "")
                print(f"      stalled {name:<20}" + " ".join(f"{x.upper()} {v:6.3f}" for x, v in zip(sides, per[m])))
PY
  fi
  stamp "kernel time done"
fi

if [[ $HOST_TIME -eq 1 ]]; then
  HOST_ROUND_S=120  # a host-time round (A and B, both modes) before one has run: four imports and 21 loops each
  for ((round = 1; round <= ROUNDS; ++round)); do
    if ! fits "$HOST_ROUND_S"; then
      echo "device-ab: host time round $round and later not run: $((BUDGET - (SECONDS - START))) s of the budget left"
      break
    fi
    host_start=$SECONDS
    for mode in normal ll; do
      for side in a b; do
        build=$([[ $side == a ]] && echo "$BASE/build" || echo build-device)
        log="$LOGS/host-$mode-$side-$round.log"
        PYTHONPATH="$build/python" timeout 120 "$PY" -m torch.distributed.run --nproc-per-node 1 \
          python/bench_overhead.py --mode "$mode" --tokens 1 --iters 50 --repeats 21 >"$log" 2>&1 ||
          echo "device-ab: host time $mode $side $round exit $?"
        echo "host time $mode $side round $round: $(grep -h 'from Python' "$log" | head -n 1)"
      done
    done
    HOST_ROUND_S=$((SECONDS - host_start))
  done
  stamp "host time done"
fi

python3 - "$LOGS" "$ROUNDS_RUN" "${#RUNS[@]}" "${SIDES[@]}" <<'PY'
import json, os, statistics, sys
logs, rounds, runs, sides = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4:]
med = {side: {} for side in sides}
checks = {side: set() for side in sides}
for side in sides:
    for r in range(1, rounds + 1):
        for i in range(runs):
            path = os.path.join(logs, f"{side}-{r}-{i}.json")
            try:
                doc = json.load(open(path))
            except Exception:
                continue
            for rec in doc["records"]:
                key = (rec["mode"], rec.get("layout", "-"), rec["leg"], rec["tokens"],
                       rec.get("dispatch_format", rec.get("format")), rec.get("combine_format", rec.get("format")))
                med[side].setdefault(key, []).append(rec["median_us"])
                checks[side].add(rec["check"])
# each leg: the median over the rounds of each side, each side / A, and the rounds' range of each side (the noise)
span = lambda v: f"{min(v):.2f}-{max(v):.2f}" if v else "-"
med_of = lambda v: statistics.median(v) if v else float("nan")
up = [x.upper() for x in sides]
print(f"{'mode':<7} {'layout':<7} {'leg':<9} {'tokens':>6} {'dispatch':<9} {'combine':<9} " +
      " ".join(f"{x + ' us':>8}" for x in up) + " " + " ".join(f"{x + '/A':>6}" for x in up[1:]) + "  " +
      " ".join(f"{x + ' rounds':<13}" for x in up))
for key in sorted(set().union(*(med[x] for x in sides))):
    v = [med[x].get(key, []) for x in sides]
    m = [med_of(x) for x in v]
    print(f"{key[0]:<7} {key[1]:<7} {key[2]:<9} {key[3]:>6} {key[4]:<9} {key[5]:<9} " +
          " ".join(f"{x:8.2f}" for x in m) + " " + " ".join(f"{x / m[0]:6.3f}" for x in m[1:]) + "  " +
          " ".join(f"{span(x):<13}" for x in v))
print("checks: " + ", ".join(f"{x.upper()} {sorted(checks[x])}" for x in sides))
PY
stamp "done"
