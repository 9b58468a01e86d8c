#!/usr/bin/env bash
# Ferry on a GPU machine, for users and GPU CI runners: the build, the GPU tests one by one, the installed example,
# short `ferry bench` runs with every row checked, interleaved A/Bs of `ferry bench` between trees, commits or
# prebuilt CLIs, `ferry p2p`, the Python GPU tests, the emulated-node runs, the world-size run and `ferry tune`.
# Every command writes its logs, JSON results and a status file into OUT_DIR and prints a short table last.
#
# usage: scripts/gpu-check.sh COMMAND OUT_DIR [OPTIONS]        scripts/gpu-check.sh COMMAND --help
#
#   all OUT_DIR         the one command for a fresh GPU machine: build (Release, sm_90a), every GPU test, the
#                       installed example, a short `ferry bench --check`; the table last
#   build OUT_DIR       configure and build into --build DIR
#   test OUT_DIR        the GPU tests one by one (a status file; --resume continues an earlier run)
#   example OUT_DIR     examples/cpp built against `cmake --install` of the build, run on the cuda backend
#   bench OUT_DIR       short `ferry bench` runs, every row checked, with the NCCL baseline
#   ab OUT_DIR          an interleaved A/B of `ferry bench` between trees, commits or CLIs: medians and ratios
#   p2p OUT_DIR         `ferry p2p`, the transport's figures (one GPU: the emulated transport on virtual ranks)
#   python OUT_DIR      the Python module, its GPU tests, the examples and the per-call overhead
#   internode OUT_DIR   the inter-node paths on emulated nodes of a 2-GPU machine (not network figures)
#   scale OUT_DIR       the expert-parallel run at this machine's world: all-to-all ceiling, bench, NCCL baseline
#   tune OUT_DIR        `ferry tune` for the model shapes, then `--verify`; the table copied to OUT_DIR
#   pack PACK_DIR       (a build machine) binaries built here, relinked to run on a GPU machine without a build
#   run-packed OUT_DIR  (the GPU machine) the packed GPU tests and example: --pack PACK_DIR
#   report OUT_DIR      print the table of an earlier run again
#
# Options every command takes:
#   --build DIR         the build folder (default: $FERRY_BUILD_DIR, else build-gpu)
#   --arch ARCH         CUDA architecture, CMake syntax (default: $FERRY_CUDA_ARCH, else 90a)
#   --python PY         the interpreter: CMake's NCCL lookup (the torch wheel's NCCL) and the Python steps (default:
#                       $PYTHON, else $VIRTUAL_ENV's, else the first python3 on PATH that imports torch, else python3)
#   --nccl-root DIR     NCCL prefix with include/ and lib/ (default: $FERRY_NCCL_ROOT, else CMake's lookup)
#   --jobs N            build jobs (default: the cores)
#   --budget SECONDS    no new test, round or step is started past this many seconds (default: no limit)
#   --dry-run           print what would run; run nothing
#
# Everything this starts runs with NVLink multicast off (NCCL_NVLS_ENABLE=0, NVSHMEM_DISABLE_NVLS=1,
# TORCH_SYMM_MEM_DISABLE_MULTICAST=1; DESIGN "Safety": multicast can take a host's GPUs out of service).
# Exit status: 0 when every step passed, 1 when one failed, 2 for bad usage.

# shellcheck disable=SC2054  # commas inside array elements are the lists of ferry's options
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

ROOT=$PWD

# ---------------------------------------------------------------------------------------------------------------------
# Help

usage() { awk 'NR == 1 {next} /^#/ {sub(/^# ?/, ""); print; next} {exit}' "$0"; }

