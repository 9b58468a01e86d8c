#!/usr/bin/env bash
# On the GPU machine, from the repo root, after a build (scripts/device-check.sh builds into build-device/): runs
# `ferry tune` for the shipped model shapes, bf16 and fp8 dispatch, normal and low-latency mode, merging every entry
# into the GPU's table under src/tuning/tables/, then `ferry tune --verify` on each entry, and copies the table to $OUT
# (when set) so it comes back from the device. A short summary is printed last.
#
# usage: scripts/device-tune.sh [--quick] [--no-verify] [--shapes deepseek,qwen3,gptoss]
#   --quick: fewer candidates, buckets and rounds (a smoke run; its rows are still measurements)
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

BUILD=build-device
LOGS="${OUT:-$BUILD/logs}"
QUICK=0 VERIFY=1 SHAPES="deepseek,qwen3,gptoss"
while [[ $# -gt 0 ]]; do
  case "$1" in
    --quick) QUICK=1; shift ;;
    --no-verify) VERIFY=0; shift ;;
    --shapes) SHAPES="$2"; shift 2 ;;
    -h|--help) sed -n '2,8p' "$0"; exit 0 ;;
    *) echo "device-tune: unknown argument '$1'; see --help" >&2; exit 2 ;;
  esac
done
mkdir -p "$LOGS"
[[ -x "$BUILD/ferry" ]] || { echo "device-tune: $BUILD/ferry is missing; run scripts/device-check.sh first"; exit 2; }

# model shapes: name hidden topk experts
declare -A SHAPE=([deepseek]="7168 8 256" [qwen3]="4096 8 128" [gptoss]="2880 4 128")
if [[ $QUICK -eq 1 ]]; then
  NORMAL_TOKENS="128,1024,4096" LL_TOKENS="128,512" BLOCKS="32,66,132" COMMON="--rounds 2 --warmup 2 --iters 5"
else
  NORMAL_TOKENS="128,256,512,1024,2048,4096" LL_TOKENS="1,128,256,512" BLOCKS="" COMMON="--rounds 3"
fi
START=$SECONDS
summary=()
IFS=',' read -r -a shape_list <<<"$SHAPES"
for name in "${shape_list[@]}"; do
  read -r hidden topk experts <<<"${SHAPE[$name]}"
  formats="bf16 fp8"
  [[ $name == gptoss ]] && formats="bf16 mxfp4"  # hidden 2880 is not a multiple of fp8's 128-element block
  for format in $formats; do
    for mode in normal ll; do
      tokens=$NORMAL_TOKENS
      [[ $mode == ll ]] && tokens=$LL_TOKENS
      args=(--hidden "$hidden" --topk "$topk" --experts "$experts" --dispatch "$format" --mode "$mode"
            --tokens "$tokens" $COMMON)
      [[ -n $BLOCKS ]] && args+=(--blocks "$BLOCKS")
      log="$LOGS/tune-$name-$format-$mode.log"
      echo "== [$((SECONDS - START)) s] tune $name $format $mode"
      timeout 300 "$BUILD/ferry" tune "${args[@]}" >"$log" 2>&1
      rc=$?
      grep -E "^  (dispatch|combine) +<=|FAIL|error" "$log" | head -n 12
      verdict="tuned"
      [[ $rc -ne 0 ]] && verdict="tune FAILED (exit $rc)"
      if [[ $VERIFY -eq 1 && $rc -eq 0 ]]; then
        timeout 300 "$BUILD/ferry" tune "${args[@]}" --verify >"$log.verify" 2>&1
        vrc=$?
        grep -E "verify " "$log.verify" | tail -n 12
        worst=$(grep -oE "[0-9.]+ x the best" "$log.verify" | sort -n | tail -n 1)
        verdict="$verdict; verify $([[ $vrc -eq 0 ]] && echo PASS || echo "FAIL (exit $vrc)") (worst row ${worst:-?})"
      fi
      summary+=("$(printf '%-9s %-5s %-7s %s' "$name" "$format" "$mode" "$verdict")")
    done
  done
done
[[ -n "${OUT:-}" ]] && cp src/tuning/tables/*.json "$OUT/" 2>/dev/null
echo
echo "================ device-tune summary ($((SECONDS - START)) s) ================"
printf '%s\n' "${summary[@]}"
