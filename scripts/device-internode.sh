#!/usr/bin/env bash
# On a GPU machine of 2 GPUs (or more: the first 2 are used), from the repo root: Ferry's inter-node paths on emulated
# nodes over NVLink (docs/internode.md), in one device call. Builds the CLI and the GPU tests (build-device/), then:
#  1. `ferry bench --topology 2x1` (2 emulated nodes of one GPU each: the other GPU only through the emulated network)
#     and `--topology 1x2` (today's one-node path) in the same run, graph mode, every row checked (--check):
#     normal mode (hierarchical across nodes) at 128 and 4096 tokens; low-latency mode at 1, 128 and 512 tokens, both
#     routes across nodes (forward and direct; automatic is direct up to 2 tokens, else forward); bf16 and fp8 both
#     ways; random and grouped routing. Across nodes bench prints each leg's network and NVLink bytes per rank beside
#     ferry model's count (the cuda low-latency kernels count nothing: the model's count alone). These runs set
#     FERRY_EMULATED_DELAY_NS=0 (no injected delay; deliveries still reordered), so their times are the protocol over
#     the emulated transport: never network figures.
#  2. a pass with the emulated network's default delays (up to 20 us a delivery, reordered): --mode both at 2 and 128
#     tokens, route automatic, 2x1, checked (correctness under delays, not timed figures);
#  3. the refusal of a quantized low-latency combine across nodes past its hidden limit (the library's ConfigError);
#  4. GIN forced (FERRY_NETWORK=gin): the GinSetup test, and `ferry bench --topology 2x1` over 2 GPUs (what GIN setup
#     says on this machine);
#  5. the virtual-rank inter-node tests, one GPU each, side by side: InternodeVirtual.* on GPU 0 and
#     LowLatencyAcrossNodes.* on GPU 1, while the budget lasts.
# Every step is bounded by the budget (--budget S, default 560) and FERRY_TIMEOUT_S (default 20 here). Logs and JSON
# go to one archive, $OUT/internode-logs.tgz (else build-device/internode-logs.tgz), refreshed after every step, and
# the summary to summary.txt beside it; the summary is printed last.
# usage: [FERRY_BUILD_DIR=DIR] scripts/device-internode.sh [--budget S] [--no-build]
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
BUDGET=560
BUILD_STEP=1
while [[ $# -gt 0 ]]; do
  case "$1" in
    --budget) BUDGET="$2"; shift 2 ;;
    --no-build) BUILD_STEP=0; shift ;;
    -h|--help) sed -n '2,22p' "$0"; exit 0 ;;
    *) echo "device-internode: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
# NVLink multicast stays off in everything this starts (DESIGN "Safety")
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERRY_TIMEOUT_S="${FERRY_TIMEOUT_S:-20}"
START=$SECONDS
left() { echo $((BUDGET - (SECONDS - START))); }
stamp() { echo "== [$((SECONDS - START)) s] $*"; }
BUILD="${FERRY_BUILD_DIR:-build-device}"  # a second call can reuse a build kept outside a carried folder
DEST="${OUT:-$BUILD}"
LOGS=$(mktemp -d /tmp/internode-logs.XXXX)
mkdir -p "$DEST"
SUMMARY=()
pack() {
  printf '%s\n' "${SUMMARY[@]}" >"$LOGS/summary.txt"
  cp "$LOGS/summary.txt" "$DEST/summary.txt"
  tar -czf "$DEST/internode-logs.tgz" -C "$LOGS" . 2>/dev/null
}
note() { SUMMARY+=("$*"); pack; }

{
  nvidia-smi -L
  nvidia-smi topo -m
  git log -1 --format='commit %h %s' 2>/dev/null
  date -u
} >"$LOGS/machine.log" 2>&1
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
note "machine: $GPUS GPU(s): $(nvidia-smi -L 2>/dev/null | head -n 1 | cut -c1-40); $(nvidia-smi topo -m 2>/dev/null | grep -m1 '^GPU0' | tr -s ' \t' ' ')"
[[ $GPUS -ge 2 ]] || { note "device-internode: needs 2 GPUs, found $GPUS"; cat "$LOGS/summary.txt"; exit 2; }
export CUDA_VISIBLE_DEVICES=0,1