help_all() {
  cat <<'EOF'
usage: scripts/gpu-check.sh all OUT_DIR [OPTIONS]
Builds (Release, --arch, default 90a), runs the installed example, a short `ferry bench --check` (normal mode with
wire formats at 128 / 4096 tokens, normal against low-latency at 1 / 128, with the NCCL baseline) and every GPU test
one by one (last, so that a --budget that runs out leaves out tests, which `test --resume` runs later), then prints
the table. One command on a fresh GPU machine checks everything.
  --tests FILTER      only these GPU tests (a gtest filter, e.g. 'NormalMode.*:LowLatency.*')
  --resume FILE       an earlier run's OUT_DIR/tests/status: its passed and skipped tests are not run again
  --no-example        skip the installed example
  --no-bench          skip the bench runs
  --p2p               also `ferry p2p` (see `p2p --help`)
  --python            also the Python steps (see `python --help`)
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_build() {
  cat <<'EOF'
usage: scripts/gpu-check.sh build OUT_DIR [OPTIONS]
Configures (Release, CUDA architecture --arch, NCCL from --nccl-root or CMake's lookup through --python) and builds
into --build DIR, keeping going past a failed target. Logs: OUT_DIR/build/configure.log, build.log.
  --target T          build only this target (repeatable; default: everything)
  --with-python       also the Python module (FERRY_BUILD_PYTHON=ON, against --python)
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_test() {
  cat <<'EOF'
usage: scripts/gpu-check.sh test OUT_DIR [OPTIONS]
Runs the GPU tests one by one, each in its own process with its own time limit, the fast-path walk last. Writes
OUT_DIR/tests/status (one line per test: name, passed | failed | skipped | cut | not-run | disabled, seconds) and a
log per test. `cut` and `not-run` are tests the --budget stopped or left out; `--resume` runs them later.
  --bin FILE          the ferry_gpu_tests binary, or a packed one (FILE.xz, from `pack`; its NCCL is looked up by the
                      version beside it) (default: --build DIR/tests/ferry_gpu_tests)
  --tests FILTER      a gtest filter (default: every test)
  --rows WORDS        FERRY_TEST_ROWS: only the table rows that hold every word
  --world N           FERRY_TEST_WORLD, the EP tests' ranks (default: the GPUs, at most 8)
  --resume FILE       an earlier run's status file: its passed and skipped tests count and are not run again
  --test-timeout S    a test's own time limit (default 600)
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_example() {
  cat <<'EOF'
usage: scripts/gpu-check.sh example OUT_DIR [OPTIONS]
Installs the build into a scratch prefix, builds examples/cpp against it with find_package(Ferry)
(tests/install/consume.sh) and runs it on the cuda backend: one process, then one per GPU through `ferry launch`
when the machine has two or more.
  --bin FILE          a packed example (moe_round_trip.xz from `pack --example`) instead of building one
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_bench() {
  cat <<'EOF'
usage: scripts/gpu-check.sh bench OUT_DIR [OPTIONS]
Short `ferry bench` runs in graph mode, every row checked against the reference, with the NCCL baseline:
  formats   --tokens 128,4096 --dispatch bf16,fp8,mxfp4,bf16 --combine bf16,bf16,bf16,fp8
  modes     --mode both --tokens 1,128 (normal against low-latency at decode sizes)
  backward  --backward --layout expert --tokens 128,4096 (the training passes; not with --quick)
JSON and logs in OUT_DIR/bench/. Exit 1 when a run failed or a row's check failed.
  --ferry PATH        the CLI (default: --build DIR/ferry)
  --iters N           timed iterations per leg (default 10)
  --quick             the first two runs only
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_ab() {
  cat <<'EOF'
usage: scripts/gpu-check.sh ab OUT_DIR --base SPEC [OPTIONS]
An A/B of `ferry bench` between sides: the same workloads, seeds and flags on every side, every row checked, rounds
interleaved so that a drift of the machine falls on every side (each round starts one side later: A B, B A, ...;
A B C, B C A, ...). The table gives each leg's median over the rounds of each side, each side / A, and each side's
range over the rounds (the noise). JSON and logs in OUT_DIR/ab/; the table in OUT_DIR/ab/table.txt.
A side is a SPEC:
  a commit (needs git; built from `git archive`), a source tree, a source tarball (.tar, .tar.gz, .tgz), a ferry
  CLI, a packed CLI (.xz, from `pack --cli` or `pack --commit`), or @NAME (side NAME's CLI), each optionally
  followed by ,VAR=VALUE,... (the side runs with that environment, e.g. @b,FERRY_NORMAL_LANDING=off).
  Source sides are built (Release, --arch, the CLI only) in parallel and kept in --build DIR/ab-sides for the next
  run; `.` (this tree) is built in --build DIR.
  --base SPEC         side A, the base every other side is divided by
  --side NAME=SPEC    another side (NAME one lower-case letter; repeatable); B defaults to `.`, this tree
  --rounds N          rounds (default 3)
  --iters N           timed iterations per leg and run (default 30)
  --seed S            the input seed of every run (default 7)
  --runs ARGS         a workload, `ferry bench ARGS`, in place of the defaults (repeatable)
  --also ARGS         one more workload besides the defaults (repeatable)
  --flags ARGS        the flags every run gets (default "--graph --check")
  --quick             normal mode at 128 tokens and low-latency at 1 / 128, bf16 only
  --run-timeout S     a run's own time limit (default 600)
  --kernel-time       also the kernels' own time (ncu, every kernel of --kernel-runs, two rounds)
  --kernel-runs ARGS  --kernel-time's workload (repeatable; default: low-latency at 1 token, bf16 and fp8)
  --kernel-stalls     with --kernel-time, also why warps waited (ncu's warp-state counters)
  --source-counters "KERNEL|ARGS"   ncu's per-instruction counters of KERNEL over `ferry bench ARGS`, every side,
                      compared by tools/dev/ncu-source-diff.py (repeatable)
  --host-time         also python/bench_overhead.py at 1 token with each source side's Python module (both modes)
  --host-only         with --host-time: no `ferry bench` rounds
Default workloads (hidden 7168, topk 8, 256 experts, random routing): normal mode at 1, 128 and 4096 tokens and
low-latency mode at 1, 128 and 512 tokens, each with --dispatch bf16,fp8 --combine bf16,fp8.
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_p2p() {
  cat <<'EOF'
usage: scripts/gpu-check.sh p2p OUT_DIR [OPTIONS]
`ferry p2p` with its default sizes and CTA sweep (push, pull, copy engine, flag latency). On one GPU, which has no
NVLink pair: the emulated transport's protocol on two virtual ranks, labelled so (neither NVLink nor network).
  --ferry PATH        the CLI (default: --build DIR/ferry)
  --args ARGS         `ferry p2p ARGS` in place of the defaults
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_python() {
  cat <<'EOF'
usage: scripts/gpu-check.sh python OUT_DIR [OPTIONS]
The Python side on GPUs, with --python's interpreter (torch with CUDA): the module (the ferry_python target of
--build DIR, or --pip), the import, ferry.init at world 2 with and without torch imported first (2 GPUs; a native
crash prints its frames through tools/dev/native-backtrace.c), pytest python/tests (the GPU torch tests must run on
2 GPUs), examples/moe_layer.py (torchrun, 2 GPUs), examples/train_moe.py on one GPU (twice in-process: the loss
curves must be equal), and the per-call host overhead (python/bench_overhead.py,
python/bench_deep_ep_overhead.py at 1 and 128 tokens: figures, not checks). Logs in OUT_DIR/python/.
  --pip               install with pip into OUT_DIR/python/site (no build isolation, no dependencies) instead
  --pytest ARGS       pytest's arguments (default: python/tests)
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_internode() {
  cat <<'EOF'
usage: scripts/gpu-check.sh internode OUT_DIR [OPTIONS]
The inter-node paths on a machine of 2 GPUs (or more: the first 2), as emulated nodes over NVLink (docs/internode.md):
  1. `ferry bench --topology 2x1` against `--topology 1x2`, graph mode, every row checked: normal mode
     (hierarchical) at 128 / 4096 tokens, low-latency at 1 / 128 / 512 on both routes; bf16 and fp8; random and
     grouped routing; each leg's network bytes beside `ferry model`'s count. FERRY_EMULATED_DELAY_NS=0: the times
     are the protocol over the emulated transport, never network figures;
  2. the emulated network's default delays, --mode both at 2 / 128 tokens (correctness, not figures);
  3. the library's refusal of a quantized low-latency combine across nodes past its hidden limit;
  4. GIN forced (FERRY_NETWORK=gin): the GinSetup test and a 2x1 bench (what GIN setup says here);
  5. the virtual-rank inter-node tests, one GPU each, side by side.
Logs and JSON in OUT_DIR/internode/. FERRY_TIMEOUT_S defaults to 20 here.
  --no-build          use the CLI and the tests of --build DIR as they are
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_scale() {
  cat <<'EOF'
usage: scripts/gpu-check.sh scale OUT_DIR [OPTIONS]
The expert-parallel run at this machine's world (one rank per GPU): the all-to-all ceiling (`ferry p2p --directions
alltoall`), then `ferry bench` in graph mode, normal mode at 128 / 512 / 4096 tokens and low-latency at 1 / 128 /
512, dispatch and combine in bf16 and fp8, random and grouped routing, every row checked, with the NCCL baseline;
the table and the EP8 goals last. JSON and logs in OUT_DIR/scale/.
  --ferry PATH        the CLI (default: --build DIR/ferry; built when missing)
  --quick             4096 / 128 tokens only, 10 iterations
  --iters N           timed iterations per leg (default 20)
  --tune              also `tune --shapes deepseek` for this world
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_tune() {
  cat <<'EOF'
usage: scripts/gpu-check.sh tune OUT_DIR [OPTIONS]
`ferry tune` for the model shapes (deepseek: hidden 7168, topk 8, 256 experts; qwen3: 4096, 8, 128; gptoss: 2880,
4, 128), bf16 and a quantized dispatch (fp8; mxfp4 for gptoss), normal and low-latency mode, each merged into the
GPU's table under src/tuning/tables/, then `ferry tune --verify` of each entry. The tables are copied to
OUT_DIR/tune/. Logs there.
  --ferry PATH        the CLI (default: --build DIR/ferry)
  --shapes LIST       comma-separated, of deepseek, qwen3, gptoss (default: all three)
  --quick             fewer candidates, buckets and rounds (a smoke run; its rows are still measurements)
  --no-verify         skip `--verify`
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_pack() {
  cat <<'EOF'
usage: scripts/gpu-check.sh pack PACK_DIR [OPTIONS]
On a build machine (no GPU needed): binaries of a cuda build relinked with the static CUDA runtime (the GPU
machine's libcudart may differ), stripped and compressed into PACK_DIR, so that a GPU machine runs them without a
build. PACK_DIR/nccl-version records the NCCL of the build's headers: the GPU side loads a libnccl.so.2 of that
version when it has one (the suites that start a communicator refuse another version).
  --tests             tests/ferry_gpu_tests of --build DIR -> ferry_gpu_tests.xz (`run-packed`, `test --bin`)
  --example           examples/cpp against `cmake --install` of --build DIR -> moe_round_trip.xz
  --cli               --build DIR's ferry -> ferry.xz (an `ab` side)
  --commit REV        REV's ferry CLI, built from `git archive` (--arch, no tests) -> ferry-SHORT.xz (an `ab` side;
                      kept in --build DIR/ab-sides for the next time)
With none of them: --tests and --cli. Tip: -DFERRY_CUDA_ARCH=90a-real -DFERRY_BUILD_TESTS=OFF halves a CLI's build.
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_run_packed() {
  cat <<'EOF'
usage: scripts/gpu-check.sh run-packed OUT_DIR --pack PACK_DIR [OPTIONS]
On the GPU machine: the packed example (if PACK_DIR has one) and then the packed GPU tests, as `example --bin` and
`test --bin` run them; every `test` option applies (--tests, --rows, --world, --resume, --test-timeout).
  and the options every command takes (scripts/gpu-check.sh --help)
EOF
}

help_report() {
  cat <<'EOF'
usage: scripts/gpu-check.sh report OUT_DIR
Prints the table of an earlier run from what it left in OUT_DIR: the steps' status, the GPU tests' counts, the bench
records, the A/B table, and the figures of p2p, scale, internode and python.
EOF
}

# ---------------------------------------------------------------------------------------------------------------------
# Options and helpers shared by the commands

BUILD="${FERRY_BUILD_DIR:-build-gpu}"
ARCH="${FERRY_CUDA_ARCH:-90a}"
PY="${PYTHON:-}"
NCCL_ROOT="${FERRY_NCCL_ROOT:-}"
JOBS=$(nproc 2>/dev/null || echo 4)
BUDGET=0  # seconds; 0: no limit
DRY=0
OUT=""
CMD=""
START=$SECONDS
ARGS=()  # the command's own options, left after the common ones

fail_usage() {
  echo "gpu-check${CMD:+ $CMD}: $*" >&2
  exit 2
}

# Splits "$@" into the common options (set above) and the command's (ARGS).
parse_common() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --build) optval "$@"; BUILD="$2"; shift 2 ;;
      --arch) optval "$@"; ARCH="$2"; shift 2 ;;
      --python) optval "$@"; PY="$2"; shift 2 ;;
      --nccl-root) optval "$@"; NCCL_ROOT="$2"; shift 2 ;;
      --jobs) optval "$@"; JOBS="$2"; shift 2 ;;
      --budget) optval "$@"; BUDGET="$2"; shift 2 ;;
      --dry-run) DRY=1; shift ;;
      *) ARGS+=("$1"); shift ;;
    esac
  done
  [[ "$JOBS" =~ ^[1-9][0-9]*$ ]] || fail_usage "--jobs=$JOBS must be a positive number"
  [[ "$BUDGET" =~ ^[0-9]+$ ]] || fail_usage "--budget=$BUDGET must be seconds (0: no limit)"
}

# An option's value: a usage error naming the option when it has none (optval "$@"), or when it is not a number
# (optnum "$@"). Called in the shell that parses, never in a command substitution (whose exit would not stop it).
optval() { [[ $# -ge 2 && -n "$2" ]] || fail_usage "$1 needs a value"; }
optnum() { [[ "${2:-}" =~ ^[0-9]+$ ]] || fail_usage "$1 needs a number (got '${2:-}')"; }

# The interpreter: --python, $PYTHON, $VIRTUAL_ENV's, the first python3 on PATH that imports torch, else python3.
find_python() {
  [[ -n "$PY" ]] && return
  if [[ -n "${VIRTUAL_ENV:-}" && -x "$VIRTUAL_ENV/bin/python" ]]; then
    PY="$VIRTUAL_ENV/bin/python"
    return
  fi
  local candidate
  while read -r candidate; do
    if "$candidate" -c 'import torch' >/dev/null 2>&1; then
      PY="$candidate"
      return
    fi
  done < <(type -a -p python3 python 2>/dev/null | awk '!seen[$0]++')
  PY=python3
}

gpu_count() {
  if [[ $DRY -eq 1 ]] || ! command -v nvidia-smi >/dev/null 2>&1; then
    echo "${GPUCHECK_GPUS:-0}"
    return
  fi
  nvidia-smi -L 2>/dev/null | grep -c '^GPU'
}

elapsed() { echo $((SECONDS - START)); }
stamp() { echo "== [$(elapsed) s] $*"; }

# Seconds of the budget left (a large number without a budget).
left() {
  if [[ $BUDGET -eq 0 ]]; then echo 999999; else echo $((BUDGET - (SECONDS - START))); fi
}

# CAP, or what the budget leaves after KEEP seconds, whichever is smaller (at least 1).
bounded() {
  local cap=$1 keep=${2:-0} l
  l=$(($(left) - keep))
  ((l < cap)) && cap=$l
  ((cap < 1)) && cap=1
  echo "$cap"
}

# The status file: one line per step, `STEP<TAB>RESULT<TAB>SECONDS<TAB>DETAIL`, RESULT one of ok, FAILED, skipped.
STEP_START=$SECONDS
begin_step() {
  STEP_START=$SECONDS
  stamp "$*"
}
record() {
  local step=$1 result=$2
  shift 2
  printf '%s\t%s\t%d\t%s\n' "$step" "$result" $((SECONDS - STEP_START)) "$*" >>"$OUT/status"
  [[ $result == FAILED ]] && FAILURES=$((FAILURES + 1))
  return 0
}
FAILURES=0

# The words of a command as a shell reads them back (quoted only where needed).
shell_words() {
  local word out=()
  for word in "$@"; do
    if [[ "$word" =~ ^[A-Za-z0-9_./,:=+@%^-]+$ ]]; then out+=("$word"); else out+=("$(printf '%q' "$word")"); fi
  done
  echo "${out[*]}"
}

# run_logged LOG LIMIT COMMAND...: runs COMMAND with stdout and stderr in LOG (the command line first), bounded by
# LIMIT seconds (0: no bound); returns its exit status (124: the limit stopped it). --dry-run prints it instead.
run_logged() {
  local log=$1 limit=$2
  shift 2
  if [[ $DRY -eq 1 ]]; then
    echo "[dry-run] $(shell_words "$@") > $log"
    return 0
  fi
  mkdir -p "$(dirname "$log")"
  printf '$ %s\n' "$(shell_words "$@")" >"$log"
  if [[ $limit -gt 0 ]]; then
    timeout -k 10 "$limit" "$@" >>"$log" 2>&1
  else
    "$@" >>"$log" 2>&1
  fi
}

# The last lines of a log, indented.
show_tail() {
  [[ $DRY -eq 1 || ! -f "$1" ]] && return
  tail -n "${2:-15}" "$1" | sed 's/^/    /'
}

# Unpacks FILE.xz into DIR/NAME (executable) and prints the path.
unpack_xz() {
  local packed=$1 dest=$2
  mkdir -p "$(dirname "$dest")"
  xz -dc "$packed" >"$dest" && chmod +x "$dest" && echo "$dest"
}

# The folder of a libnccl.so.2 of NCCL version WANT (a code, e.g. 22809) on this machine: --nccl-root's, the torch
# wheel's (--python), then the system's; the first found when none matches. What it found goes to stderr.
nccl_lib_dir() {
  local want=${1:-} found="" version candidate
  local candidates=()
  [[ -n "$NCCL_ROOT" ]] && for candidate in "$NCCL_ROOT"/lib/libnccl.so.2 "$NCCL_ROOT"/lib64/libnccl.so.2; do
    [[ -f "$candidate" ]] && candidates+=("$candidate")
  done
  find_python
  candidate=$("$PY" -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null) &&
    [[ -f "$candidate" ]] && candidates+=("$candidate")
  candidate=$(ldconfig -p 2>/dev/null | awk '/libnccl\.so\.2 /{print $NF; exit}')
  [[ -n "$candidate" ]] && candidates+=("$candidate")
  for candidate in "${candidates[@]}"; do
    version=$(python3 -c 'import ctypes, sys; v = ctypes.c_int(); ctypes.CDLL(sys.argv[1]).ncclGetVersion(ctypes.byref(v)); print(v.value)' "$candidate" 2>/dev/null)
    echo "gpu-check: $candidate is NCCL ${version:-of unknown version}" >&2
    [[ -z "$found" ]] && found="$candidate"
    if [[ -n "$want" && "$version" == "$want" ]]; then
      found="$candidate"
      want=""
      break
    fi
  done
  [[ -n "$want" ]] && echo "gpu-check: no libnccl.so.2 here is NCCL $want (the binary's headers): its communicators will refuse another" >&2
  [[ -n "$found" ]] && dirname "$found"
}

# Puts the libnccl of a packed binary's version (PACK_DIR/nccl-version) first on the library path.
use_packed_nccl() {
  local pack_dir=$1 dir
  [[ $DRY -eq 1 ]] && return
  dir=$(nccl_lib_dir "$(cat "$pack_dir/nccl-version" 2>/dev/null)")
  [[ -n "$dir" ]] && export LD_LIBRARY_PATH="$dir${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
}

# Where a command writes: OUT_DIR, made absolute (the steps change directory).
set_out() {
  [[ -n "${1:-}" && "$1" != -* ]] || fail_usage "give an output folder: scripts/gpu-check.sh $CMD OUT_DIR (see --help)"
  mkdir -p "$1" || fail_usage "cannot create $1"
  OUT=$(cd "$1" && pwd)
}

machine_line() {
  local gpus
  gpus=$(gpu_count)
  echo "gpu-check $CMD: $gpus GPU(s)$([[ $gpus -gt 0 ]] && nvidia-smi -L 2>/dev/null | head -n 1 | sed 's/^GPU 0: / (/; s/ (UUID.*//; s/$/)/'), build $BUILD, arch $ARCH, output $OUT$([[ $BUDGET -gt 0 ]] && echo ", budget $BUDGET s")"
  echo "gpu-check $CMD: NCCL_NVLS_ENABLE=$NCCL_NVLS_ENABLE NVSHMEM_DISABLE_NVLS=$NVSHMEM_DISABLE_NVLS TORCH_SYMM_MEM_DISABLE_MULTICAST=$TORCH_SYMM_MEM_DISABLE_MULTICAST"
}

# ---------------------------------------------------------------------------------------------------------------------
# build

# configure_tree SOURCE BUILD LOG_DIR [CMAKE ARGS...]: Release, --arch, the NCCL lookup through --python.
configure_tree() {
  local source=$1 build=$2 logs=$3
  shift 3
  find_python
  local generator=()
  command -v ninja >/dev/null 2>&1 && generator=(-G Ninja)
  local args=(-S "$source" -B "$build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release "-DFERRY_CUDA_ARCH=$ARCH")
  command -v "$PY" >/dev/null 2>&1 && args+=("-DPython3_EXECUTABLE=$(command -v "$PY")")
  [[ -n "$NCCL_ROOT" ]] && args+=("-DFERRY_NCCL_ROOT=$NCCL_ROOT")
  run_logged "$logs/configure.log" 0 cmake "${args[@]}" "$@"
}

# build_targets BUILD LOG [TARGETS...]: keeps going past a failed target (the others still build).
build_targets() {
  local build=$1 log=$2
  shift 2
  local targets=()
  [[ $# -gt 0 ]] && targets=(--target "$@")
  local keep_going=(-- -k 0)
  [[ -f "$build/build.ninja" || $DRY -eq 1 ]] || keep_going=(-- -k)
  run_logged "$log" 0 cmake --build "$build" -j "$JOBS" "${targets[@]}" "${keep_going[@]}"
}

step_build() {  # [--target T ...] [--with-python]
  local targets=() extra=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --target) optval "$@"; targets+=("$2"); shift 2 ;;
      --with-python) find_python; extra+=(-DFERRY_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$(command -v "$PY" || echo "$PY")"); shift ;;
      *) fail_usage "unknown option '$1' (see build --help)" ;;
    esac
  done
  begin_step "configure + build into $BUILD (arch $ARCH${targets[*]:+; ${targets[*]}})"
  # a build for another architecture than the GPU's does not run on it (sm_90a code runs on compute capability 9.0)
  local capability
  capability=$([[ $DRY -eq 0 ]] && nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d ' .')
  if [[ -n "$capability" && "$ARCH" != *"$capability"* ]]; then
    echo "    note: the GPU is sm_$capability and the build is for $ARCH; give --arch ${capability}a (or $capability) if its kernels do not load"
  fi
  if ! configure_tree . "$BUILD" "$OUT/build" "${extra[@]}"; then
    show_tail "$OUT/build/configure.log" 30
    record build FAILED "configure failed, see build/configure.log"
    return 1
  fi
  [[ $DRY -eq 0 ]] && grep -h "Ferry: cuda backend" "$OUT/build/configure.log" | sed 's/^-- /    /'
  if ! build_targets "$BUILD" "$OUT/build/build.log" "${targets[@]}"; then
    grep -E "FAILED|error" "$OUT/build/build.log" | head -n 20 | sed 's/^/    /'
    record build FAILED "some targets failed (the others were built), see build/build.log"
    return 1
  fi
  local backend=""
  [[ $DRY -eq 0 ]] && backend=$(grep -ho "cuda backend [A-Z]*" "$OUT/build/configure.log" | head -n 1)
  record build ok "$BUILD, arch $ARCH${backend:+, $backend}"
}

# ---------------------------------------------------------------------------------------------------------------------
# test

TEST_BIN="" TEST_FILTER="*" TEST_ROWS="" TEST_WORLD="" TEST_RESUME="" TEST_TIMEOUT=600
parse_test_options() {
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --bin) optval "$@"; TEST_BIN="$2"; shift 2 ;;
      --tests) optval "$@"; TEST_FILTER="$2"; shift 2 ;;
      --rows) optval "$@"; TEST_ROWS="$2"; shift 2 ;;
      --world) optnum "$@"; TEST_WORLD=$2; shift 2 ;;
      --resume) optval "$@"; TEST_RESUME="$2"; shift 2 ;;
      --test-timeout) optnum "$@"; TEST_TIMEOUT=$2; shift 2 ;;
      *) fail_usage "unknown option '$1' (see test --help)" ;;
    esac
  done
  [[ -z "$TEST_RESUME" || -f "$TEST_RESUME" ]] || fail_usage "--resume $TEST_RESUME: no such file (an earlier OUT_DIR/tests/status)"
  TEST_RESUME=${TEST_RESUME:+$(cd "$(dirname "$TEST_RESUME")" && pwd)/$(basename "$TEST_RESUME")}
  return 0
}

# The tests of the binary under the filter, one per line, the fast-path walk (minutes of virtual-rank cases) last so
# that a short budget leaves it out rather than the correctness tests; disabled tests as "NAME disabled".
list_tests() {
  "$1" --gtest_list_tests --gtest_filter="$TEST_FILTER" |
    awk '/^[^ ]/ {suite = $1} /^  / {print suite $1}' |
    awk '/(^|\.)DISABLED_/ {print $0 " disabled"; next} /^FastPathVirtualRanks\./ {last[++n] = $0; next} {print}
         END {for (i = 1; i <= n; ++i) print last[i]}'
}

step_test() {
  local bin=$TEST_BIN
  [[ -z "$bin" ]] && bin="$BUILD/tests/ferry_gpu_tests"
  begin_step "GPU tests one by one (${bin}; filter '$TEST_FILTER')"
  local dir="$OUT/tests"
  mkdir -p "$dir/logs"
  if [[ "$bin" == *.xz ]]; then
    [[ $DRY -eq 1 ]] || bin=$(unpack_xz "$bin" "$dir/bin/ferry_gpu_tests") ||
      { record tests FAILED "cannot unpack $TEST_BIN"; return 1; }
    use_packed_nccl "$(dirname "$TEST_BIN")"
  fi
  if [[ $DRY -eq 0 && ! -x "$bin" ]]; then
    record tests FAILED "no test binary $bin (build it: scripts/gpu-check.sh build OUT_DIR)"
    return 1
  fi
  local gpus
  gpus=$(gpu_count)
  # the EP tests at the machine's world unless told otherwise (their own default, 2 ranks, skips on one GPU)
  if [[ -n "$TEST_WORLD" ]]; then
    export FERRY_TEST_WORLD=$TEST_WORLD
  elif [[ -z "${FERRY_TEST_WORLD:-}" && $gpus -ge 1 ]]; then
    export FERRY_TEST_WORLD=$((gpus < 8 ? gpus : 8))
  fi
  [[ -n "$TEST_ROWS" ]] && export FERRY_TEST_ROWS="$TEST_ROWS"
  echo "    $gpus GPU(s); EP tests at world ${FERRY_TEST_WORLD:-2} (FERRY_TEST_WORLD)${TEST_ROWS:+; rows '$TEST_ROWS'}"
  if [[ $DRY -eq 1 ]]; then
    echo "[dry-run] each test of $bin --gtest_list_tests --gtest_filter='$TEST_FILTER' alone: $bin --gtest_filter=NAME > $dir/logs/NAME.log"
    record tests ok "dry run"
    return 0
  fi
  local status="$dir/status"
  : >"$status"
  local entry name earlier limit log rc state t0 failed=0
  while read -r entry; do
    name=${entry%% *}
    if [[ "$entry" == *" disabled" ]]; then
      printf '%s\tdisabled\t0\n' "$name" >>"$status"
      continue
    fi
    earlier=""
    [[ -n "$TEST_RESUME" ]] &&
      earlier=$(awk -F'\t' -v n="$name" '$1 == n && ($2 == "passed" || $2 == "skipped") {print $2}' "$TEST_RESUME")
    if [[ -n "$earlier" ]]; then
      printf '%s\t%s\t0\tearlier run\n' "$name" "$earlier" >>"$status"
      printf '    %-64s %s\n' "$name" "$earlier (earlier run)"
      continue
    fi
    if [[ $(left) -lt 30 ]]; then
      printf '%s\tnot-run\t0\n' "$name" >>"$status"
      continue
    fi
    limit=$(bounded "$TEST_TIMEOUT" 10)
    log="$dir/logs/${name//[^A-Za-z0-9_.-]/_}.log"
    t0=$SECONDS
    run_logged "$log" "$limit" "$bin" --gtest_filter="$name" </dev/null
    rc=$?
    if [[ $rc -eq 0 ]]; then
      if grep -q '^\[  SKIPPED \]' "$log"; then state=skipped; else state=passed; fi
    elif [[ $rc -eq 124 && $limit -lt $TEST_TIMEOUT ]]; then
      state="cut"  # stopped by the budget, not by its own limit
    else
      state=failed
      failed=$((failed + 1))
      grep -E -A4 'Failure|what\(\)' "$log" | cut -c1-240 | head -n 8 | sed 's/^/      /'
    fi
    printf '%s\t%s\t%d\n' "$name" "$state" $((SECONDS - t0)) >>"$status"
    printf '    %-64s %-8s %4d s\n' "$name" "$state" $((SECONDS - t0))
  done < <(list_tests "$bin")
  local summary
  summary=$(awk -F'\t' '{n[$2]++} END {printf "%d passed, %d failed, %d skipped, %d left out by the budget, %d disabled", n["passed"], n["failed"], n["skipped"], n["cut"] + n["not-run"], n["disabled"]}' "$status")
  if [[ $failed -gt 0 ]]; then record tests FAILED "$summary"; return 1; fi
  if [[ ! -s "$status" ]]; then record tests FAILED "no test matched '$TEST_FILTER'"; return 1; fi
  record tests ok "$summary"
}

# ---------------------------------------------------------------------------------------------------------------------
# example

EXAMPLE_BIN=""
step_example() {
  begin_step "examples/cpp against the installed package, cuda backend"
  local dir="$OUT/example" bin rc gpus
  mkdir -p "$dir"
  gpus=$(gpu_count)
  if [[ -n "$EXAMPLE_BIN" ]]; then
    bin="$dir/moe_round_trip"
    [[ $DRY -eq 1 ]] || unpack_xz "$EXAMPLE_BIN" "$bin" >/dev/null || { record example FAILED "cannot unpack $EXAMPLE_BIN"; return 1; }
    use_packed_nccl "$(dirname "$EXAMPLE_BIN")"
    run_logged "$dir/example.log" "$(bounded 300)" "$bin" --cuda
    rc=$?
  else
    bin="$BUILD/install-check/consumer/moe_round_trip"
    run_logged "$dir/example.log" "$(bounded 600)" tests/install/consume.sh "$BUILD" "$ROOT" --cuda
    rc=$?
  fi
  # one process per GPU through `ferry launch` (every rank on the cuda backend)
  if [[ $rc -eq 0 && $gpus -ge 2 && -x "$BUILD/ferry" ]]; then
    run_logged "$dir/example-launch.log" "$(bounded 300)" "$BUILD/ferry" launch --nproc "$gpus" --timeout 120 "$bin" --cuda
    rc=$?
  fi
  show_tail "$dir/example.log" 4
  if [[ $rc -ne 0 ]]; then record example FAILED "exit $rc, see example/"; return 1; fi
  record example ok "$([[ $gpus -ge 2 ]] && echo "1 process, then $gpus through ferry launch" || echo "1 process")"
}

# ---------------------------------------------------------------------------------------------------------------------
# bench

# bench_run NAME LIMIT FERRY ARGS...: one `ferry bench` run with its JSON and log in DIR; returns its exit status.
bench_run() {
  local dir=$1 name=$2 limit=$3 ferry=$4
  shift 4
  run_logged "$dir/$name.log" "$limit" "$ferry" bench "$@" --json "$dir/$name.json"
}

step_bench() {  # [--ferry PATH] [--iters N] [--quick]
  local ferry="$BUILD/ferry" iters=10 quick=0
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --ferry) optval "$@"; ferry="$2"; shift 2 ;;
      --iters) optnum "$@"; iters=$2; shift 2 ;;
      --quick) quick=1; shift ;;
      *) fail_usage "unknown option '$1' (see bench --help)" ;;
    esac
  done
  begin_step "ferry bench, every row checked"
  local dir="$OUT/bench" rc=0 failed=()
  mkdir -p "$dir"
  if [[ $DRY -eq 0 && ! -x "$ferry" ]]; then
    record bench FAILED "no CLI $ferry (build it first)"
    return 1
  fi
  local common=(--graph --check --iters "$iters")
  bench_run "$dir" formats "$(bounded 900)" "$ferry" --tokens 128,4096 --baseline nccl "${common[@]}" \
    --dispatch bf16,fp8,mxfp4,bf16 --combine bf16,bf16,bf16,fp8 || failed+=("formats (exit $?)")
  # low-latency mode beside normal mode at decode sizes (its goals: docs/perf.md)
  bench_run "$dir" modes "$(bounded 600)" "$ferry" --mode both --tokens 1,128 --baseline nccl "${common[@]}" ||
    failed+=("modes (exit $?)")
  # the training passes beside the forward legs of the same bytes (docs/training.md)
  if [[ $quick -eq 0 ]]; then
    bench_run "$dir" backward "$(bounded 600)" "$ferry" --backward --layout expert --tokens 128,4096 --check \
      --iters "$iters" || failed+=("backward (exit $?)")
  fi
  if [[ ${#failed[@]} -gt 0 ]]; then
    record bench FAILED "${failed[*]}; exit 3 is a row's check, see bench/*.log"
    return 1
  fi
  record bench ok "every row checked"
}

# ---------------------------------------------------------------------------------------------------------------------
# p2p

step_p2p() {  # [--ferry PATH] [--args ARGS]
  local ferry="$BUILD/ferry" p2p_args=""
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --ferry) optval "$@"; ferry="$2"; shift 2 ;;
      --args) optval "$@"; p2p_args="$2"; shift 2 ;;
      *) fail_usage "unknown option '$1' (see p2p --help)" ;;
    esac
  done
  begin_step "ferry p2p"
  local dir="$OUT/p2p" gpus
  mkdir -p "$dir"
  gpus=$(gpu_count)
  # one GPU has no NVLink pair: the emulated transport's protocol on two virtual ranks instead, labelled so
  if [[ $gpus -lt 2 && -z "$p2p_args" ]]; then
    p2p_args="--transport emulated --one-gpu --sizes 4KiB,1MiB,16MiB --ctas 8,32,132 --iters 10"
    echo "    $gpus GPU: ferry p2p $p2p_args (emulated figures: neither NVLink nor network)"
  fi
  # shellcheck disable=SC2086  # ARGS is a list of arguments
  run_logged "$dir/p2p.log" "$(bounded 900)" "$ferry" p2p --json "$dir/p2p.json" $p2p_args
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    show_tail "$dir/p2p.log" 10
    record p2p FAILED "exit $rc, see p2p/p2p.log"
    return 1
  fi
  record p2p ok "$([[ $gpus -lt 2 && -z "${p2p_args##*--one-gpu*}" ]] && echo "emulated, 1 GPU" || echo "$gpus GPUs")"
}

# ---------------------------------------------------------------------------------------------------------------------
# ab

declare -A SIDE_SPEC SIDE_ENV SIDE_CLI SIDE_NOTE SIDE_BUILD SIDE_SOURCE
SIDES=()

# add_side NAME SPEC[,VAR=VALUE...]
add_side() {
  local name=$1 value=$2
  [[ "$name" =~ ^[a-z]$ ]] || fail_usage "a side's name is one lower-case letter (got '$name')"
  [[ -n "${SIDE_SPEC[$name]+x}" ]] && fail_usage "side $name is given twice"
  local spec=${value%%,*} env=""
  [[ "$value" == *,* ]] && env=${value#*,}
  [[ -n "$spec" ]] || fail_usage "side $name has no SPEC"
  local assignment
  for assignment in ${env//,/ }; do
    [[ "$assignment" =~ ^[A-Za-z_][A-Za-z0-9_]*=[^[:space:]]*$ ]] || fail_usage "side $name: '$assignment' is not VAR=VALUE"
  done
  SIDE_SPEC[$name]=$spec
  SIDE_ENV[$name]=${env//,/ }
  SIDES+=("$name")
}

# The cache of built sides: commits and tarballs, each extracted and built once.
sides_cache() { echo "$BUILD/ab-sides"; }

# Sets SIDE_SOURCE / SIDE_BUILD (a tree to build) or SIDE_CLI (a CLI as is) of side NAME, and its note.
resolve_side() {
  local name=$1 spec=${SIDE_SPEC[$1]} key
  if [[ "$spec" == @* ]]; then
    SIDE_NOTE[$name]="side ${spec#@}'s CLI"
  elif [[ "$spec" == . ]]; then
    SIDE_SOURCE[$name]=$ROOT
    SIDE_BUILD[$name]=$BUILD
    SIDE_NOTE[$name]="this tree ($(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src tools bench 2>/dev/null || echo ' + changes'))"
  elif [[ -d "$spec" && -f "$spec/CMakeLists.txt" ]]; then
    SIDE_SOURCE[$name]=$(cd "$spec" && pwd)
    key=$(echo "${SIDE_SOURCE[$name]}" | sha256sum | cut -c1-12)
    SIDE_BUILD[$name]="$(sides_cache)/tree-$key"
    SIDE_NOTE[$name]="the tree ${SIDE_SOURCE[$name]}"
  elif [[ -f "$spec" && "$spec" =~ \.(tar|tar\.gz|tgz)$ ]]; then
    key=$(sha256sum "$spec" | cut -c1-12)
    SIDE_SOURCE[$name]="$(sides_cache)/tar-$key/src"
    SIDE_BUILD[$name]="$(sides_cache)/tar-$key/build"
    SIDE_NOTE[$name]="the tarball $spec"
    if [[ $DRY -eq 0 && ! -f "${SIDE_SOURCE[$name]}/CMakeLists.txt" ]]; then
      mkdir -p "${SIDE_SOURCE[$name]}" && tar -xf "$spec" -C "${SIDE_SOURCE[$name]}" ||
        fail_usage "side $name: cannot unpack $spec"
    fi
  elif [[ -f "$spec" && "$spec" == *.xz ]]; then
    SIDE_CLI[$name]="$OUT/ab/sides/$name/ferry"
    SIDE_NOTE[$name]="$(cat "${spec%.xz}.txt" 2>/dev/null || echo "the packed CLI $spec")"
    if [[ $DRY -eq 0 ]]; then
      unpack_xz "$spec" "${SIDE_CLI[$name]}" >/dev/null || fail_usage "side $name: cannot unpack $spec"
      use_packed_nccl "$(dirname "$spec")"
    fi
  elif [[ -f "$spec" && -x "$spec" ]]; then
    SIDE_CLI[$name]=$(cd "$(dirname "$spec")" && pwd)/$(basename "$spec")
    SIDE_NOTE[$name]="the CLI $spec"
  elif key=$(git rev-parse --verify --quiet "$spec^{commit}" 2>/dev/null); then
    SIDE_SOURCE[$name]="$(sides_cache)/${key:0:12}/src"
    SIDE_BUILD[$name]="$(sides_cache)/${key:0:12}/build"
    SIDE_NOTE[$name]="${key:0:7} $(git log -1 --format=%s "$key" | cut -c1-80)"
    if [[ $DRY -eq 0 && ! -f "${SIDE_SOURCE[$name]}/CMakeLists.txt" ]]; then
      mkdir -p "${SIDE_SOURCE[$name]}" && git archive "$key" | tar -x -C "${SIDE_SOURCE[$name]}" ||
        fail_usage "side $name: cannot archive $spec"
    fi
  else
    fail_usage "side $name: '$spec' is not a commit, a source tree, a tarball, a CLI or a packed CLI"
  fi
  [[ -n "${SIDE_BUILD[$name]:-}" ]] && SIDE_CLI[$name]="${SIDE_BUILD[$name]}/ferry"
  return 0
}

# Builds the source sides' CLIs (and, for --host-time, their Python modules) side by side, the cores shared.
build_sides() {
  local host_time=$1 name sources=() targets=(ferry_cli) extra=()
  for name in "${SIDES[@]}"; do [[ -n "${SIDE_SOURCE[$name]:-}" ]] && sources+=("$name"); done
  [[ ${#sources[@]} -eq 0 ]] && return 0
  if [[ $host_time -eq 1 ]]; then
    find_python
    targets+=(ferry_python)
    extra=(-DFERRY_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$(command -v "$PY" || echo "$PY")")
  fi
  begin_step "build ${#sources[@]} side(s): ${sources[*]}"
  local jobs=$((JOBS / ${#sources[@]}))
  ((jobs < 1)) && jobs=1
  local pids=() rc=0
  for name in "${sources[@]}"; do
    local tests=()
    [[ "${SIDE_BUILD[$name]}" != "$BUILD" ]] && tests=(-DFERRY_BUILD_TESTS=OFF)  # a side needs only its CLI
    (
      mkdir -p "$OUT/ab/logs/build-$name"
      configure_tree "${SIDE_SOURCE[$name]}" "${SIDE_BUILD[$name]}" "$OUT/ab/logs/build-$name" "${tests[@]}" "${extra[@]}" &&
        JOBS=$jobs build_targets "${SIDE_BUILD[$name]}" "$OUT/ab/logs/build-$name/build.log" "${targets[@]}"
    ) &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid" || rc=1; done
  for name in "${sources[@]}"; do
    if [[ $DRY -eq 0 && ! -x "${SIDE_CLI[$name]}" ]]; then
      grep -hE "FAILED|error" "$OUT/ab/logs/build-$name"/*.log | head -n 10 | sed 's/^/    /'
      record ab-build FAILED "side $name did not build, see ab/logs/build-$name/"
      return 1
    fi
  done
  record ab-build ok "${sources[*]}$([[ $rc -ne 0 ]] && echo ' (some other targets failed)')"
}

# A side's CLI with its environment: a wrapper script when the side sets variables.
side_command() {
  local name=$1 cli
  if [[ "${SIDE_SPEC[$name]}" == @* ]]; then cli=${SIDE_CLI[${SIDE_SPEC[$name]#@}]}; else cli=${SIDE_CLI[$name]}; fi
  if [[ -z "${SIDE_ENV[$name]}" ]]; then
    echo "$cli"
    return
  fi
  local wrapper="$OUT/ab/sides/$name/ferry-env"
  mkdir -p "$(dirname "$wrapper")"
  printf '#!/bin/sh\nexec env %s %q "$@"\n' "${SIDE_ENV[$name]}" "$cli" >"$wrapper"
  chmod +x "$wrapper"
  echo "$wrapper"
}

# The sides in round ROUND's order: each round starts one side later (A B C, B C A, C A B, ...), so that no side
# always runs first, after the idle machine.
sides_of_round() {
  local n=${#SIDES[@]} k
  for ((k = 0; k < n; ++k)); do echo "${SIDES[$((($1 - 1 + k) % n))]}"; done
}

ncu_path() { command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu /usr/local/cuda/bin/ncu 2>/dev/null | head -n 1; }

step_ab() {
  local rounds=3 iters=30 seed=7 quick=0 flags="--graph --check" run_timeout=600
  local kernel_time=0 kernel_stalls=0 host_time=0 host_only=0 base=""
  local runs=() also=() kernel_runs=() source_counters=() others=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --base) optval "$@"; base="$2"; shift 2 ;;
      --side) [[ "${2:-}" == *=* ]] || fail_usage "--side needs NAME=SPEC (got '${2:-}')"; others+=("$2"); shift 2 ;;
      --rounds) optnum "$@"; rounds=$2; shift 2 ;;
      --iters) optnum "$@"; iters=$2; shift 2 ;;
      --seed) optnum "$@"; seed=$2; shift 2 ;;
      --runs) optval "$@"; runs+=("$2"); shift 2 ;;
      --also) optval "$@"; also+=("$2"); shift 2 ;;
      --flags) [[ $# -ge 2 ]] || fail_usage "--flags needs arguments"; flags="$2"; shift 2 ;;
      --quick) quick=1; shift ;;
      --run-timeout) optnum "$@"; run_timeout=$2; shift 2 ;;
      --kernel-time) kernel_time=1; shift ;;
      --kernel-runs) optval "$@"; kernel_time=1; kernel_runs+=("$2"); shift 2 ;;
      --kernel-stalls) kernel_time=1; kernel_stalls=1; shift ;;
      --source-counters) [[ "${2:-}" == *"|"* ]] || fail_usage "--source-counters needs \"KERNEL|ARGS\""
        source_counters+=("$2"); shift 2 ;;
      --host-time) host_time=1; shift ;;
      --host-only) host_only=1; shift ;;
      *) fail_usage "unknown option '$1' (see ab --help)" ;;
    esac
  done
  [[ -n "$base" ]] || fail_usage "give side A: --base SPEC (see ab --help)"
  [[ $host_only -eq 1 && $host_time -eq 0 ]] && fail_usage "--host-only needs --host-time"
  [[ $rounds -ge 1 && $iters -ge 1 ]] || fail_usage "--rounds and --iters must be at least 1"
  add_side a "$base"
  local side
  for side in "${others[@]}"; do add_side "${side%%=*}" "${side#*=}"; done
  [[ -n "${SIDE_SPEC[b]+x}" ]] || add_side b .
  # the sides in name order: a first (the base), then b, c, ...
  mapfile -t SIDES < <(printf '%s\n' "${SIDES[@]}" | sort)
  for side in "${SIDES[@]}"; do
    if [[ "${SIDE_SPEC[$side]}" == @* ]]; then
      local other=${SIDE_SPEC[$side]#@}
      [[ -n "${SIDE_SPEC[$other]+x}" && "${SIDE_SPEC[$other]}" != @* ]] ||
        fail_usage "side $side: @$other is not a side with a CLI of its own"
    fi
    resolve_side "$side"
  done
  if [[ $host_time -eq 1 ]]; then
    for side in "${SIDES[@]}"; do
      [[ -n "${SIDE_BUILD[$side]:-}" ]] || fail_usage "--host-time builds each side's Python module: side $side is no source"
    done
  fi
  local dir="$OUT/ab"
  mkdir -p "$dir/runs" "$dir/logs"
  : >"$dir/sides.tsv"
  for side in "${SIDES[@]}"; do
    printf '%s\t%s\t%s\n' "$side" "${SIDE_NOTE[$side]}" "${SIDE_ENV[$side]}" >>"$dir/sides.tsv"
    echo "    side ${side^^}: ${SIDE_NOTE[$side]}${SIDE_ENV[$side]:+, with ${SIDE_ENV[$side]}}"
  done
  build_sides "$host_time" || return 1
  declare -A cli_of
  for side in "${SIDES[@]}"; do cli_of[$side]=$(side_command "$side"); done

  if [[ $quick -eq 1 ]]; then
    RUNS=("--mode normal --tokens 128 --dispatch bf16 --combine bf16" "--mode ll --tokens 1,128 --dispatch bf16 --combine bf16")
  else
    RUNS=("--mode normal --tokens 1,128,4096 --dispatch bf16,fp8 --combine bf16,fp8"
          "--mode ll --tokens 1,128,512 --dispatch bf16,fp8 --combine bf16,fp8")
  fi
  [[ ${#runs[@]} -gt 0 ]] && RUNS=("${runs[@]}")
  RUNS+=("${also[@]}")
  printf '%s\n' "${RUNS[@]}" >"$dir/runs.txt"
  echo "$flags --iters $iters --seed $seed" >"$dir/flags.txt"

  # the rounds: a round that the last one's duration says would not fit in the budget is not started
  begin_step "ab: ${#SIDES[@]} sides x ${#RUNS[@]} workloads x $rounds rounds"
  local round round_s=0 rounds_run=0 i t0 failed=()
  [[ $host_only -eq 1 ]] && rounds=0
  for ((round = 1; round <= rounds; ++round)); do
    if [[ $(left) -lt $((round_s + 15)) ]]; then
      echo "    round $round and later not run: $(left) s of the budget left, a round took $round_s s"
      break
    fi
    t0=$SECONDS
    for side in $(sides_of_round "$round"); do
      for i in "${!RUNS[@]}"; do
        # shellcheck disable=SC2086  # a workload and the flags are lists of arguments
        run_logged "$dir/runs/$side-$round-$i.log" "$(bounded "$run_timeout")" "${cli_of[$side]}" bench ${RUNS[$i]} \
          $flags --iters "$iters" --seed "$seed" --json "$dir/runs/$side-$round-$i.json" ||
          failed+=("$side round $round workload $i (exit $?)")
      done
    done
    round_s=$((SECONDS - t0))
    rounds_run=$round
    stamp "round $round done ($round_s s)"
  done
  echo "$rounds_run" >"$dir/rounds"
  if [[ $host_only -eq 0 ]]; then
    if [[ ${#failed[@]} -gt 0 ]]; then
      record ab FAILED "${failed[*]}; see ab/runs/"
    else
      record ab ok "$rounds_run rounds of ${#SIDES[@]} sides (${SIDES[*]})"
    fi
  fi
  [[ ${#source_counters[@]} -gt 0 ]] && ab_source_counters "$seed" "${source_counters[@]}"
  [[ $kernel_time -eq 1 ]] && ab_kernel_time "$seed" "$kernel_stalls" "${kernel_runs[@]}"
  [[ $host_time -eq 1 ]] && ab_host_time "$rounds"
  [[ ${#failed[@]} -eq 0 ]]
}

# --source-counters: ncu's per-instruction counters (SourceCounters) of a kernel over 20 launches, every side; the
# exports compared with side A's by tools/dev/ncu-source-diff.py (its summary lines printed).
ab_source_counters() {
  local seed=$1
  shift
  local dir="$OUT/ab/source-counters" ncu i side kernel args
  begin_step "ab: source counters"
  ncu=$(ncu_path)
  [[ -n "$ncu" || $DRY -eq 1 ]] || { record ab-source-counters FAILED "needs ncu, which this machine lacks"; return 1; }
  mkdir -p "$dir"
  i=0
  for entry in "$@"; do
    kernel=${entry%%|*}
    args=${entry#*|}
    for side in "${SIDES[@]}"; do
      [[ $(left) -lt 60 ]] && { echo "    source counters of $kernel ($side) and later not run (budget)"; break 2; }
      # shellcheck disable=SC2086
      run_logged "$dir/sc-$i-$side.log" "$(bounded 300)" "$ncu" --clock-control none --cache-control none -k "$kernel" \
        --launch-skip 5 -c 20 --section SourceCounters -o "$dir/sc-$i-$side" -f "$(side_command "$side")" bench $args \
        --iters 25 --warmup 2 --seed "$seed"
      run_logged "$dir/sc-$i-$side.export.log" 0 sh -c '"$1" -i "$2.ncu-rep" --page source --csv --print-source sass >"$2.csv"' \
        sh "$ncu" "$dir/sc-$i-$side"
    done
    echo "    source counters $i: $kernel, ferry bench $args"
    for side in "${SIDES[@]:1}"; do
      [[ ${#SIDES[@]} -gt 2 ]] && echo "    A against ${side^^} (as B):"
      [[ $DRY -eq 1 ]] || python3 tools/dev/ncu-source-diff.py "$dir/sc-$i-a.csv" "$dir/sc-$i-$side.csv" --top 8 2>&1 |
        grep -E '^  [AB]: |ncu-source-diff' | sed 's/^/    /'
    done
    i=$((i + 1))
  done
  record ab-source-counters ok "exports in ab/source-counters/"
}

# --kernel-time: ncu on every kernel of each workload, every side, two rounds (interleaved as the bench rounds); per
# kernel the median over a run's launches of its duration, warp instructions, grid and registers per thread, then
# the median of the runs (the report prints them).
ab_kernel_time() {
  local seed=$1 stalls=$2
  shift 2
  local workloads=("$@") dir="$OUT/ab/kernel-time" ncu round side w
  [[ ${#workloads[@]} -eq 0 ]] && workloads=("--mode ll --tokens 1 --dispatch bf16 --combine bf16"
    "--mode ll --tokens 1 --dispatch fp8 --combine fp8")
  begin_step "ab: kernel time (ncu)"
  ncu=$(ncu_path)
  [[ -n "$ncu" || $DRY -eq 1 ]] || { record ab-kernel-time FAILED "needs ncu, which this machine lacks"; return 1; }
  mkdir -p "$dir"
  printf '%s\n' "${workloads[@]}" >"$dir/workloads.txt"
  local metrics=gpu__time_duration.sum,sm__inst_executed.sum,launch__grid_size,launch__registers_per_thread
  [[ $stalls -eq 1 ]] && metrics+=',regex:smsp__average_warps_issue_stalled_.*_per_issue_active\.ratio'
  for round in 1 2; do
    for side in $(sides_of_round "$round"); do
      for w in "${!workloads[@]}"; do
        [[ $(left) -lt 40 ]] && { echo "    kernel time round $round ($side) and later not run (budget)"; break 3; }
        # shellcheck disable=SC2086
        run_logged "$dir/ncu-$side-$w-$round.csv" "$(bounded 300)" "$ncu" --clock-control none --cache-control none \
          -c 60 --csv --metrics "$metrics" "$(side_command "$side")" bench ${workloads[$w]} --iters 10 --seed "$seed"
      done
    done
  done
  record ab-kernel-time ok "ncu exports in ab/kernel-time/"
}

# --host-time: python/bench_overhead.py at 1 token (world 1, lazy calls) with each side's Python module, the sides
# interleaved, in normal and in low-latency mode: the host time of a dispatch + combine pair from Python and from C++
# (the same script on every side: only the library differs).
ab_host_time() {
  local rounds=$1 dir="$OUT/ab/host-time" round mode side log
  begin_step "ab: host time (python/bench_overhead.py)"
  find_python
  mkdir -p "$dir"
  for ((round = 1; round <= rounds; ++round)); do
    [[ $(left) -lt 150 ]] && { echo "    host time round $round and later not run (budget)"; break; }
    for mode in normal ll; do
      for side in $(sides_of_round "$round"); do
        log="$dir/host-$mode-$side-$round.log"
        run_logged "$log" "$(bounded 300)" env PYTHONPATH="${SIDE_BUILD[$side]}/python" "$PY" -m torch.distributed.run \
          --nproc-per-node 1 python/bench_overhead.py --mode "$mode" --tokens 1 --iters 50 --repeats 21
        [[ $DRY -eq 1 ]] || echo "    host time $mode ${side^^} round $round: $(grep -h 'from Python' "$log" | head -n 1)"
      done
    done
  done
  record ab-host-time ok "logs in ab/host-time/"
}

# ---------------------------------------------------------------------------------------------------------------------
# python

free_port() { "$PY" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])"; }

# python_step NAME LOG LIMIT COMMAND...: one step of the Python checks, recorded as python-NAME.
python_step() {
  local name=$1 log=$2 limit=$3
  shift 3
  run_logged "$log" "$limit" "$@"
  local rc=$?
  if [[ $rc -ne 0 ]]; then
    show_tail "$log" 25
    record "python-$name" FAILED "exit $rc$([[ $rc -eq 124 ]] && echo ', timed out'), see python/$(basename "$log")"
    return 1
  fi
  record "python-$name" ok "$(basename "$log")"
}

step_python() {  # [--pip] [--pytest ARGS]
  local pip=0 pytest_args="python/tests"
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --pip) pip=1; shift ;;
      --pytest) optval "$@"; pytest_args="$2"; shift 2 ;;
      *) fail_usage "unknown option '$1' (see python --help)" ;;
    esac
  done
  find_python
  local dir="$OUT/python" gpus
  mkdir -p "$dir"
  gpus=$(gpu_count)
  # 1. the module: the build's ferry_python target (reusing the build), or pip into a folder of its own
  begin_step "python: the module ($PY)"
  if [[ $pip -eq 1 ]]; then
    local nccl_define=()
    [[ -n "$NCCL_ROOT" ]] && nccl_define=(-C "cmake.define.FERRY_NCCL_ROOT=$NCCL_ROOT")
    python_step install "$dir/install.log" "$(bounded 1800)" env CMAKE_BUILD_PARALLEL_LEVEL="$JOBS" "$PY" -m pip install \
      --no-build-isolation --no-deps --disable-pip-version-check --target "$dir/site" . \
      -C cmake.define.FERRY_ENABLE_CUDA=ON -C "cmake.define.FERRY_CUDA_ARCH=$ARCH" "${nccl_define[@]}" || return 1
    export PYTHONPATH="$dir/site${PYTHONPATH:+:$PYTHONPATH}"
  else
    configure_tree . "$BUILD" "$dir" -DFERRY_BUILD_PYTHON=ON "-DPython_EXECUTABLE=$(command -v "$PY" || echo "$PY")" &&
      build_targets "$BUILD" "$dir/build.log" ferry_python
    local rc=$?
    if [[ $rc -ne 0 ]]; then
      show_tail "$dir/build.log" 20
      record python-module FAILED "see python/configure.log, python/build.log"
      return 1
    fi
    record python-module ok "$BUILD/python"
    export PYTHONPATH="$BUILD/python${PYTHONPATH:+:$PYTHONPATH}"
  fi
  begin_step "python: import"
  python_step import "$dir/import.log" 120 sh -c 'cd /tmp && "$1" -c "import ferry; print(\"ferry\", ferry.__version__, \"from\", ferry.__file__, \"| cuda backend:\", ferry.cuda_backend_compiled, \"| GPUs:\", ferry.cuda_device_count()); assert ferry.cuda_backend_compiled, \"the module has no cuda backend\""' sh "$PY" || return 1
  [[ $DRY -eq 1 ]] || sed -n '2p' "$dir/import.log" | sed 's/^/    /'

  # 2. ferry.init at world 2 without and with `import torch` first (a crash there once came from the module exporting
  #    the libstdc++ it links statically; docs/design-notes.md): Python's fault handler, and native frames through
  #    tools/dev/native-backtrace.c when a compiler is here
  if [[ $gpus -ge 2 ]]; then
    begin_step "python: ferry.init probe (world 2, with and without torch)"
    cat >"$dir/probe.py" <<'PYEOF'
import sys
if "torch" in sys.argv[1:]:
    import torch  # noqa: F401
import ferry
comm = ferry.init(backend="cuda")
comm.barrier()
print(f"probe rank {comm.rank}: init + barrier ok ({'with' if 'torch' in sys.argv[1:] else 'without'} torch)", flush=True)
PYEOF
    local preload="" variant
    if [[ $DRY -eq 0 ]] && cc -shared -fPIC -O1 -o "$dir/libnative-backtrace.so" tools/dev/native-backtrace.c -ldl 2>"$dir/preload.log"; then
      preload="$dir/libnative-backtrace.so"
    fi
    for variant in plain torch; do
      python_step "probe-$variant" "$dir/probe-$variant.log" 120 env PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 \
        LD_PRELOAD="$preload" "$PY" -m ferry.launch --nproc 2 "$dir/probe.py" "$variant"
      [[ $DRY -eq 1 ]] || grep -m 20 "native-backtrace\]" "$dir/probe-$variant.log" | sed 's/^/    /'
    done
  fi

  # 3. the Python tests; on 2 GPUs the GPU torch tests must run, not skip
  begin_step "python: pytest $pytest_args"
  # shellcheck disable=SC2086
  python_step pytest "$dir/pytest.log" "$(bounded 1800)" "$PY" -m pytest $pytest_args -q -rs --durations=8 \
    -p no:cacheprovider
  if [[ $DRY -eq 0 ]]; then
    grep -E "passed|failed" "$dir/pytest.log" | tail -n 1 | sed 's/^/    /'
    local gpu_skipped
    gpu_skipped=$(grep -c "^SKIPPED.*test_gpu_torch" "$dir/pytest.log")
    if [[ $gpus -ge 2 && $gpu_skipped -ne 0 ]]; then
      record python-gpu-tests FAILED "$gpu_skipped GPU torch tests skipped on $gpus GPUs (they must run here)"
    fi
  fi

  # 4. the examples: the MoE layer on 2 GPUs against the dense reference; training on one GPU, twice in-process
  if [[ $gpus -ge 2 ]]; then
    begin_step "python: examples/moe_layer.py (torchrun, 2 GPUs)"
    python_step moe-layer "$dir/moe_layer.log" "$(bounded 300)" "$PY" -m torch.distributed.run --nproc-per-node 2 \
      --master-port "$(free_port)" examples/moe_layer.py
    [[ $DRY -eq 1 ]] || grep -E "^rank [0-9]+/" "$dir/moe_layer.log" | sed 's/^/    /'
  fi
  begin_step "python: examples/train_moe.py (one GPU, twice: equal loss curves)"
  python_step train-moe "$dir/train_moe.log" "$(bounded 600)" "$PY" -m torch.distributed.run --nproc-per-node 1 \
    --master-port "$(free_port)" examples/train_moe.py --check-determinism
  [[ $DRY -eq 1 ]] || tail -n 3 "$dir/train_moe.log" | sed 's/^/    /'

  # 5. per-call host overhead (figures, not checks): the binding's, and the DeepEP-compatible layer's
  begin_step "python: per-call overhead"
  local nproc=$((gpus >= 2 ? 2 : 1)) extra
  for extra in "" "--explicit-stream"; do
    # shellcheck disable=SC2086
    python_step "overhead${extra:+-explicit}" "$dir/bench_overhead${extra:+-explicit}.log" "$(bounded 300)" "$PY" \
      -m torch.distributed.run --nproc-per-node "$nproc" --master-port "$(free_port)" python/bench_overhead.py $extra
  done
  local tokens
  for tokens in 1 128; do
    python_step "deep-ep-overhead-$tokens" "$dir/deep_ep_overhead-$tokens.log" "$(bounded 300)" "$PY" \
      -m torch.distributed.run --nproc-per-node 1 --master-port "$(free_port)" python/bench_deep_ep_overhead.py \
      --tokens "$tokens" --graph
  done
}

# ---------------------------------------------------------------------------------------------------------------------
# internode

# internode_bench NAME CAP ARGS...: one bench run of the inter-node checks and a line of what it says.
internode_bench() {
  local dir=$1 name=$2 cap=$3
  shift 3
  if [[ $(left) -lt 45 ]]; then
    record "internode-$name" skipped "budget"
    return
  fi
  STEP_START=$SECONDS
  stamp "internode: bench $name: $*"
  bench_run "$dir" "$name" "$(bounded "$cap" 25)" "$BUILD/ferry" "$@"
  local rc=$? log="$dir/$name.log"
  [[ $DRY -eq 1 ]] && { record "internode-$name" ok "dry run"; return; }
  local detail
  detail="$(grep -c 'PASS$' "$log") PASS rows, $(grep -c 'FAIL$' "$log") FAIL rows, $(grep -c ', equal)' "$log") legs' bytes equal to the model, $(grep -c DIFFERENT "$log") DIFFERENT"
  if [[ $rc -ne 0 ]] || grep -q -E 'FAIL$|DIFFERENT' "$log"; then
    grep -m3 -E "error \(|check failed|TimeoutError|what\(\)" "$log" | cut -c1-300 | sed 's/^/    /'
    record "internode-$name" FAILED "exit $rc$([[ $rc -eq 124 ]] && echo ' (timed out)'), $detail"
  else
    record "internode-$name" ok "$detail"
  fi
}

step_internode() {  # [--no-build]
  local build_step=1
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --no-build) build_step=0; shift ;;
      *) fail_usage "unknown option '$1' (see internode --help)" ;;
    esac
  done
  local dir="$OUT/internode" gpus
  mkdir -p "$dir"
  gpus=$(gpu_count)
  export FERRY_TIMEOUT_S="${FERRY_TIMEOUT_S:-20}"
  if [[ $gpus -lt 2 && $DRY -eq 0 ]]; then
    record internode FAILED "needs 2 GPUs, found $gpus"
    return 1
  fi
  [[ $DRY -eq 1 ]] || { nvidia-smi -L; nvidia-smi topo -m; git log -1 --format='commit %h %s'; date -u; } >"$dir/machine.log" 2>&1
  export CUDA_VISIBLE_DEVICES=0,1
  if [[ $build_step -eq 1 ]]; then
    begin_step "internode: build ferry_cli ferry_gpu_tests"
    configure_tree . "$BUILD" "$dir" && build_targets "$BUILD" "$dir/build.log" ferry_cli ferry_gpu_tests ||
      { record internode-build FAILED "see internode/build.log"; return 1; }
    record internode-build ok "$BUILD"
  fi
  local common=(--graph --check --warmup 3 --iters 10 --seed 44 --routing random,grouped --dispatch bf16,fp8
    --combine bf16,fp8 --explain)
  # 1. the figures: 2x1 and 1x2 side by side, normal then low-latency, no injected delay
  export FERRY_EMULATED_DELAY_NS=0
  internode_bench "$dir" normal-2x1 600 --topology 2x1 --tokens 128,4096 "${common[@]}"
  internode_bench "$dir" normal-1x2 600 --topology 1x2 --tokens 128,4096 "${common[@]}"
  internode_bench "$dir" ll-2x1 600 --topology 2x1 --mode ll --route forward,direct --tokens 1,128,512 "${common[@]}"
  internode_bench "$dir" ll-1x2 600 --topology 1x2 --mode ll --tokens 1,128,512 "${common[@]}"
  unset FERRY_EMULATED_DELAY_NS
  # 2. under the emulated network's default delays (correctness; the times include the injected delays)
  internode_bench "$dir" delays-2x1 300 --topology 2x1 --mode both --tokens 2,128 --check --warmup 1 --iters 3 \
    --seed 45 --dispatch bf16,fp8 --combine bf16,fp8 --explain
  # 3. the library's refusal of a quantized low-latency combine across nodes past its hidden limit (exit 2, the
  #    ConfigError on every rank)
  begin_step "internode: the refusal of a quantized low-latency combine past its hidden limit"
  run_logged "$dir/refusal.log" 60 "$BUILD/ferry" bench --topology 2x1 --mode ll --tokens 1 --hidden 18432 \
    --combine fp8 --iters 1 --warmup 0
  local rc=$?
  if [[ $DRY -eq 1 ]] || { [[ $rc -ne 0 ]] && grep -q 'config error' "$dir/refusal.log"; }; then
    record internode-refusal ok "$([[ $DRY -eq 0 ]] && grep -m1 -o 'config error.*' "$dir/refusal.log" | cut -c1-160)"
  else
    record internode-refusal FAILED "exit $rc without the ConfigError, see internode/refusal.log"
  fi
  # 4. GIN forced: what GIN setup says on this machine (a figure of the machine, not a check: without a GIN-capable
  #    NCCL and NIC, both refuse with the reason)
  begin_step "internode: GIN probes (FERRY_NETWORK=gin)"
  run_logged "$dir/gin-test.log" 120 env FERRY_NETWORK=gin "$BUILD/tests/ferry_gpu_tests" --gtest_filter='GinSetup.*'
  rc=$?
  run_logged "$dir/gin-bench.log" 120 env FERRY_NETWORK=gin NCCL_DEBUG=WARN "$BUILD/ferry" bench --topology 2x1 \
    --tokens 128 --iters 1 --warmup 0
  record internode-gin ok "GinSetup.* exit $rc; bench exit $?; $([[ $DRY -eq 0 ]] && grep -m1 -o 'error (.*' "$dir/gin-bench.log" | cut -c1-160)"
  # 5. the virtual-rank inter-node tests, one GPU each, side by side (correctness: their times are not figures)
  if [[ $(left) -lt 60 ]]; then
    record internode-virtual skipped "budget"
  else
    begin_step "internode: virtual-rank tests, InternodeVirtual.* on GPU 0 and LowLatencyAcrossNodes.* on GPU 1"
    local limit
    limit=$(bounded 1800 15)
    CUDA_VISIBLE_DEVICES=0 run_logged "$dir/internode-virtual.log" "$limit" "$BUILD/tests/ferry_gpu_tests" \
      --gtest_filter='InternodeVirtual.*' &
    local a=$!
    CUDA_VISIBLE_DEVICES=1 run_logged "$dir/ll-across-nodes.log" "$limit" "$BUILD/tests/ferry_gpu_tests" \
      --gtest_filter='LowLatencyAcrossNodes.*' &
    local b=$! ra rb
    wait $a
    ra=$?
    wait $b
    rb=$?
    local name log_rc
    for log_rc in "internode-virtual:$ra" "ll-across-nodes:$rb"; do
      name=${log_rc%%:*}
      rc=${log_rc#*:}
      local detail="exit $rc"
      [[ $DRY -eq 0 ]] && detail+=", $(grep -c '^\[       OK' "$dir/$name.log") OK, $(grep -c '^\[  FAILED' "$dir/$name.log") FAILED"
      if [[ $rc -eq 0 ]]; then record "internode-$name" ok "$detail"; else record "internode-$name" FAILED "$detail"; fi
    done
  fi
}

# ---------------------------------------------------------------------------------------------------------------------
# scale

step_scale() {  # [--ferry PATH] [--quick] [--iters N] [--tune]
  local ferry="$BUILD/ferry" quick=0 iters=20 tune=0
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --ferry) optval "$@"; ferry="$2"; shift 2 ;;
      --quick) quick=1; iters=10; shift ;;
      --iters) optnum "$@"; iters=$2; shift 2 ;;
      --tune) tune=1; shift ;;
      *) fail_usage "unknown option '$1' (see scale --help)" ;;
    esac
  done
  local dir="$OUT/scale" gpus
  mkdir -p "$dir"
  gpus=$(gpu_count)
  if [[ $DRY -eq 0 && ! -x "$ferry" ]]; then
    step_build --target ferry_cli || return 1
  fi
  echo "    $gpus GPU(s), one rank each"
  if [[ $gpus -ge 2 ]]; then
    # the ceiling of this world's legs: every GPU pushing to (pulling from) every other at once
    begin_step "scale: ferry p2p --directions alltoall"
    run_logged "$dir/p2p.log" "$(bounded 900)" "$ferry" p2p --nproc "$gpus" --directions alltoall --ops push,pull \
      --sizes 16MiB,256MiB --ctas "$((gpus - 1)),32,66,132" --json "$dir/p2p.json"
    local rc=$?
    if [[ $rc -eq 0 ]]; then record scale-p2p ok "alltoall ceiling"; else record scale-p2p FAILED "exit $rc"; fi
  fi
  local normal_tokens="128,512,4096" ll_tokens="1,128,512"
  [[ $quick -eq 1 ]] && { normal_tokens="4096"; ll_tokens="128"; }
  # bf16/bf16, fp8 dispatch, fp8 combine: every leg of both formats, the pairs the engines run
  local common=(--graph --check --baseline nccl --routing random,grouped --dispatch bf16,fp8,bf16
    --combine bf16,bf16,fp8 --iters "$iters" --seed 0)
  begin_step "scale: ferry bench, normal mode, tokens $normal_tokens"
  bench_run "$dir" normal "$(bounded 1800)" "$ferry" --tokens "$normal_tokens" "${common[@]}"
  rc=$?
  if [[ $rc -eq 0 ]]; then record scale-normal ok "$gpus ranks"; else record scale-normal FAILED "exit $rc"; fi
  begin_step "scale: ferry bench, low-latency mode, tokens $ll_tokens"
  bench_run "$dir" ll "$(bounded 1800)" "$ferry" --mode ll --tokens "$ll_tokens" "${common[@]}"
  rc=$?
  if [[ $rc -eq 0 ]]; then record scale-ll ok "$gpus ranks"; else record scale-ll FAILED "exit $rc"; fi
  if [[ $tune -eq 1 ]]; then
    local tune_args=(--ferry "$ferry" --shapes deepseek)
    [[ $quick -eq 1 ]] && tune_args+=(--quick)
    step_tune "${tune_args[@]}"
  fi
}

# ---------------------------------------------------------------------------------------------------------------------
# tune

step_tune() {  # [--ferry PATH] [--shapes LIST] [--quick] [--no-verify]
  local ferry="$BUILD/ferry" shapes="deepseek,qwen3,gptoss" quick=0 verify=1
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --ferry) optval "$@"; ferry="$2"; shift 2 ;;
      --shapes) optval "$@"; shapes="$2"; shift 2 ;;
      --quick) quick=1; shift ;;
      --no-verify) verify=0; shift ;;
      *) fail_usage "unknown option '$1' (see tune --help)" ;;
    esac
  done
  # model shapes: name -> hidden topk experts
  declare -A shape=([deepseek]="7168 8 256" [qwen3]="4096 8 128" [gptoss]="2880 4 128")
  local name
  IFS=',' read -r -a shape_list <<<"$shapes"
  for name in "${shape_list[@]}"; do
    [[ -n "${shape[$name]:-}" ]] || fail_usage "--shapes: '$name' is not one of deepseek, qwen3, gptoss"
  done
  local dir="$OUT/tune"
  mkdir -p "$dir"
  if [[ $DRY -eq 0 && ! -x "$ferry" ]]; then
    record tune FAILED "no CLI $ferry (build it first)"
    return 1
  fi
  local normal_tokens ll_tokens blocks=() common
  if [[ $quick -eq 1 ]]; then
    normal_tokens="128,1024,4096" ll_tokens="128,512" blocks=(--blocks 32,66,132) common=(--rounds 2 --warmup 2 --iters 5)
  else
    normal_tokens="128,256,512,1024,2048,4096" ll_tokens="1,128,256,512" common=(--rounds 3)
  fi
  local hidden topk experts format formats mode tokens log rc vrc worst
  for name in "${shape_list[@]}"; do
    read -r hidden topk experts <<<"${shape[$name]}"
    formats="bf16 fp8"
    [[ $name == gptoss ]] && formats="bf16 mxfp4"  # hidden 2880 is not a multiple of fp8's 128-element block
    for format in $formats; do
      for mode in normal ll; do
        tokens=$normal_tokens
        [[ $mode == ll ]] && tokens=$ll_tokens
        local args=(--hidden "$hidden" --topk "$topk" --experts "$experts" --dispatch "$format" --mode "$mode"
          --tokens "$tokens" "${common[@]}" "${blocks[@]}")
        if [[ $(left) -lt 60 ]]; then
          record "tune-$name-$format-$mode" skipped "budget"
          continue
        fi
        begin_step "tune $name $format $mode"
        log="$dir/tune-$name-$format-$mode.log"
        run_logged "$log" "$(bounded 1800)" "$ferry" tune "${args[@]}"
        rc=$?
        [[ $DRY -eq 1 ]] || grep -E "^  (dispatch|combine) +<=|FAIL|error" "$log" | head -n 12 | sed 's/^/    /'
        if [[ $rc -ne 0 ]]; then
          record "tune-$name-$format-$mode" FAILED "exit $rc"
          continue
        fi
        if [[ $verify -eq 0 ]]; then
          record "tune-$name-$format-$mode" ok "tuned"
          continue
        fi
        run_logged "$log.verify" "$(bounded 1800)" "$ferry" tune "${args[@]}" --verify
        vrc=$?
        worst=""
        [[ $DRY -eq 1 ]] || worst=$(grep -oE "[0-9.]+ x the best" "$log.verify" | sort -n | tail -n 1)
        if [[ $vrc -eq 0 ]]; then
          record "tune-$name-$format-$mode" ok "tuned; verify PASS (worst row ${worst:-?})"
        else
          record "tune-$name-$format-$mode" FAILED "tuned; verify exit $vrc (worst row ${worst:-?})"
        fi
      done
    done
  done
  [[ $DRY -eq 1 ]] || cp src/tuning/tables/*.json "$dir/" 2>/dev/null
  echo "    the tables (src/tuning/tables/) copied to $dir; commit the new entries of this GPU's table"
}

# ---------------------------------------------------------------------------------------------------------------------
# pack and run-packed

# relink_static BUILD TARGET DEST: relinks TARGET of BUILD (a path relative to it) into DEST with the static CUDA
# runtime (the GPU machine's libcudart may differ), strips it, compresses it to DEST.xz and writes the NCCL version of
# BUILD's headers to DEST's folder/nccl-version.
relink_static() {
  local build=$1 target=$2 dest=$3 link
  if [[ $DRY -eq 1 ]]; then
    echo "[dry-run] relink $build/$target with the static CUDA runtime, strip, xz -> $dest.xz"
    return 0
  fi
  [[ -x "$build/$target" ]] || { echo "gpu-check pack: $build/$target is not built" >&2; return 2; }
  [[ -f "$build/build.ninja" ]] || { echo "gpu-check pack: $build is not a Ninja build (the relink reads ninja's link line)" >&2; return 2; }
  link=$(cd "$build" && ninja -t commands "$target" | tail -n 1)
  [[ "$link" == *" -o $target "* ]] || { echo "gpu-check pack: the last build command of $target is not its link" >&2; return 2; }
  # the shared CUDA runtime out (the static one, which the link line may name, stays), its rpath too
  local cudart_dir static_cudart="-lcudart_static"
  cudart_dir=$(grep -o ' [^ ]*/libcudart\.so ' <<<"$link" | head -n 1 | xargs -r dirname)
  link=$(sed -e 's# [^ ]*/libcudart\.so # #g' -e 's# -Wl,-rpath,[^ ]*##g' -e "s# -o $target # -o $dest #" <<<"$link")
  [[ -n "$cudart_dir" && -f "$cudart_dir/libcudart_static.a" ]] && static_cudart="$cudart_dir/libcudart_static.a"
  [[ "$link" == *cudart_static* ]] || link="${link% && :} $static_cudart -ldl -lrt"
  mkdir -p "$(dirname "$dest")"
  (cd "$build" && eval "$link") || return 2
  strip "$dest" || return 2
  if ldd "$dest" | grep -q libcudart; then
    echo "gpu-check pack: $dest still loads a shared libcudart" >&2
    return 2
  fi
  xz -T0 -6 -f "$dest" || return 2
  local nccl_h
  nccl_h="$(sed -n 's/^FERRY_NCCL_INCLUDE_DIR:PATH=//p' "$build/CMakeCache.txt" 2>/dev/null)/nccl.h"
  [[ -f "$nccl_h" ]] && sed -n 's/^#define NCCL_VERSION_CODE \([0-9]*\).*/\1/p' "$nccl_h" >"$(dirname "$dest")/nccl-version"
  return 0
}

step_pack() {  # [--tests] [--example] [--cli] [--commit REV]
  local pack_tests=0 example=0 cli=0 commits=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --tests) pack_tests=1; shift ;;
      --example) example=1; shift ;;
      --cli) cli=1; shift ;;
      --commit) optval "$@"; commits+=("$2"); shift 2 ;;
      *) fail_usage "unknown option '$1' (see pack --help)" ;;
    esac
  done
  [[ $pack_tests -eq 0 && $example -eq 0 && $cli -eq 0 && ${#commits[@]} -eq 0 ]] && pack_tests=1 cli=1
  local here
  here="$(git rev-parse --short HEAD 2>/dev/null || echo '?')$(git diff --quiet HEAD -- src tests tools bench 2>/dev/null || echo ' + changes')"
  if [[ $pack_tests -eq 1 ]]; then
    begin_step "pack: ferry_gpu_tests of $BUILD"
    if relink_static "$BUILD" tests/ferry_gpu_tests "$OUT/ferry_gpu_tests"; then
      echo "$here" >"$OUT/ferry_gpu_tests.txt"
      record pack-tests ok "ferry_gpu_tests.xz ($here)"
    else
      record pack-tests FAILED "build tests/ferry_gpu_tests in $BUILD (a cuda build) first"
    fi
  fi
  if [[ $example -eq 1 ]]; then
    begin_step "pack: examples/cpp against the installed package of $BUILD"
    # built and run here on the cpu backend first (tests/install/consume.sh), then packed for the cuda backend
    if run_logged "$OUT/example-here.log" 0 tests/install/consume.sh "$BUILD" "$ROOT" &&
      relink_static "$BUILD/install-check/consumer" moe_round_trip "$OUT/moe_round_trip"; then
      record pack-example ok "moe_round_trip.xz"
    else
      record pack-example FAILED "see $OUT/example-here.log"
    fi
  fi
  if [[ $cli -eq 1 ]]; then
    begin_step "pack: the ferry CLI of $BUILD"
    if relink_static "$BUILD" ferry "$OUT/ferry"; then
      echo "$here" >"$OUT/ferry.txt"
      record pack-cli ok "ferry.xz ($here)"
    else
      record pack-cli FAILED "build ferry_cli in $BUILD (a cuda build) first"
    fi
  fi
  local rev full short src
  for rev in "${commits[@]}"; do
    begin_step "pack: the ferry CLI of $rev"
    full=$(git rev-parse --verify --quiet "$rev^{commit}") || { record "pack-$rev" FAILED "no commit $rev"; continue; }
    short=${full:0:7}
    src="$(sides_cache)/${full:0:12}/src"
    if [[ $DRY -eq 0 && ! -f "$src/CMakeLists.txt" ]]; then
      mkdir -p "$src" && git archive "$full" | tar -x -C "$src" || { record "pack-$rev" FAILED "git archive"; continue; }
    fi
    if configure_tree "$src" "${src%/src}/build" "$OUT/logs-$short" -DFERRY_BUILD_TESTS=OFF &&
      build_targets "${src%/src}/build" "$OUT/logs-$short/build.log" ferry_cli &&
      relink_static "${src%/src}/build" ferry "$OUT/ferry-$short"; then
      git log -1 --format='%h %s' "$full" | cut -c1-100 >"$OUT/ferry-$short.txt"
      record "pack-$short" ok "ferry-$short.xz"
    else
      record "pack-$short" FAILED "see $OUT/logs-$short/"
    fi
  done
  [[ $DRY -eq 1 ]] || { echo "    $OUT:"; ls -la "$OUT" | sed 's/^/    /'; }
}

step_run_packed() {
  local pack="" rest=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --pack) optval "$@"; pack="$2"; shift 2 ;;
      *) rest+=("$1"); shift ;;
    esac
  done
  [[ -n "$pack" && -d "$pack" ]] || fail_usage "give the packed binaries: --pack PACK_DIR (from \`pack\`)"
  parse_test_options "${rest[@]}"
  if [[ -f "$pack/moe_round_trip.xz" ]]; then
    EXAMPLE_BIN="$pack/moe_round_trip.xz"
    step_example
  fi
  if [[ -f "$pack/ferry_gpu_tests.xz" ]]; then
    TEST_BIN="$pack/ferry_gpu_tests.xz"
    step_test
  elif [[ ! -f "$pack/moe_round_trip.xz" ]]; then
    fail_usage "$pack holds neither ferry_gpu_tests.xz nor moe_round_trip.xz"
  fi
}

# ---------------------------------------------------------------------------------------------------------------------
# all

step_all() {
  local example=1 bench=1 p2p=0 python=0 test_args=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --no-example) example=0; shift ;;
      --no-bench) bench=0; shift ;;
      --p2p) p2p=1; shift ;;
      --python) python=1; shift ;;
      --tests | --resume) optval "$@"; test_args+=("$1" "$2"); shift 2 ;;
      *) fail_usage "unknown option '$1' (see all --help)" ;;
    esac
  done
  parse_test_options "${test_args[@]}"
  # the short steps first, the GPU tests last: a budget that runs out leaves out tests, which --resume runs later
  step_build
  if [[ $example -eq 1 ]]; then
    if [[ $(left) -lt 60 ]]; then record example skipped "budget"; else step_example; fi
  fi
  if [[ $bench -eq 1 ]]; then
    if [[ $(left) -lt 120 ]]; then record bench skipped "budget"; else step_bench --quick; fi
  fi
  if [[ $p2p -eq 1 ]]; then
    if [[ $(left) -lt 60 ]]; then record p2p skipped "budget"; else step_p2p; fi
  fi
  [[ $python -eq 1 ]] && step_python
  if [[ $DRY -eq 1 || -x "$BUILD/tests/ferry_gpu_tests" ]]; then step_test; else record tests FAILED "not built"; fi
  return 0
}

# ---------------------------------------------------------------------------------------------------------------------
# report: the table, from what a run left in OUT_DIR

print_report() {
  python3 - "$1" <<'PY'
import csv, collections, glob, json, os, re, statistics, sys

out = sys.argv[1]

def path(*parts):
    return os.path.join(out, *parts)

def load(p):
    try:
        with open(p) as f:
            return json.load(f)
    except Exception:
        return None

def read(p):
    try:
        with open(p, errors="replace") as f:
            return f.read()
    except OSError:
        return ""

def section(title):
    print(f"\n-- {title}")

# the GPU tests
if os.path.exists(path("tests", "status")):
    status = {}
    for line in read(path("tests", "status")).splitlines():
        fields = line.split("\t")
        if len(fields) >= 2:
            status[fields[0]] = fields[1]
    count = collections.Counter(status.values())
    section("GPU tests")
    print(f"{count['passed']} passed, {count['failed']} failed, {count['skipped']} skipped, "
          f"{count['cut'] + count['not-run']} left out by the budget (of {len(status) - count['disabled']}; "
          f"{count['disabled']} disabled)")
    for state, label in (("failed", "failed"), ("skipped", "skipped"), ("cut", "cut by the budget"),
                         ("not-run", "not run (budget)")):
        for name in (n for n, s in status.items() if s == state):
            print(f"  {label}: {name}")

# ferry bench records (bench/, scale/)
def bench_table(title, files):
    rows = []
    for p in files:
        doc = load(p)
        if doc is None:
            rows.append(f"  {os.path.basename(p)}: no result (see its .log)")
            continue
        for r in doc.get("records", []):
            speed = r.get("speedup_vs_baseline")
            rows.append(f"  {r['mode']:<6} {r['routing']:<8} {r['leg']:<17} {r['format']:<6} {r['tokens']:>5} "
                        f"{r['median_us']:9.1f} us {r['nvlink_gbps']:7.1f} GB/s {r['check']:<5}"
                        + (f" x{speed:.2f} vs nccl" if isinstance(speed, (int, float)) else ""))
    if rows:
        section(title + " (slowest rank's medians; graph mode unless noted)")
        print(f"  {'mode':<6} {'routing':<8} {'leg':<17} {'format':<6} {'tokens':>5} {'median':>12} {'NVLink':>12} check")
        print("\n".join(rows))

bench_files = sorted(glob.glob(path("bench", "*.json")))
bench_table("ferry bench", bench_files)

# the A/B
if os.path.exists(path("ab", "sides.tsv")):
    sides, notes = [], {}
    for line in read(path("ab", "sides.tsv")).splitlines():
        fields = line.split("\t")
        sides.append(fields[0])
        notes[fields[0]] = fields[1] + (f", with {fields[2]}" if len(fields) > 2 and fields[2] else "")
    med = {s: collections.defaultdict(list) for s in sides}
    checks = {s: set() for s in sides}
    for p in sorted(glob.glob(path("ab", "runs", "*.json"))):
        m = re.match(r"([a-z])-(\d+)-(\d+)\.json$", os.path.basename(p))
        doc = load(p)
        if not m or doc is None or m.group(1) not in med:
            continue
        for rec in doc["records"]:
            key = (rec["mode"], rec.get("layout", "-"), rec["leg"], rec["tokens"],
                   rec.get("dispatch_format", rec.get("format")), rec.get("combine_format", rec.get("format")))
            med[m.group(1)][key].append(rec["median_us"])
            checks[m.group(1)].add(rec["check"])
    lines = []
    for s in sides:
        lines.append(f"{s.upper()}: {notes[s]}")
    flags = read(path("ab", "flags.txt")).strip()
    for w in read(path("ab", "runs.txt")).splitlines():
        lines.append(f"workload: ferry bench {w} {flags}")
    lines.append(f"rounds: {read(path('ab', 'rounds')).strip() or '?'}; each figure the median over the rounds of each "
                 f"run's median (slowest rank), each side / A, and each side's range over the rounds")
    up = [s.upper() for s in sides]
    lines.append(f"{'mode':<7} {'layout':<7} {'leg':<17} {'tokens':>6} {'dispatch':<9} {'combine':<9} " +
                 " ".join(f"{x + ' us':>8}" for x in up) + " " + " ".join(f"{x + '/A':>6}" for x in up[1:]) + "  " +
                 " ".join(f"{x + ' rounds':<13}" for x in up))
    span = lambda v: f"{min(v):.2f}-{max(v):.2f}" if v else "-"
    med_of = lambda v: statistics.median(v) if v else float("nan")
    # normal mode first, then by layout, size and formats, the legs in the order they run
    mode_rank = {"normal": 0, "ll": 1}
    leg_rank = {"dispatch": 0, "combine": 1, "dispatch_backward": 2, "combine_backward": 3}
    keys = sorted(set().union(*(med[s].keys() for s in sides)),
                  key=lambda k: (mode_rank.get(k[0], 9), k[1], k[3], k[4], k[5], leg_rank.get(k[2], 9), k[2]))
    over = {s: 0 for s in sides[1:]}
    for key in keys:
        v = [med[s].get(key, []) for s in sides]
        m = [med_of(x) for x in v]
        ratios = [x / m[0] if m[0] == m[0] and m[0] > 0 else float("nan") for x in m[1:]]
        for s, r in zip(sides[1:], ratios):
            over[s] += r > 1.03
        lines.append(f"{key[0]:<7} {key[1]:<7} {key[2]:<17} {key[3]:>6} {key[4]:<9} {key[5]:<9} " +
                     " ".join(f"{x:8.2f}" for x in m) + " " + " ".join(f"{x:6.3f}" for x in ratios) + "  " +
                     " ".join(f"{span(x):<13}" for x in v))
    lines.append("checks: " + ", ".join(f"{s.upper()} {sorted(checks[s]) or ['no runs']}" for s in sides))
    lines.append("over 3% slower than A: " + ", ".join(f"{s.upper()} {over[s]} of {len(keys)} legs" for s in sides[1:]))
    with open(path("ab", "table.txt"), "w") as f:
        f.write("\n".join(lines) + "\n")
    section("A/B of ferry bench")
    print("\n".join(lines))

    # kernel time (ncu): a kernel is matched across the sides by its function name and the order in which its
    # instances first ran (a later tree may add template instances); shown by A's name with template arguments
    kt = path("ab", "kernel-time")
    if os.path.isdir(kt):
        workloads = read(os.path.join(kt, "workloads.txt")).splitlines()
        metrics = ("gpu__time_duration.sum", "sm__inst_executed.sum", "launch__grid_size",
                   "launch__registers_per_thread")
        STALL = "smsp__average_warps_issue_stalled_"
        def short(name):
            name = re.sub(r"\((?:ferry::)?[\w:]+\)", "", name)
            name = re.sub(r"^void\s+", "", name)
            return re.sub(r"\b(?:[a-z_]\w*::)+", "", name).replace(" ", "")[:70]
        runs = collections.defaultdict(lambda: collections.defaultdict(list))
        shown = {}
        for p in sorted(glob.glob(os.path.join(kt, "ncu-*-*-*.csv"))):
            side, w = os.path.basename(p).split("-")[1:3]
            values = collections.defaultdict(lambda: collections.defaultdict(list))
            order = collections.defaultdict(list)
            with open(p, errors="replace") as f:
                for r in csv.DictReader(line for line in f if line.startswith('"')):
                    mname = r.get("Metric Name", "")
                    if mname in metrics or mname.startswith(STALL):
                        name = short(r["Kernel Name"])
                        function = name.split("<")[0]
                        if name not in order[function]:
                            order[function].append(name)
                        k = (function, order[function].index(name))
                        shown.setdefault((int(w), k, side), name)
                        values[k][mname].append(float(r["Metric Value"].replace(",", "")))
            for k, got in values.items():
                for name, v in got.items():
                    runs[(int(w), k, side)][name].append(statistics.median(v))
        section("kernel time (ncu; median of each run's launches, then of the runs; grid in CTAs x registers)")
        for w, args in enumerate(workloads):
            print(f"ferry bench {args}")
            ks = sorted({k for (x, k, _) in runs if x == w})
            if not ks:
                print("  no kernels (see ab/kernel-time/)")
            for k in ks:
                got = [runs.get((w, k, x)) for x in sides]
                print("  " + next(shown[(w, k, x)] for x in sides if (w, k, x) in shown))
                vals = [[statistics.median(g[mm]) if g[mm] else float("nan") for mm in metrics] if g else None
                        for g in got]
                cols = [f"{x.upper()}: " + (f"{v[0]:.0f} ns {v[1]:.0f} instr {v[2]:.0f}x{v[3]:.0f}" if v else "-")
                        for x, v in zip(sides, vals)]
                ratios = " ".join(f"{x.upper()}/A {v[0] / vals[0][0]:.3f}" for x, v in zip(sides[1:], vals[1:])
                                  if v and vals[0])
                print("    " + " | ".join(cols) + (f" | {ratios}" if ratios else ""))
                if all(got):
                    reasons = sorted({mm for g in got for mm in g if mm.startswith(STALL)})
                    per = {mm: [statistics.median(g[mm]) if g.get(mm) else 0.0 for g in got] for mm in reasons}
                    for mm in sorted(per, key=lambda mm: max(per[mm]) - min(per[mm]), reverse=True)[:6]:
                        name = mm[len(STALL):].replace("_per_issue_active.ratio", "")
                        print(f"      stalled {name:<20}" + " ".join(f"{x.upper()} {v:6.3f}" for x, v in zip(sides, per[mm])))

# ferry p2p
def p2p_summary(p, title):
    doc = load(p)
    if doc is None:
        return
    recs = doc["records"]
    net = lambda r: "" if r.get("transport", "lsa") == "lsa" else \
        f" [{r['transport'].upper()}{', 1 GPU' if r.get('one_gpu') else ''}]"
    section(title)
    for op in ("push", "pull", "copy_engine", "put_signal"):
        size = max((r["bytes"] for r in recs if r["op"] == op and r.get("direction") != "alltoall"), default=0)
        def best(direction):
            rows = [r for r in recs if r["op"] == op and r.get("direction") == direction and r["bytes"] == size]
            return max(rows, key=lambda r: r["gbps"]) if rows else None
        one, bi = best("oneway"), best("bidir")
        parts = []
        if one:
            parts.append(f"oneway {one['gbps']:.1f} GB/s" + (f" @{one['ctas']} CTAs" if one.get('ctas') else ""))
        if bi:
            parts.append(f"bidir {bi['gbps']:.1f}/dir = {bi.get('gbps_sum', 2 * bi['gbps']):.1f} GB/s sum"
                         + (f" @{bi['ctas']} CTAs" if bi.get('ctas') else ""))
        if parts:
            label = f"{size >> 20}MiB" if size >> 20 else f"{size >> 10}KiB"
            print(f"  {op:<11} {label} {'; '.join(parts)}{net(one or bi)}")
        a2a = [r for r in recs if r["op"] == op and r.get("direction") == "alltoall"]
        if a2a:
            top = max(a2a, key=lambda r: (r["bytes"], r["gbps"]))
            print(f"  {op:<11} all-to-all ceiling, {top['bytes'] >> 20} MiB to each of {top.get('peers', '?')} peers: "
                  f"{top['gbps']:.1f} GB/s sent a GPU at {top.get('ctas')} CTAs")
    for r in recs:
        if r["op"] == "latency":
            print(f"  latency     one-way {r['latency_us']:.2f} us{net(r)}")

p2p_summary(path("p2p", "p2p.json"), "ferry p2p")
p2p_summary(path("scale", "p2p.json"), "all-to-all ceiling (scale)")

# scale: the table and the EP8 goals
scale = [load(p) for p in (path("scale", "normal.json"), path("scale", "ll.json"))]
if any(scale):
    bench_table("scale: ferry bench at this machine's world, NCCL baseline",
                [p for p in (path("scale", "normal.json"), path("scale", "ll.json")) if os.path.exists(p)])
    rows = [r for doc in scale if doc for r in doc["records"]]
    world = next((doc.get("world") for doc in scale if doc), None)
    def first(mode, leg, tokens):
        for r in rows:
            pair = (r.get("dispatch_format", "bf16"), r.get("combine_format", "bf16"))
            if (r["mode"], r["leg"], r["tokens"], r["routing"], pair) == (mode, leg, tokens, "random", ("bf16", "bf16")):
                return r
    print(f"goals, bf16, random routing" + ("" if world == 8 else f" (stated at EP8; this run is world {world})") + ":")
    for mode, leg, tokens, key, goal, higher in (("normal", "dispatch", 4096, "logical_gbps", 370.0, True),
                                                 ("ll", "dispatch", 128, "median_us", 25.0, False),
                                                 ("ll", "combine", 128, "median_us", 30.0, False)):
        r = first(mode, leg, tokens)
        if r is None:
            print(f"  {mode} {leg} {tokens} tokens: not run")
            continue
        met = r[key] >= goal if higher else r[key] <= goal
        unit = "GB/s logical" if key == "logical_gbps" else "us"
        verdict = ("met" if met else "missed") if world == 8 else "not judged below EP8"
        print(f"  {mode:<7}{leg:<9}{tokens:>5} tokens: {r[key]:8.1f} {unit} (goal {'>=' if higher else '<='} {goal:g}): "
              f"{verdict}")

# internode: every bench case, slowest rank's medians
inter = sorted(glob.glob(path("internode", "*.json")))
if inter:
    section("internode: emulated nodes on one host over NVLink, slowest rank's medians (not network figures)")
    rows = {}
    for p in inter:
        name = os.path.basename(p)[:-5]
        doc = load(p)
        for r in (doc or {}).get("records", []):
            route = {"hierarchical": "hier"}.get(r.get("route", "-"), r.get("route", "-"))
            key = (name, route, r["tokens"], r["routing"], r["dispatch_format"] + "/" + r["combine_format"], r["mode"])
            rows.setdefault(key, {})[r["leg"]] = r
    print("  %-10s %-7s %5s %-7s %-9s %8s %8s %-5s %s" % ("run", "route", "tok", "routing", "formats", "disp_us",
          "comb_us", "check", "network B/rank, dispatch / combine: counted (model)"))
    for key, legs in rows.items():
        d, c = legs.get("dispatch", {}), legs.get("combine", {})
        check = "PASS" if d.get("check") == c.get("check") == "pass" else d.get("check", "?") + "/" + c.get("check", "?")
        def bytes_of(r):
            if "model_network_bytes" not in r:
                return ""
            got = "%.0f" % r["network_bytes"] if "network_bytes" in r else "n/c"
            return "%s (%.0f)" % (got, r["model_network_bytes"])
        run = key[0] if key[5] in key[0] else key[0] + ":" + key[5]
        nb = "%s / %s" % (bytes_of(d), bytes_of(c)) if bytes_of(d) else ""
        print("  %-10s %-7s %5d %-7s %-9s %8.1f %8.1f %-5s %s" % (run, key[1], key[2], key[3], key[4],
              d.get("median_us", -1), c.get("median_us", -1), check, nb))

# python: the examples' and the overheads' figures
if os.path.isdir(path("python")):
    section("python")
    text = read(path("python", "pytest.log"))
    summary = [line for line in text.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    if summary:
        print(f"  pytest: {summary[-1].strip('= ')}")
    rows = re.findall(r"^rank (\d+)/\d+ \[([^\]]*)\].*max \|y - y_ref\| = ([^,]+), ([\d.]+) of the bf16 tolerance: (\w+)",
                      read(path("python", "moe_layer.log")), re.M)
    if rows:
        print(f"  moe_layer: worst {max(float(r[3]) for r in rows):.2f} of the bf16 tolerance, "
              f"{'OK' if all(r[4] == 'OK' for r in rows) else 'FAILED'}")
    for p in sorted(glob.glob(path("python", "bench_overhead*.log"))):
        for label, per_call in re.findall(r"^rank \d+/\d+ \[([^\]]*)\]: .*\(([-\d.]+) us per call", read(p), re.M)[:1]:
            print(f"  binding overhead [{label}]: {per_call} us per call (rank 0)")
    for p in sorted(glob.glob(path("python", "deep_ep_overhead-*.log"))):
        for line in read(p).splitlines():
            if line.startswith("rank"):
                print(f"  deep_ep overhead: {line[:150]}")
                break

# the steps
steps = [line.split("\t") for line in read(path("status")).splitlines() if line.strip()]
if steps:
    section("steps")
    for fields in steps:
        fields += [""] * (4 - len(fields))
        print(f"  {fields[0]:<28} {fields[1]:<7} {fields[2]:>6} s  {fields[3][:120]}")
print(f"\nlogs and results: {out}")
PY
}

# ---------------------------------------------------------------------------------------------------------------------
# main

[[ $# -eq 0 ]] && { usage; exit 2; }
case "$1" in
  -h | --help) usage; exit 0 ;;
esac
CMD=$1
shift
case "$CMD" in
  all | build | test | example | bench | ab | p2p | python | internode | scale | tune | pack | run-packed | report) ;;
  *) fail_usage "unknown command '$CMD'; the commands: all build test example bench ab p2p python internode scale tune pack run-packed report (scripts/gpu-check.sh --help)" ;;
esac
for arg in "$@"; do
  if [[ "$arg" == -h || "$arg" == --help ]]; then
    "help_${CMD//-/_}"
    exit 0
  fi
done
set_out "${1:-}"
shift
if [[ $CMD == report ]]; then
  [[ $# -eq 0 ]] || fail_usage "report takes only OUT_DIR"
  print_report "$OUT"
  exit 0
fi
parse_common "$@"
set -- "${ARGS[@]+"${ARGS[@]}"}"
BUILD=$(realpath -m "$BUILD")
: >"$OUT/status"
machine_line
case "$CMD" in
  all) step_all "$@" ;;
  build) step_build "$@" ;;
  test) parse_test_options "$@"; step_test ;;
  example)
    while [[ $# -gt 0 ]]; do
      case "$1" in
        --bin) optval "$@"; EXAMPLE_BIN="$2"; shift 2 ;;
        *) fail_usage "unknown option '$1' (see example --help)" ;;
      esac
    done
    step_example ;;
  bench) step_bench "$@" ;;
  ab) step_ab "$@" ;;
  p2p) step_p2p "$@" ;;
  python) step_python "$@" ;;
  internode) step_internode "$@" ;;
  scale) step_scale "$@" ;;
  tune) step_tune "$@" ;;
  pack) step_pack "$@" ;;
  run-packed) step_run_packed "$@" ;;
esac
stamp "done"
print_report "$OUT"
if [[ $FAILURES -gt 0 ]]; then
  echo "gpu-check $CMD: FAILED ($FAILURES step(s); see the steps above)"
  exit 1
fi
echo "gpu-check $CMD: OK"
