#!/usr/bin/env bash
# On a GPU machine of several GPUs, from the repo root: the inter-node paths on emulated nodes over NVLink (issue 31,
# docs/internode.md). Builds Ferry (build-device/), then for each topology the machine's GPUs allow (2 GPUs: 2x1;
# 4: 2x2; 8: 2x4, 4x2 and 1x8, the last against today's intranode path in the same run) runs `ferry bench --topology`
# in normal mode at 128 and 4096 tokens, bf16 dispatch with bf16 and fp8 combine (a quantized dispatch across nodes is
# refused on cuda in this version), random and grouped routing, every row checked, with
# the network and NVLink bytes per rank beside ferry model's count; then the virtual-rank inter-node tests, and
# the GIN setup test with FERRY_NETWORK=gin (what GIN setup says on this machine). Logs and JSON in $OUT (else
# build-device/logs); a short table last. The figures are emulated nodes on one host, never network figures.
# Low-latency mode across nodes has no cuda kernels yet: it is not run.
# usage: scripts/device-internode.sh [--budget S]
set -uo pipefail
cd "$(dirname "$0")/.."
BUDGET=570
while [[ $# -gt 0 ]]; do
  case "$1" in
    --budget) BUDGET="$2"; shift 2 ;;
    -h|--help) sed -n '2,10p' "$0"; exit 0 ;;
    *) echo "device-internode: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
START=$(date +%s)
left() { echo $((BUDGET - ($(date +%s) - START))); }
BUILD=build-device
LOGS=${OUT:-$BUILD/logs}
mkdir -p "$LOGS"

cmake -S . -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release >"$LOGS/configure.log" 2>&1 || { tail -n 30 "$LOGS/configure.log"; exit 2; }
cmake --build "$BUILD" -j "$(nproc)" --target ferry ferry_gpu_tests >"$LOGS/build.log" 2>&1 ||
  { grep -E "FAILED|error" "$LOGS/build.log" | head -n 20; exit 2; }

GPUS=$(nvidia-smi -L 2>/dev/null | wc -l)
case "$GPUS" in
  2) TOPOLOGIES="2x1" ;;
  4) TOPOLOGIES="2x2" ;;
  8) TOPOLOGIES="2x4 4x2 1x8" ;;
  *) echo "device-internode: $GPUS GPUs; this runs on 2, 4 or 8"; TOPOLOGIES="" ;;
esac

SUMMARY=()
for topology in $TOPOLOGIES; do
  [[ $(left) -lt 60 ]] && { SUMMARY+=("$topology: not run (budget)"); continue; }
  log="$LOGS/bench-$topology.log"
  timeout $(($(left) - 30)) "$BUILD/ferry" bench --topology "$topology" --tokens 128,4096 --routing random,grouped \
    --dispatch bf16 --combine bf16,fp8 --layout expert --check --iters 10 --json "$LOGS/bench-$topology.json" \
    >"$log" 2>&1
  rc=$?
  SUMMARY+=("$topology: bench exit $rc, $(grep -c PASS "$log") PASS, $(grep -c FAIL "$log") FAIL, $(grep -c ', equal)' "$log") byte counts equal to the model")
done
if [[ $(left) -gt 60 ]]; then
  timeout $(($(left) - 20)) "$BUILD/tests/ferry_gpu_tests" --gtest_filter='InternodeVirtual.*' >"$LOGS/internode-virtual.log" 2>&1
  SUMMARY+=("InternodeVirtual: exit $?, $(grep -c '^\[       OK' "$LOGS/internode-virtual.log") OK, $(grep -c '^\[  FAILED' "$LOGS/internode-virtual.log") FAILED lines")
fi
FERRY_NETWORK=gin timeout 60 "$BUILD/tests/ferry_gpu_tests" --gtest_filter='GinSetup.*' >"$LOGS/gin.log" 2>&1
SUMMARY+=("GinSetup with FERRY_NETWORK=gin: exit $?; $(grep -m1 -E 'GIN|gin' "$LOGS/gin.log" | cut -c1-200)")

for topology in $TOPOLOGIES; do
  echo "== $topology"
  grep -E "^(leg|dispatch|combine)|across nodes" "$LOGS/bench-$topology.log" 2>/dev/null | head -n 24
done
echo "== summary (emulated nodes on one host: not network figures)"
printf '%s\n' "${SUMMARY[@]}"