# 0. build only what runs (cmake picks the PyTorch wheel's NCCL, the libnccl a torch process loads)
if [[ $BUILD_STEP -eq 1 ]]; then
  stamp "configure + build ferry_cli ferry_gpu_tests"
  cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$LOGS/configure.log" 2>&1 ||
    { note "configure failed: $(tail -n 3 "$LOGS/configure.log" | tr '\n' ' ')"; cat "$LOGS/summary.txt"; exit 2; }
  cmake --build "$BUILD" -j "$(nproc)" --target ferry_cli ferry_gpu_tests -- -k 0 >"$LOGS/build.log" 2>&1
  rc=$?
  note "build: exit $rc after $((SECONDS - START)) s$([[ $rc -ne 0 ]] && grep -m3 -E 'FAILED|error' "$LOGS/build.log" | tr '\n' ' ')"
fi
FERRY="$BUILD/ferry"
TESTS="$BUILD/tests/ferry_gpu_tests"

# bench NAME SECONDS_CAP ARGS...: one bench run, its log and JSON; a line for the summary
bench() {
  local name="$1" cap="$2"
  shift 2
  local budget=$(($(left) - 25))
  [[ $budget -gt $cap ]] && budget=$cap
  if [[ $budget -lt 20 ]]; then
    note "$name: not run (budget)"
    return
  fi
  stamp "bench $name (at most $budget s): $*"
  echo "ferry bench $* --json $name.json" >"$LOGS/$name.log"
  timeout -k 5 "$budget" "$FERRY" bench "$@" --json "$LOGS/$name.json" >>"$LOGS/$name.log" 2>&1
  local rc=$?
  note "$name: exit $rc$([[ $rc -eq 124 ]] && echo ' (TIMED OUT)'), $(grep -c 'PASS$' "$LOGS/$name.log") PASS rows, $(grep -c 'FAIL$' "$LOGS/$name.log") FAIL rows, $(grep -c ', equal)' "$LOGS/$name.log") legs' bytes equal to the model, $(grep -c DIFFERENT "$LOGS/$name.log") DIFFERENT"
  while read -r line; do note "  $name: $line"; done < <(grep -m3 -E "error \(|check failed|TimeoutError|what\(\)" "$LOGS/$name.log" | cut -c1-400)
}

COMMON=(--graph --check --warmup 3 --iters 10 --seed 44 --routing random,grouped --dispatch bf16,fp8 --combine bf16,fp8
  --explain)
# 1. the figures: 2x1 and 1x2 side by side, normal then low-latency
export FERRY_EMULATED_DELAY_NS=0
bench normal-2x1 120 --topology 2x1 --tokens 128,4096 "${COMMON[@]}"
bench normal-1x2 90 --topology 1x2 --tokens 128,4096 "${COMMON[@]}"
bench ll-2x1 150 --topology 2x1 --mode ll --route forward,direct --tokens 1,128,512 "${COMMON[@]}"
bench ll-1x2 90 --topology 1x2 --mode ll --tokens 1,128,512 "${COMMON[@]}"
unset FERRY_EMULATED_DELAY_NS

# 2. under the emulated network's default delays (correctness; the times include the injected delays)
bench delays-2x1 60 --topology 2x1 --mode both --tokens 2,128 --check --warmup 1 --iters 3 --seed 45 \
  --dispatch bf16,fp8 --combine bf16,fp8 --explain

# 3. the library's refusal of a quantized LL combine across nodes past its hidden limit
if [[ $(left) -gt 40 ]]; then
  timeout -k 5 30 "$FERRY" bench --topology 2x1 --mode ll --tokens 1 --hidden 18432 --combine fp8 --iters 1 \
    --warmup 0 >"$LOGS/refusal.log" 2>&1
  note "refusal (ll, 2x1, hidden 18432, combine fp8): exit $?: $(grep -m1 'error (' "$LOGS/refusal.log" | cut -c1-400)"
fi

