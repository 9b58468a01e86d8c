#!/usr/bin/env bash
# Binaries built on this machine for the GPU machine, so that a device call spends its time on the tests or the
# bench rounds instead of on a build (about 300 s of a 600 s call): the GPU tests (the virtual-rank and emulated-node
# suites; the others where the device has the NCCL below), and the ferry CLI of the sides of an A/B. Its commands:
#
#   scripts/device-prebuilt.sh pack [BUILD]      here, after `ninja -C BUILD tests/ferry_gpu_tests` (a cuda build for
#                                                sm_90a): relinks the binary with the static CUDA runtime (the device's
#                                                libcudart may differ), strips it, and writes
#                                                build-pack/ferry_gpu_tests.xz (about 40 MB: name build-pack in the
#                                                device call's carry)
#   scripts/device-prebuilt.sh run [--tests FILTER] [--rows "WORDS"] [--budget S] [--resume STATUS]
#                                                on the GPU machine: every test of the gtest FILTER (default: the
#                                                virtual-rank and emulated-node suites; '*': every test) in its own
#                                                process, each bounded by what is left of the budget (default 540 s)
#                                                and by 450 s, the fast-path walk last; a table and a count by
#                                                status last; prebuilt.status (name status) and the logs of failed
#                                                or cut tests in $OUT (else build-pack/logs), every log in
#                                                /tmp/ferry-prebuilt-logs
#   scripts/device-prebuilt.sh pack-example [BUILD]
#                                                here, after pack: examples/cpp built against `cmake --install` of
#                                                BUILD (tests/install/consume.sh; it runs on the cpu backend here),
#                                                as build-pack/moe_round_trip.xz (about 22 MB from a 90a-real build,
#                                                more from 90a); run runs it first, with --cuda, in a pass over every
#                                                test ('*') or when FILTER names Example
#   scripts/device-prebuilt.sh pack-cli NAME BUILD NOTE
#                                                here: BUILD's ferry CLI (a cuda build for sm_90a; -DFERRY_CUDA_ARCH=
#                                                90a-real -DFERRY_BUILD_TESTS=OFF halves it) as build-ab/NAME.xz, side
#                                                NAME of `scripts/device-ab.sh --prebuilt build-ab` (about 22 MB each:
#                                                two sides fit a device call's carry), NOTE in build-ab/NAME.txt
#                                                (FERRY_SIDES_DIR=DIR: DIR in place of build-ab, for side too, e.g. a
#                                                folder per experiment, so that its sides leave another's alone)
#   scripts/device-prebuilt.sh side NAME COMMIT  here: COMMIT's ferry CLI built from `git archive` (90a-real, no
#                                                tests) and packed as side NAME (pack-cli), kept in build-sides/ for
#                                                the next time it is asked for, e.g. the commits of a bisection
#   scripts/device-prebuilt.sh nccl-dir VERSION  on the GPU machine: the directory of a libnccl.so.2 of VERSION
#   --rows "WORDS"   FERRY_TEST_ROWS: only the rows of a table holding every word (tests/support/virtual_ranks.hpp)
#   --resume STATUS  an earlier call's prebuilt.status (copied into the checkout): its passed and skipped tests are
#                    not run again, so that a pass over every test spans calls; `cut` (stopped by the budget) is
#                    reported, not a failure
#
# The suites that start a communicator (NormalMode.*, LowLatency.*, EpBufferCycles.*, ...) need the device's
# libnccl.so.2 to be the NCCL whose headers the binary was compiled against (Ferry refuses another version:
# cuda_communicator.cu, the device structs change inside a minor series). pack records that version in
# build-pack/nccl-version; run looks for it in torch's wheel (where the device's own builds take their NCCL) and then
# the system's, and says which it found. Without a match they fail at their setup and the rest runs (the virtual-rank
# tests link libnccl but never create a communicator, so any 2.28 serves them); device-check.sh, which builds
# against the device's NCCL, runs them then.
# Exit status: non-zero when a test failed or the binary could not be unpacked.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

PACK_DIR="build-pack"
SIDES_DIR="${FERRY_SIDES_DIR:-build-ab}"
PACK="$PACK_DIR/ferry_gpu_tests.xz"
EXAMPLE_TEST="Example.InstalledPackageOnCuda"  # run's name for the packed example (pack-example)

