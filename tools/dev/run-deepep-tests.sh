#!/usr/bin/env bash
# Runs DeepEP's own test programs, unmodified, against ferry.deep_ep, on a machine with GPUs and torch.
#
#   tools/dev/run-deepep-tests.sh DEEPEP_DIR OUT_DIR [BUILD_DIR]
#
# DEEPEP_DIR  a DeepEP source tree (deepseek-ai/DeepEP): its tests/legacy/, tests/elastic/ and deep_ep/utils/ are used
# OUT_DIR     where each program's log goes (created); a pass/fail table is printed last and saved as summary.txt
# BUILD_DIR   a Ferry build with -DFERRY_BUILD_PYTHON=ON (default: build); unused when ferry is pip-installed
#
# `import deep_ep` resolves to Ferry the documented way (docs/deep_ep.md, "Switching an engine"): FERRY_DEEP_EP=1. A
# pip-installed ferry does it through its ferry-deep-ep.pth; in a build tree the script puts a sitecustomize.py
# doing the same on the path. DeepEP's test helpers (deep_ep.utils.math, testing, refs, gate, semantic) are DeepEP's
# own files, found beside Ferry's deep_ep.utils (which provides event and envs); nothing of DeepEP is copied.
#
# What runs, with --num-processes N for N = 1 and each larger world the machine has (2, 4, 8 GPUs):
#   legacy/test_intranode.py                intranode dispatch/combine, then its tuning loops
#   legacy/test_low_latency.py              low-latency, then DeepEP's kineto profile (bench_kineto), which finds
#                                           each leg's kernel by name: one symbol per leg containing "::dispatch" /
#                                           "::combine" (cuda_ll::leg::dispatch / leg::combine; its checks all run
#                                           before the profile)
#   legacy/test_internode.py                needs 8 ranks per node and more than one node (16 GPUs); skipped below
#   elastic/test_ep.py --skip-perf-test     V2's ElasticBuffer; its performance section times DeepEP's kernels by
#                                           name (dispatch_copy_epilogue_impl...), which Ferry does not have
# then python/bench_deep_ep_overhead.py (the layer's host time per call against the native calls) at 1 and 128
# tokens, world 1.
#
# Environment: PYTHON (default python3), FERRY_DEEPEP_TIMEOUT_S per program (default 900), FERRY_DEEPEP_WORLDS to
# choose the worlds (e.g. "1 2"), FERRY_DEEPEP_ONLY to choose the programs (some of "intranode low_latency elastic
# overhead"; default all). NVLink multicast stays off (NCCL_NVLS_ENABLE=0 and the rest, exported here).
set -u

