#!/usr/bin/env bash
# On the GPU machine, from the repo root: the expert-parallel run at this machine's world size (one rank per GPU),
# what issue 9 asks of a 4 or 8 x H200 machine. First the all-to-all ceiling of that world (`ferry p2p --directions
# alltoall`: every GPU pushing to / pulling from every other at once), then `ferry bench` in graph mode, normal mode
# (128 / 512 / 4096 tokens) and low-latency mode (1 / 128 / 512), dispatch bf16 and fp8, combine bf16 and fp8, random
# and grouped routing, every row checked against the reference, with the NCCL all-to-all baseline of the same inputs;
# then, with --tune, `scripts/device-tune.sh --shapes deepseek` for this world. Builds first (through
# scripts/device-check.sh --no-tests --no-bench) when build-device/ferry is missing. Keeps the logs and the --json
# result files (in $OUT when set, else build-device/logs) and prints a table, the ceiling and the EP8 goals last.
# Exit status: non-zero when p2p or a bench failed, or a row's check failed.
#
# usage: scripts/device-scale.sh [--quick] [--tune] [--iters N]
#   --quick    4096 / 128 tokens only, 10 iterations (a smoke run; its rows are still measurements)
#   --tune     also tune the DeepSeek shape for this world (several minutes; see scripts/device-tune.sh)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

BUILD=build-device
LOGS="${OUT:-$BUILD/logs}"
QUICK=0 TUNE=0 ITERS=20
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; ITERS=10; shift ;;
    --tune) TUNE=1; shift ;;
    --iters) ITERS="$2"; shift 2 ;;
    -h|--help) sed -n '2,14p' "$0"; exit 0 ;;
    *) echo "device-scale: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
mkdir -p "$LOGS"
START=$SECONDS
stamp() { echo "== [$((SECONDS - START)) s] $*"; }
if [[ ! -x "$BUILD/ferry" ]]; then
  stamp "build (scripts/device-check.sh --no-tests --no-bench)"
  scripts/device-check.sh --no-tests --no-bench | tail -n 4
  [[ -x "$BUILD/ferry" ]] || { echo "device-scale: $BUILD/ferry did not build (logs in $LOGS)"; exit 2; }
fi
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
echo "device-scale: $GPUS GPU(s), one rank each"

P2P_RC=0
if [[ $GPUS -ge 2 ]]; then
  # the ceiling of this world's legs: every GPU pushing to (pulling from) every other at once
  stamp "ferry p2p --directions alltoall"
  timeout 120 "$BUILD/ferry" p2p --nproc "$GPUS" --directions alltoall --ops push,pull --sizes 16MiB,256MiB \
    --ctas "$((GPUS - 1)),32,66,132" --json "$LOGS/scale-p2p.json" >"$LOGS/scale-p2p.log" 2>&1 || P2P_RC=$?
  tail -n 12 "$LOGS/scale-p2p.log"
fi

NORMAL_TOKENS="128,512,4096" LL_TOKENS="1,128,512"
[[ $QUICK -eq 1 ]] && { NORMAL_TOKENS="4096"; LL_TOKENS="128"; }
# bf16/bf16, fp8 dispatch, fp8 combine: every leg of both formats, the pairs the engines run
COMMON=(--graph --check --baseline nccl --routing "random,grouped" --dispatch "bf16,fp8,bf16"
        --combine "bf16,bf16,fp8" --iters "$ITERS" --seed 0)
BENCH_RC=0
stamp "ferry bench, normal mode, tokens $NORMAL_TOKENS"
timeout 300 "$BUILD/ferry" bench --tokens "$NORMAL_TOKENS" "${COMMON[@]}" --json "$LOGS/scale-normal.json" \
  >"$LOGS/scale-normal.log" 2>&1 || BENCH_RC=$?
head -n 1 "$LOGS/scale-normal.log"
stamp "ferry bench, low-latency mode, tokens $LL_TOKENS"
timeout 240 "$BUILD/ferry" bench --mode ll --tokens "$LL_TOKENS" "${COMMON[@]}" --json "$LOGS/scale-ll.json" \
  >"$LOGS/scale-ll.log" 2>&1 || BENCH_RC=$?
head -n 1 "$LOGS/scale-ll.log"
TUNE_RC=0
if [[ $TUNE -eq 1 ]]; then
  stamp "scripts/device-tune.sh --shapes deepseek"
  TUNE_ARGS=(--shapes deepseek)
  [[ $QUICK -eq 1 ]] && TUNE_ARGS+=(--quick)
  scripts/device-tune.sh "${TUNE_ARGS[@]}" >"$LOGS/scale-tune.log" 2>&1 || TUNE_RC=$?
  sed -n '/device-tune summary/,$p' "$LOGS/scale-tune.log"
