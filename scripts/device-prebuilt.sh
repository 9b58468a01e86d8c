#!/usr/bin/env bash
# The GPU tests that need no communicator (virtual ranks on one GPU, emulated nodes), from a test binary built on
# this machine, so that a device call spends its time on the tests instead of on scripts/device-check.sh's build
# (about 300 s of a 600 s call). Two steps:
#
#   scripts/device-prebuilt.sh pack [BUILD]      here, after `ninja -C BUILD tests/ferry_gpu_tests` (a cuda build for
#                                                sm_90a): relinks the binary with the static CUDA runtime (the device's
#                                                libcudart may differ), strips it, and writes
#                                                build-pack/ferry_gpu_tests.xz (about 40 MB: name build-pack in the
#                                                device call's carry)
#   scripts/device-prebuilt.sh run [--tests FILTER] [--rows "WORDS"] [--budget S]
#                                                on the GPU machine: every test of the gtest FILTER (default: the
#                                                virtual-rank and emulated-node suites) in its own process, each
#                                                bounded by what is left of the budget (default 540 s); a table last,
#                                                every log in $OUT (else build-pack/logs)
#   --rows "WORDS"   FERRY_TEST_ROWS: only the rows of a table holding every word (tests/support/virtual_ranks.hpp)
#
# What this cannot run: tests that start a communicator (NormalMode.*, LowLatency.*, EpBufferCycles.*, ...). The
# binary was compiled against this machine's NCCL headers, and Ferry refuses a loaded libnccl of another version
# (cuda_communicator.cu: the device structs change inside a minor series); those need device-check.sh, which builds
# against the device's NCCL. The virtual-rank tests link libnccl but never create a communicator, so the device's
# libnccl.so.2 (any 2.28) serves them.
# Exit status: non-zero when a test failed or the binary could not be unpacked.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

PACK_DIR="build-pack"
PACK="$PACK_DIR/ferry_gpu_tests.xz"

pack() {
  local build="${1:-build}"
  [[ -x "$build/tests/ferry_gpu_tests" ]] || {
    echo "device-prebuilt: $build/tests/ferry_gpu_tests is not built (ninja -C $build tests/ferry_gpu_tests)" >&2
    return 2
  }
  local link
  link=$(cd "$build" && ninja -t commands tests/ferry_gpu_tests | tail -n 1)
  [[ "$link" == *" -o tests/ferry_gpu_tests "* ]] || {
    echo "device-prebuilt: the last build command of tests/ferry_gpu_tests is not its link:" >&2
    echo "$link" >&2
    return 2
  }
  # the shared CUDA runtime out (the static one, which the link line also names, stays), its rpath too
  link=$(sed -e 's# [^ ]*/libcudart\.so # #g' -e 's# -Wl,-rpath,[^ ]*##g' \
    -e "s# -o tests/ferry_gpu_tests # -o $PWD/$PACK_DIR/ferry_gpu_tests #" <<<"$link")
  [[ "$link" == *cudart_static* ]] || link="$link -lcudart_static -ldl -lrt"
  mkdir -p "$PACK_DIR"
  (cd "$build" && eval "$link") || return 2
  strip "$PACK_DIR/ferry_gpu_tests" || return 2
  if ldd "$PACK_DIR/ferry_gpu_tests" | grep -q libcudart; then
    echo "device-prebuilt: the binary still loads a shared libcudart" >&2
    return 2
  fi
  xz -T0 -6 -f "$PACK_DIR/ferry_gpu_tests" || return 2
  echo "device-prebuilt: $PACK ($(du -h "$PACK" | cut -f1)) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests || echo ' + uncommitted changes'); carry: [\"$PACK_DIR\"]"
}

run() {
  # the suites that start no communicator (test_comm, test_ll, test_normal_*, test_gin, test_trace,
  # test_buffer_cycles do)
  local filter='*VirtualRanks*:*Virtual.*:*AcrossNodes.*:QuantDevice.*:DeviceMemory.*'
  local budget=540
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --tests) filter="$2"; shift 2 ;;
      --rows) export FERRY_TEST_ROWS="$2"; shift 2 ;;
      --budget) budget="$2"; shift 2 ;;
      *) echo "device-prebuilt run: unknown argument '$1'; see --help" >&2; return 2 ;;
    esac
  done
  local logs="${OUT:-$PACK_DIR/logs}" bin=/tmp/ferry_gpu_tests start=$SECONDS
  mkdir -p "$logs"
  [[ -f "$PACK" ]] || { echo "device-prebuilt: no $PACK (pack it here, then carry $PACK_DIR)" >&2; return 2; }
  xz -dc "$PACK" >"$bin" && chmod +x "$bin" || return 2
  # the device's libnccl.so.2: the system's, else the one in torch's wheel
  local nccl
  nccl=$(ldconfig -p | awk '/libnccl\.so\.2 /{print $NF; exit}')
  [[ -z "$nccl" ]] && nccl=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(nvidia.nccl.__path__[0], "lib", "libnccl.so.2"))' 2>/dev/null)
  if [[ -n "$nccl" ]]; then
    LD_LIBRARY_PATH="$(dirname "$nccl")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    export LD_LIBRARY_PATH
  fi
  export FERRY_TEST_WORLD="${FERRY_TEST_WORLD:-1}"
  nvidia-smi -L 2>/dev/null || echo "device-prebuilt: no nvidia-smi here (the tests will skip)"
  echo "device-prebuilt: libnccl ${nccl:-not found}; tests \"$filter\"${FERRY_TEST_ROWS:+; rows \"$FERRY_TEST_ROWS\"}"
  local names
  mapfile -t names < <("$bin" --gtest_list_tests --gtest_filter="$filter" |
    awk '/^[^ ]/{suite=$1} /^  /{print suite $1}')
  local rc=0 table="" name status left limit out
  for name in "${names[@]}"; do
    left=$((budget - (SECONDS - start)))
    if [[ $left -lt 20 ]]; then table+=$(printf '%-64s %s' "$name" "not-run (budget)")$'\n'; continue; fi
    limit=$((left - 10))
    out="$logs/${name//[^A-Za-z0-9_.-]/_}.log"
    local t0=$SECONDS
    timeout "$limit" "$bin" --gtest_filter="$name" >"$out" 2>&1
    case $? in
      0) if grep -q '^\[  SKIPPED \]' "$out"; then status=skipped; else status=passed; fi ;;
      124) status="cut ($limit s)"; rc=1 ;;
      *) status=failed; rc=1; grep -E -A4 'Failure|what\(\)' "$out" | cut -c1-240 | head -n 12 ;;
    esac
    table+=$(printf '%-64s %-10s %4d s' "$name" "$status" $((SECONDS - t0)))$'\n'
  done
  echo "== device-prebuilt: $((SECONDS - start)) s"
  printf '%s' "$table"
  return $rc
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  run) shift; run "$@" ;;
  -h|--help|"") sed -n '2,23p' "$0"; [[ -n "${1:-}" ]] ;;
  *) echo "device-prebuilt: unknown command '$1'; see --help" >&2; exit 2 ;;
esac