# Relinks TARGET of BUILD (a path relative to it) into OUT with the static CUDA runtime (the device's libcudart may
# differ), strips it, compresses it to OUT.xz and writes the NCCL version of BUILD's headers to OUT_DIR/nccl-version.
relink_static() {
  local build="$1" target="$2" out="$3"
  [[ -x "$build/$target" ]] || {
    echo "device-prebuilt: $build/$target is not built (ninja -C $build $target)" >&2
    return 2
  }
  local link
  link=$(cd "$build" && ninja -t commands "$target" | tail -n 1)
  [[ "$link" == *" -o $target "* ]] || {
    echo "device-prebuilt: the last build command of $target is not its link:" >&2
    echo "$link" >&2
    return 2
  }
  # the shared CUDA runtime out (the static one, which the link line also names, stays), its rpath too
  # (a link without the static one, the installed example's, takes it from the shared one's folder)
  local cudart_dir
  cudart_dir=$(grep -o ' [^ ]*/libcudart\.so ' <<<"$link" | head -n 1 | xargs -r dirname)
  link=$(sed -e 's# [^ ]*/libcudart\.so # #g' -e 's# -Wl,-rpath,[^ ]*##g' -e "s# -o $target # -o $out #" <<<"$link")
  local static_cudart="-lcudart_static"
  [[ -n "$cudart_dir" && -f "$cudart_dir/libcudart_static.a" ]] && static_cudart="$cudart_dir/libcudart_static.a"
  # (ninja's link line ends in "&& :": the libraries go before it)
  [[ "$link" == *cudart_static* ]] || link="${link% && :} $static_cudart -ldl -lrt"
  mkdir -p "$(dirname "$out")"
  (cd "$build" && eval "$link") || return 2
  strip "$out" || return 2
  if ldd "$out" | grep -q libcudart; then
    echo "device-prebuilt: $out still loads a shared libcudart" >&2
    return 2
  fi
  xz -T0 -6 -f "$out" || return 2
  # the NCCL the binary was compiled against (a Ferry build's cache names its headers; the example's does not, and
  # takes the build's): the device side looks for a libnccl.so.2 of that version
  local nccl_h
  nccl_h="$(sed -n 's/^FERRY_NCCL_INCLUDE_DIR:PATH=//p' "$build/CMakeCache.txt")/nccl.h"
  [[ -f "$nccl_h" ]] && sed -n 's/^#define NCCL_VERSION_CODE \([0-9]*\).*/\1/p' "$nccl_h" >"$(dirname "$out")/nccl-version"
  return 0
}

pack() {
  local build="${1:-build}"
  relink_static "$build" tests/ferry_gpu_tests "$PWD/$PACK_DIR/ferry_gpu_tests" || return 2
  echo "device-prebuilt: $PACK ($(du -h "$PACK" | cut -f1)) from $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- src tests || echo ' + uncommitted changes'); carry: [\"$PACK_DIR\"]"
}

# examples/cpp built against `cmake --install` of BUILD (tests/install/consume.sh, which also runs it here on the
# cpu backend), packed for `run`, which runs it on the cuda backend: the installed package on the GPU without a build
# there. BUILD must use the NCCL headers of the build `pack` took (run loads one libnccl for both).
pack_example() {
  local build="${1:-build}"
  tests/install/consume.sh "$build" "$PWD" >"$PACK_DIR/example-here.log" 2>&1 || {
    echo "device-prebuilt: the installed-package example failed here (cpu backend): $PACK_DIR/example-here.log" >&2
    return 2
  }
  relink_static "$build/install-check/consumer" moe_round_trip "$PWD/$PACK_DIR/moe_round_trip" || return 2
  echo "device-prebuilt: $PACK_DIR/moe_round_trip.xz ($(du -h "$PACK_DIR/moe_round_trip.xz" | cut -f1)); run runs it" \
    "as $EXAMPLE_TEST (carry: [\"$PACK_DIR\"], $(du -sh "$PACK_DIR" | cut -f1) in all)"
}

# The ferry CLI of BUILD as side NAME of scripts/device-ab.sh --prebuilt: SIDES_DIR/NAME.xz, and SIDES_DIR/NAME.txt
# saying what it was built from (NOTE, e.g. the commit).
pack_cli() {
  local name="${1:-}" build="${2:-}" note="${3:-}"
  [[ "$name" =~ ^[a-z]$ && -n "$build" && -n "$note" ]] || {
    echo "device-prebuilt: pack-cli NAME BUILD NOTE: NAME one letter (a: the base), NOTE what BUILD was built from" >&2
    return 2
  }
  mkdir -p "$SIDES_DIR" && relink_static "$build" ferry "$(cd "$SIDES_DIR" && pwd)/$name" || return 2
  echo "$note" >"$SIDES_DIR/$name.txt"
  echo "device-prebuilt: $SIDES_DIR/$name.xz ($(du -h "$SIDES_DIR/$name.xz" | cut -f1)): $note; carry: [\"$SIDES_DIR\"]"
}

