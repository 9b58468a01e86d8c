#!/usr/bin/env bash
# Compiles the code that meets NCCL's device API against the NCCL headers of the newest nvidia-nccl-cu13 wheel on PyPI,
# with the build's flags: the gin transport (tests/build_check/gin_exchange.cu: an all-to-all kernel over Gin), its
# host setup (src/comm/cuda/gin_setup.cu), the cuda communicator (src/comm/cuda/cuda_communicator.cu), the
# hierarchical EP kernels instantiated over Gin with their backend (src/ep/cuda/hier/dispatch.cu, hier/combine.cu,
# src/ep/cuda/cuda_ep.cu), and rank masking's agreement and counter realignment over Gin (src/ep/cuda/ll/mask.cu). The
# normal build compiles them against the installed NCCL; this keeps the code honest for the NCCL clusters run
# (docs/gin.md, "Version guards"). The wheel's include folder is kept per version in BUILD/gin-headers/<version>/ (the
# wheel itself, ~300 MB, is deleted once unpacked), so a second run only asks PyPI which version is the newest.
#
# usage: scripts/check-gin-headers.sh [BUILD_DIR] [NVCC]
# exit status: 0 compiled, 1 a compile error (or a wheel without headers), 77 skipped (no nvcc; PyPI unreachable)
set -euo pipefail
SRC=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$SRC/build}
NVCC=${2:-}
PY=${PYTHON:-python3}
PACKAGE=nvidia-nccl-cu13

skip() { echo "check-gin-headers: SKIP: $*"; exit 77; }

# 1. the compiler (CI machines without the CUDA toolkit skip)
if [[ -z "$NVCC" ]]; then NVCC=$(command -v nvcc || true); fi
if [[ -z "$NVCC" && -x /usr/local/cuda/bin/nvcc ]]; then NVCC=/usr/local/cuda/bin/nvcc; fi
[[ -n "$NVCC" && -x "$NVCC" ]] || skip "no nvcc (install the CUDA toolkit, or pass its nvcc as the second argument)"
command -v "$PY" >/dev/null || skip "no $PY to run pip"

# 2. the newest version on PyPI (pip's index query; an unreachable PyPI is a skip, not a failure)
CACHE="$BUILD/gin-headers"
mkdir -p "$CACHE"
VERSION=$("$PY" -m pip index versions "$PACKAGE" --disable-pip-version-check --timeout 20 2>/dev/null |
  sed -n "s/^$PACKAGE (\([0-9.]*\)).*/\1/p" | head -n 1) || true
[[ -n "$VERSION" ]] || skip "PyPI did not answer which $PACKAGE is the newest (offline, or pip without 'pip index')"
INCLUDE="$CACHE/$VERSION/nvidia/nccl/include"

# 3. its headers, once per version
if [[ ! -f "$INCLUDE/nccl.h" ]]; then
  echo "check-gin-headers: downloading $PACKAGE==$VERSION from PyPI (headers only are kept)"
  WHEELS="$CACHE/wheel"
  rm -rf "$WHEELS" "$CACHE/$VERSION"
  "$PY" -m pip download --no-deps --no-cache-dir --disable-pip-version-check --timeout 60 --only-binary=:all: \
    -d "$WHEELS" "$PACKAGE==$VERSION" >"$CACHE/pip.log" 2>&1 || { tail -n 5 "$CACHE/pip.log"; skip "pip download failed"; }
  WHEEL=$(ls "$WHEELS"/*.whl | head -n 1)
  "$PY" -c 'import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as wheel:
    names = [n for n in wheel.namelist() if n.startswith("nvidia/nccl/include/")]
    if not names: sys.exit("the wheel has no nvidia/nccl/include/")
    wheel.extractall(sys.argv[2], names)' "$WHEEL" "$CACHE/$VERSION" || { echo "check-gin-headers: FAIL: $WHEEL"; exit 1; }
  rm -rf "$WHEELS"
fi
CODE=$(sed -n 's/^#define NCCL_VERSION_CODE \([0-9]*\).*/\1/p' "$INCLUDE/nccl.h")
echo "check-gin-headers: $PACKAGE $VERSION, NCCL_VERSION_CODE $CODE, headers $INCLUDE, $("$NVCC" --version | tail -n 1)"

# 4. the translation units, with the build's flags; the wheel's headers come before nvcc's own include folder
#    (which holds the toolkit's nccl.h), and FERRY_EXPECT_NCCL_VERSION_CODE makes the kernel's TU prove it.
#    NOTE: compiled for speed, not for running: with nvcc's --Ofast-compile=max, every TU still goes through the
#    front end, cicc and ptxas, in a sixth of the time or less (an nvcc without it: to PTX only, -arch=compute_90a
#    without ptxas and -G without cicc's optimiser); for sm_90a alone (nvcc 13's -arch=sm_90a also compiles for
#    compute_90: a second cicc and ptxas), and the host side checked by the host compiler's front end
#    (-fsyntax-only: no object is written). What newer headers can break (declarations, types, templates,
#    constants, inline PTX) is found so; the main build compiles the same sources against the installed headers.
NVCC_HELP=$("$NVCC" --help 2>/dev/null || true)
if [[ "$NVCC_HELP" == *--Ofast-compile* ]]; then
  SPEED=(--generate-code=arch=compute_90a,code=sm_90a --Ofast-compile=max -Xcompiler=-fsyntax-only)
else
  SPEED=(-arch=compute_90a -G)
fi
FLAGS=(-std=c++20 "${SPEED[@]}" --expt-relaxed-constexpr -DFERRY_HAVE_CUDA=1 -I"$SRC/include" -I"$SRC/src"
  -I"$INCLUDE" -DFERRY_EXPECT_NCCL_VERSION_CODE="$CODE")
TUS=(tests/build_check/gin_exchange.cu src/comm/cuda/gin_setup.cu src/comm/cuda/cuda_communicator.cu
  src/ep/cuda/hier/dispatch.cu src/ep/cuda/hier/combine.cu src/ep/cuda/cuda_ep.cu src/ep/cuda/ll/mask.cu)
for tu in "${TUS[@]}"; do
  if [[ ! -f "$SRC/$tu" ]]; then
    echo "check-gin-headers: FAIL: $tu does not exist (moved?); update this script's list"
    exit 1
  fi
done
# NOTE: the sources go through nvcc as one translation unit that #includes them (CACHE/unit.cu): they share most of
# their headers, which cost more than their own code (the seven one by one: about 115 CPU-s; as one unit: about 30).
# The main build compiles each source as its own unit, which keeps each one's includes complete.
UNIT="$CACHE/unit"
{
  echo "// made by scripts/check-gin-headers.sh"
  for tu in "${TUS[@]}"; do echo "#include \"$SRC/$tu\""; done
} >"$UNIT.cu"
start=$SECONDS
if "$NVCC" "${FLAGS[@]}" -c "$UNIT.cu" -o "$UNIT.o" >"$UNIT.log" 2>&1; then
  echo "check-gin-headers: OK   ${TUS[*]} against NCCL $VERSION ($((SECONDS - start)) s)"
else
  cat "$UNIT.log"
  echo "check-gin-headers: FAIL ${TUS[*]} against NCCL $VERSION"
  exit 1
fi