# 4. GIN forced: the setup test at world 1, and a 2-GPU communicator with FERRY_NETWORK=gin
if [[ $(left) -gt 40 ]]; then
  stamp "GIN probes"
  FERRY_NETWORK=gin timeout -k 5 60 "$TESTS" --gtest_filter='GinSetup.*' >"$LOGS/gin-test.log" 2>&1
  note "GinSetup.* with FERRY_NETWORK=gin: exit $?, $(grep -c '^\[       OK' "$LOGS/gin-test.log") OK"
  FERRY_NETWORK=gin NCCL_DEBUG=WARN timeout -k 5 60 "$FERRY" bench --topology 2x1 --tokens 128 --iters 1 \
    --warmup 0 >"$LOGS/gin-bench.log" 2>&1
  note "ferry bench --topology 2x1 with FERRY_NETWORK=gin: exit $?"
  while read -r line; do note "  gin: $line"; done < <(grep -m1 'error (' "$LOGS/gin-bench.log" | fold -w 200)
fi

# 5. the virtual-rank tests, one GPU each, side by side (correctness: their times are not figures)
budget=$(($(left) - 15))
if [[ $budget -ge 30 ]]; then
  stamp "virtual-rank tests, at most $budget s"
  CUDA_VISIBLE_DEVICES=0 timeout -k 5 "$budget" "$TESTS" --gtest_filter='InternodeVirtual.*' \
    >"$LOGS/internode-virtual.log" 2>&1 &
  a=$!
  CUDA_VISIBLE_DEVICES=1 timeout -k 5 "$budget" "$TESTS" --gtest_filter='LowLatencyAcrossNodes.*' \
    >"$LOGS/ll-across-nodes.log" 2>&1 &
  b=$!
  wait $a
  ra=$?
  wait $b
  rb=$?
  for pair in "InternodeVirtual.*:$ra:internode-virtual" "LowLatencyAcrossNodes.*:$rb:ll-across-nodes"; do
    IFS=: read -r filter rc log <<<"$pair"
    f="$LOGS/$log.log"
    note "$filter: exit $rc$([[ $rc -eq 124 ]] && echo ' (budget: stopped)'), OK: $(grep '^\[       OK' "$f" | sed -E 's/.*\] [A-Za-z]+\.([A-Za-z0-9_]+).*\(([0-9]+) ms\)/\1 \2ms/' | tr '\n' ',' | sed 's/,$//'); FAILED: $(grep -c '^\[  FAILED' "$f"); last started: $(grep '^\[ RUN' "$f" | tail -n 1 | cut -c14-)"
  done
else
  note "virtual-rank tests: not run (budget)"
fi

# summary: every bench case (slowest rank's medians), then the steps
python3 - "$LOGS" >"$LOGS/table.txt" 2>&1 <<'EOF'
import glob, json, os, sys
rows = {}
for path in sorted(glob.glob(os.path.join(sys.argv[1], "*.json"))):
    name = os.path.basename(path)[:-5]
    for r in json.load(open(path))["records"]:
        route = {"hierarchical": "hier"}.get(r.get("route", "-"), r.get("route", "-"))
        key = (name, route, r["tokens"], r["routing"], r["dispatch_format"] + "/" + r["combine_format"], r["mode"])
        rows.setdefault(key, {})[r["leg"]] = r
print("%-10s %-7s %5s %-7s %-9s %8s %8s %-5s %s" % ("run", "route", "tok", "routing", "formats", "disp_us", "comb_us",
                                                    "check", "network B/rank, dispatch / combine: counted (model)"))
for key, legs in rows.items():
    d, c = legs.get("dispatch", {}), legs.get("combine", {})
    check = "PASS" if d.get("check") == c.get("check") == "pass" else d.get("check", "?") + "/" + c.get("check", "?")
    def bytes_of(r):
        if "model_network_bytes" not in r: return ""
        got = "%.0f" % r["network_bytes"] if "network_bytes" in r else "n/c"
        return "%s (%.0f)" % (got, r["model_network_bytes"])
    run = key[0] if key[5] in key[0] else key[0] + ":" + key[5]
    nb = "%s / %s" % (bytes_of(d), bytes_of(c)) if bytes_of(d) else ""
    print("%-10s %-7s %5d %-7s %-9s %8.1f %8.1f %-5s %s" % (run, key[1], key[2], key[3], key[4], d.get("median_us", -1),
          c.get("median_us", -1), check, nb))
EOF
pack
echo "== steps"
printf '%s\n' "${SUMMARY[@]}"
echo "== summary (emulated nodes on one host over NVLink, slowest rank's medians: not network figures; $((SECONDS - START)) s)"
cat "$LOGS/table.txt"