# Side NAME of the A/B is COMMIT's ferry CLI: built here from `git archive COMMIT` (sm_90a SASS only, no tests; a few
# minutes on two cores; relinked and packed as pack-cli does) into build-sides/COMMIT.xz unless that holds it already,
# then copied to SIDES_DIR/NAME.xz.
side() {
  local name="${1:-}" commit="${2:-}"
  [[ "$name" =~ ^[a-z]$ && -n "$commit" ]] || { echo "device-prebuilt: side NAME COMMIT (NAME one letter)" >&2; return 2; }
  local full
  full=$(git rev-parse --verify --quiet "$commit^{commit}") || { echo "device-prebuilt: no commit $commit" >&2; return 2; }
  local short=${full:0:7} note
  note="$short $(git log -1 --format=%s "$full" | cut -c1-100)"
  if [[ ! -f "build-sides/$short.xz" ]]; then
    local src="${TMPDIR:-/tmp}/ferry-side-$short"
    rm -rf "$src" && mkdir -p "$src" && git archive "$full" | tar -x -C "$src" || return 2
    cmake -S "$src" -B "$src/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DFERRY_CUDA_ARCH=90a-real \
      -DFERRY_BUILD_TESTS=OFF >"$src/configure.log" 2>&1 || { tail -n 5 "$src/configure.log" >&2; return 2; }
    cmake --build "$src/build" --target ferry_cli >"$src/build.log" 2>&1 || { tail -n 5 "$src/build.log" >&2; return 2; }
    relink_static "$src/build" ferry "$PWD/build-sides/$short" || return 2
    rm -rf "$src"
  fi
  mkdir -p "$SIDES_DIR" && cp "build-sides/$short.xz" "$SIDES_DIR/$name.xz" && cp build-sides/nccl-version "$SIDES_DIR/" &&
    echo "$note" >"$SIDES_DIR/$name.txt"
  echo "device-prebuilt: side ${name^^} = $note ($SIDES_DIR/$name.xz, $(du -h "$SIDES_DIR/$name.xz" | cut -f1));" \
    "$SIDES_DIR holds $(du -sh "$SIDES_DIR" | cut -f1) (carry: [\"$SIDES_DIR\"])"
}

# The directory of a libnccl.so.2 of NCCL version WANT on this machine (torch's wheel, where the device's own builds
# take their NCCL, before the system's), else of the first one found; what it found goes to stderr.
nccl_dir() {
  local want="${1:-}" nccl="" candidate version="" py
  local candidates=()
  for py in /opt/torch/.venv/bin/python3 python3; do
    candidate=$("$py" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) &&
      [[ -f "$candidate" ]] && candidates+=("$candidate")
  done
  candidate=$(ldconfig -p | awk '/libnccl\.so\.2 /{print $NF; exit}')
  [[ -n "$candidate" ]] && candidates+=("$candidate")
  for candidate in "${candidates[@]}"; do
    version=$(python3 -c 'import ctypes, sys; v = ctypes.c_int(); ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); print(v.value)' "$candidate" 2>/dev/null)
    echo "device-prebuilt: $candidate is NCCL ${version:-of unknown version}" >&2
    [[ -z "$nccl" ]] && nccl="$candidate"  # the first found, when none matches
    if [[ -n "$want" && "$version" == "$want" ]]; then nccl="$candidate"; break; fi
  done
  [[ -n "$want" && "$version" != "$want" ]] &&
    echo "device-prebuilt: no libnccl.so.2 here is NCCL $want, the binary's headers: a communicator will refuse it" >&2
  [[ -n "$nccl" ]] && dirname "$nccl"
}