fi
stamp "done"
echo
echo "================ device-scale summary ================"
python3 - "$LOGS" "$GPUS" <<'PY' || BENCH_RC=1
import json, os, sys
logs, gpus = sys.argv[1], int(sys.argv[2])
rows, failed, world = [], False, None
for name in ("scale-normal.json", "scale-ll.json"):
    try:
        with open(os.path.join(logs, name)) as f:
            result = json.load(f)
    except Exception:
        print(f"{name}: no result (see {name[:-5]}.log)")
        failed = True
        continue
    world = result.get("world")
    rows += result["records"]
# a leg of one format shows once (a bf16 combine is the same leg after a bf16 or an fp8 dispatch)
seen, legs = set(), []
for r in rows:
    key = (r["mode"], r["routing"], r["leg"], r["format"], r["tokens"])
    failed |= r["check"] not in ("pass", "skipped")
    if key not in seen:
        seen.add(key)
        legs.append(r)
graph = "graph mode" if rows and rows[0]["graph"] else "stream launches"
print(f"world {world}, hidden {rows[0]['hidden'] if rows else '?'}, {graph}; us = the slowest rank's median")
print(f"{'mode':<7}{'routing':<9}{'leg':<9}{'format':<7}{'tokens':>6}{'us':>9}{'nvlink':>8}{'logical':>9}"
      f"{'nccl_us':>9}{'vs nccl':>8}  check")
for r in legs:
    nccl = r.get("baseline_us")
    nccl_us = f"{nccl:.1f}" if nccl else "-"
    speedup = f"{nccl / r['median_us']:.2f}x" if nccl else "-"
    print(f"{r['mode']:<7}{r['routing']:<9}{r['leg']:<9}{r['format']:<7}{r['tokens']:>6}{r['median_us']:>9.1f}"
          f"{r['nvlink_gbps']:>8.1f}{r['logical_gbps']:>9.1f}{nccl_us:>9}{speedup:>8}  {r['check']}")
def first(mode, leg, tokens):
    for r in rows:
        pair = (r.get("dispatch_format", "bf16"), r.get("combine_format", "bf16"))
        if (r["mode"], r["leg"], r["tokens"], r["routing"], pair) == (mode, leg, tokens, "random", ("bf16", "bf16")):
            return r
at = "" if world == 8 else f" (the goals are stated at EP8; this run is world {world})"
print(f"goals, bf16, random routing{at}:")
for mode, leg, tokens, key, goal, better in (("normal", "dispatch", 4096, "logical_gbps", 370.0, "higher"),
                                             ("ll", "dispatch", 128, "median_us", 25.0, "lower"),
                                             ("ll", "combine", 128, "median_us", 30.0, "lower")):
    r = first(mode, leg, tokens)
    unit = "GB/s logical" if key == "logical_gbps" else "us"
    if r is None:
        print(f"  {mode} {leg} {tokens} tokens: not run")
        continue
    met = r[key] >= goal if better == "higher" else r[key] <= goal
    verdict = ("met" if met else "missed") if world == 8 else "not judged below EP8"
    print(f"  {mode:<7}{leg:<9}{tokens:>5} tokens: {r[key]:8.1f} {unit} (goal {'>=' if better == 'higher' else '<='} "
          f"{goal:g}): {verdict}")
try:
    with open(os.path.join(logs, "scale-p2p.json")) as f:
        p2p = json.load(f)["records"]
    for op in ("push", "pull"):
        best = max((r for r in p2p if r["op"] == op and r["bytes"] == 256 << 20), key=lambda r: r["gbps"], default=None)
        if best:
            print(f"all-to-all {op} ceiling, 256 MiB to each of {best['peers']} peers: {best['gbps']:.1f} GB/s sent a "
                  f"GPU ({best['gbps_sum']:.1f} sent + received) at {best['ctas']} CTAs")
except FileNotFoundError:
    print("all-to-all ceiling: not measured (one GPU)")
print(f"logs: {logs}")
sys.exit(1 if failed else 0)
PY
[[ $TUNE -eq 1 ]] && echo "tune: $([[ $TUNE_RC -eq 0 ]] && echo ok || echo "FAILED (exit $TUNE_RC)"), table copied to \$OUT when set"
if [[ $BENCH_RC -ne 0 || $TUNE_RC -ne 0 || $P2P_RC -ne 0 ]]; then
  echo "device-scale: FAILED (bench exit $BENCH_RC, tune exit $TUNE_RC, p2p exit $P2P_RC)"
  exit 1
fi
echo "device-scale: OK"