if [ $# -lt 2 ]; then
  sed -n '2,30p' "$0" | sed 's/^# \{0,1\}//'
  exit 2
fi
DEEPEP_DIR=$(cd "$1" && pwd) || exit 2
OUT_DIR=$2
REPO=$(cd "$(dirname "$0")/../.." && pwd)
BUILD_DIR=${3:-$REPO/build}
[ -d "$BUILD_DIR/python" ] && BUILD_DIR=$(cd "$BUILD_DIR" && pwd)  # the tests run from DeepEP's folders
PYTHON=${PYTHON:-python3}
TIMEOUT=${FERRY_DEEPEP_TIMEOUT_S:-900}
mkdir -p "$OUT_DIR"
OUT_DIR=$(cd "$OUT_DIR" && pwd)

for f in tests/legacy/test_intranode.py tests/legacy/test_low_latency.py tests/elastic/test_ep.py \
         deep_ep/utils/math.py deep_ep/utils/testing.py; do
  [ -f "$DEEPEP_DIR/$f" ] || { echo "run-deepep-tests: $DEEPEP_DIR/$f is missing (a DeepEP tree?)" >&2; exit 2; }
done

export NCCL_NVLS_ENABLE=0 NVSHMEM_DISABLE_NVLS=1 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export FERRY_DEEP_EP=1
# DeepEP's init_dist reads WORLD_SIZE as the number of nodes and RANK as this node: one node here
export WORLD_SIZE=1 RANK=0 MASTER_ADDR=127.0.0.1

# The switch and DeepEP's helpers, for every process the tests spawn (they inherit the environment).
SITE=$OUT_DIR/site
mkdir -p "$SITE"
cat > "$SITE/sitecustomize.py" <<EOF
# made by tools/dev/run-deepep-tests.sh: what ferry-deep-ep.pth does for a pip-installed ferry, and DeepEP's own test
# helpers found beside ferry.deep_ep.utils
import importlib.abc, importlib.util, os, sys
try:
    import _ferry_deep_ep
    _ferry_deep_ep.activate_from_env()
except ImportError as error:
    sys.stderr.write(f"run-deepep-tests: ferry is not importable ({error})\\n")

class _DeepEpHelpers(importlib.abc.MetaPathFinder):
    root = "$DEEPEP_DIR/deep_ep/utils"
    def find_spec(self, fullname, path=None, target=None):
        prefix = "ferry.deep_ep.utils."
        if not fullname.startswith(prefix) or "." in fullname[len(prefix):]:
            return None
        source = os.path.join(self.root, fullname[len(prefix):] + ".py")
        return importlib.util.spec_from_file_location(fullname, source) if os.path.isfile(source) else None

sys.meta_path.append(_DeepEpHelpers())  # last: Ferry's own modules (event, envs) come first
EOF
export PYTHONPATH=$SITE:$BUILD_DIR/python${PYTHONPATH:+:$PYTHONPATH}

"$PYTHON" - <<'EOF' || { echo "run-deepep-tests: the switch does not work here (above)" >&2; exit 1; }
import deep_ep, deep_ep.utils.math, deep_ep.utils.testing, torch
assert deep_ep.__name__ == "ferry.deep_ep", deep_ep.__name__
import ferry
print(f"run-deepep-tests: deep_ep -> {deep_ep.__name__} (ferry {ferry.__version__}), torch {torch.__version__}, "
      f"{torch.cuda.device_count()} GPU(s), cuda backend {ferry.cuda_available()}")
EOF

GPUS=$("$PYTHON" -c "import torch; print(torch.cuda.device_count())")
WORLDS=${FERRY_DEEPEP_WORLDS:-}
if [ -z "$WORLDS" ]; then
  WORLDS=1
  for n in 2 4 8; do [ "$GPUS" -ge "$n" ] && WORLDS="$WORLDS $n"; done
fi

ONLY=" ${FERRY_DEEPEP_ONLY:-intranode low_latency elastic overhead} "
chosen() { [[ $ONLY == *" $1 "* ]]; }

declare -a ROWS
port=29600
# run NAME DIR LOG-NAME COMMAND...: one program, its log, one row of the table
run() {
  local name=$1 dir=$2 log=$OUT_DIR/$3.log
  shift 3
  port=$((port + 7))
  local start=$SECONDS
  (cd "$dir" && MASTER_PORT=$port timeout -k 30 "$TIMEOUT" "$@") > "$log" 2>&1
  local rc=$?
  local status=pass
  [ $rc -eq 0 ] || status="FAIL (exit $rc$([ $rc -eq 124 ] && echo ', timed out'))"
  ROWS+=("$(printf '%-52s %-28s %5ss  %s' "$name" "$status" $((SECONDS - start)) "$log")")
  echo "run-deepep-tests: $name: $status"
}

for n in $WORLDS; do
  chosen intranode && run "legacy/test_intranode.py  world $n" "$DEEPEP_DIR/tests/legacy" "intranode-w$n" \
    "$PYTHON" test_intranode.py --num-processes "$n"
  chosen low_latency && run "legacy/test_low_latency.py world $n" "$DEEPEP_DIR/tests/legacy" "low_latency-w$n" \
    "$PYTHON" test_low_latency.py --num-processes "$n"
  chosen elastic && run "elastic/test_ep.py world $n (--skip-perf-test)" "$DEEPEP_DIR/tests/elastic" "elastic-w$n" \
    "$PYTHON" test_ep.py --num-processes "$n" --skip-perf-test
done
if [ "$GPUS" -ge 16 ]; then
  echo "run-deepep-tests: test_internode.py needs two launches (WORLD_SIZE=2 nodes) of 8 ranks: run it per node" \
       "as DeepEP documents, with FERRY_DEEP_EP=1 and PYTHONPATH=$PYTHONPATH" >&2
fi
ROWS+=("$(printf '%-52s %-28s' "legacy/test_internode.py" "skipped: 8 ranks per node, >1 node ($GPUS GPUs here)")")
for t in 1 128; do
  chosen overhead || break
  run "bench_deep_ep_overhead.py --tokens $t" "$REPO" "overhead-t$t" \
    "$PYTHON" -m ferry.launch --nproc 1 python/bench_deep_ep_overhead.py --tokens "$t"
done

{
  echo
  echo "DeepEP's tests through ferry.deep_ep ($DEEPEP_DIR; logs in $OUT_DIR):"
  printf '%s\n' "${ROWS[@]}"
  echo
  grep -h "overhead" "$OUT_DIR"/overhead-t*.log 2>/dev/null | sed 's/^/  /'
} | tee "$OUT_DIR/summary.txt"
grep -q "FAIL" "$OUT_DIR/summary.txt" && exit 1
exit 0