run() {
  # the suites that start no communicator (test_comm, test_ll, test_normal_*, test_gin, test_trace,
  # test_buffer_cycles do)
  local filter='*VirtualRanks*:*Virtual.*:*AcrossNodes.*:QuantDevice.*:DeviceMemory.*'
  local budget=540 resume=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --tests) filter="$2"; shift 2 ;;
      --rows) export FERRY_TEST_ROWS="$2"; shift 2 ;;
      --budget) budget="$2"; shift 2 ;;
      --resume) resume="$2"; shift 2 ;;
      *) echo "device-prebuilt run: unknown argument '$1'; see --help" >&2; return 2 ;;
    esac
  done
  # every test's log in $work; $logs (a device call's $OUT, which brings back only a few files) gets the status file
  # and the logs of the tests that failed or were cut
  local logs="${OUT:-$PACK_DIR/logs}" work="${TMPDIR:-/tmp}/ferry-prebuilt-logs" bin=/tmp/ferry_gpu_tests start=$SECONDS
  mkdir -p "$logs" "$work"
  # the example alone needs no test binary: its pack and a test binary's do not fit one call's carry together
  local example_only=0
  [[ "$filter" == Example* && ! -f "$PACK" && -f "$PACK_DIR/moe_round_trip.xz" ]] && example_only=1
  if [[ $example_only == 0 ]]; then
    [[ -f "$PACK" ]] || { echo "device-prebuilt: no $PACK (pack it here, then carry $PACK_DIR)" >&2; return 2; }
    xz -dc "$PACK" >"$bin" && chmod +x "$bin" || return 2
  fi
  # the device's libnccl.so.2 of the version the binary was compiled against, if it has one: then the suites that
  # start a communicator run too
  local nccl
  nccl=$(nccl_dir "$(cat "$PACK_DIR/nccl-version" 2>/dev/null)")
  [[ -n "$nccl" ]] && export LD_LIBRARY_PATH="$nccl${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  export FERRY_TEST_WORLD="${FERRY_TEST_WORLD:-1}"
  nvidia-smi -L 2>/dev/null || echo "device-prebuilt: no nvidia-smi here (the tests will skip)"
  echo "device-prebuilt: libnccl ${nccl:-not found}; tests \"$filter\"${FERRY_TEST_ROWS:+; rows \"$FERRY_TEST_ROWS\"}"
  local names
  # the fast-path walk (minutes of virtual-rank cases) last, as device-check.sh runs it: a short budget leaves it out;
  # disabled tests (gtest runs none of them) not listed
  names=()
  [[ $example_only == 0 ]] && mapfile -t names < <("$bin" --gtest_list_tests --gtest_filter="$filter" |
    awk '/^[^ ]/{suite=$1} /^  /{print suite $1}' | grep -v -E '(^|\.)DISABLED_' |
    awk '/^FastPathVirtualRanks\./{last[++n]=$0; next} {print}
      END {for (i = 1; i <= n; ++i) print last[i]}')
  # the installed-package example (pack-example), first: in a pass over every test, or when the filter names it
  local example=/tmp/moe_round_trip
  if [[ -f "$PACK_DIR/moe_round_trip.xz" && ("$filter" == '*' || "$filter" == *Example*) ]]; then
    xz -dc "$PACK_DIR/moe_round_trip.xz" >"$example" && chmod +x "$example" && names=("$EXAMPLE_TEST" "${names[@]}")
  fi
  local rc=0 table="" name status left limit out earlier
  local -r test_bound=450  # a test's own bound, as device-check.sh gives it: a timeout under it is the budget's
  : >"$logs/prebuilt.status"
  for name in "${names[@]}"; do
    earlier=$([[ -n "$resume" ]] && awk -v n="$name" '$1 == n && ($2 == "passed" || $2 == "skipped") {print $2}' "$resume")
    if [[ -n "$earlier" ]]; then
      echo "$name $earlier" >>"$logs/prebuilt.status"
      table+=$(printf '%-64s %s' "$name" "$earlier (earlier call)")$'\n'
      continue
    fi
    left=$((budget - (SECONDS - start)))
    if [[ $left -lt 20 ]]; then
      echo "$name not-run" >>"$logs/prebuilt.status"
      table+=$(printf '%-64s %s' "$name" "not-run (budget)")$'\n'
      continue
    fi
    limit=$((left - 10 < test_bound ? left - 10 : test_bound))
    out="$work/${name//[^A-Za-z0-9_.-]/_}.log"
    local t0=$SECONDS
    if [[ "$name" == "$EXAMPLE_TEST" ]]; then
      timeout "$limit" "$example" --cuda >"$out" 2>&1
    else
      timeout "$limit" "$bin" --gtest_filter="$name" >"$out" 2>&1
    fi
    case $? in
      0) if grep -q '^\[  SKIPPED \]' "$out"; then status=skipped; else status=passed; fi ;;
      124) if [[ $limit -lt $test_bound ]]; then status="cut"; else status=failed; rc=1; fi ;;
      *) status=failed; rc=1; grep -E -A4 'Failure|what\(\)' "$out" | cut -c1-240 | head -n 12 ;;
    esac
    echo "$name $status" >>"$logs/prebuilt.status"
    [[ $status == failed || $status == cut ]] && cp "$out" "$logs/"
    table+=$(printf '%-64s %-10s %4d s' "$name" "$status" $((SECONDS - t0)))$'\n'
  done
  echo "== device-prebuilt: $((SECONDS - start)) s"
  printf '%s' "$table"
  echo "== device-prebuilt: $(awk '{n[$2]++} END {for (s in n) printf "%s %d  ", s, n[s]}' "$logs/prebuilt.status")(status: $logs/prebuilt.status)"
  return $rc
}

case "${1:-}" in
  pack) shift; pack "$@" ;;
  pack-example) shift; pack_example "$@" ;;
  pack-cli) shift; pack_cli "$@" ;;
  side) shift; side "$@" ;;
  nccl-dir) shift; nccl_dir "$@" ;;
  run) shift; run "$@" ;;
  -h|--help|"") awk 'NR == 1 {next} /^#/ {print; next} {exit}' "$0"; [[ -n "${1:-}" ]] ;;
  *) echo "device-prebuilt: unknown command '$1'; see --help" >&2; exit 2 ;;
esac
