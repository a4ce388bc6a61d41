#!/bin/bash
# On the lent H200, from the repo root: installs the carried MLX CUDA build (once per warm machine), lays out
# spec_cache as it installs (store/ and schemas/ at the repository root become spec_cache.store /
# spec_cache.schemas: a symlink farm in $SC, as pyproject's package-dir mapping does), then runs
# tools/device/bench_gpu.py within DEADLINE seconds of this script's start, JSON and log in $OUT.
#
# Two calls to one warm machine (the MLX CUDA wheel is over the 64 MiB carry limit, so it travels in two parts;
# the same staging as tools/device/serve_smollm2_shaped.sh):
#   1. carry .gpu/p1:  mkdir -p /tmp/parts && cp .gpu/p1/* /tmp/parts/
#   2. carry .gpu/p2:  DEADLINE=530 bash tools/device/bench_gpu.sh --sections gpu_8b
# .gpu/p1: mlxcuda.whl.part-00 of mlx-cuda-13==0.32.4 (split -b 44m -d); .gpu/p2: part-01 plus the cp312 wheels of
# mlx 0.32.4, mlx-lm 0.32.2, lmdb, blake3, xxhash, msgpack; .gpu/p3 (optional: installed when carried) the server's
# wheels. .gpu/src (optional, carried): a `git archive HEAD` snapshot measured instead of the working tree with
# SPEC_CACHE_BENCH_TREE=head, and the fallback when the working tree does not import.
# On the CPU, to check the script: INSTALL=0 PY=.venv/bin/python SC=$(mktemp -d) OUT=$(mktemp -d) \
#   bash tools/device/bench_gpu.sh --sections gpu_8b --dims tiny --lengths 256,512 --first-write-at 256
# Usage: bash tools/device/bench_gpu.sh [bench_gpu.py options: --sections limits,routes,gpu_8b,store_io ...]
#        bash tools/device/bench_gpu.sh --profile [profile_warm.py options]   (warm-path stage timings)
#        bash tools/device/bench_gpu.sh --setup-only                           (install, print the route, exit)
# Env: DEADLINE (530 s from this script's start: the driver gets what setup leaves, less 15 s, and is stopped by
#      SIGTERM 5 s before the end; its JSON is rewritten after each step), OUT (/tmp/out), INSTALL (1), PY
#      (python3), SC (/tmp/sc-site), SPEC_CACHE_BENCH_TREE (head: measure .gpu/src).
set -u
START=$(date +%s)
PY=${PY:-python3}
SC=${SC:-/tmp/sc-site}
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
. tools/device/site.sh  # install_site, farm
install_site || exit $?
if [ "${INSTALL:-1}" = 1 ]; then
  ldd "$SITE/mlx/lib/libmlx.so" | grep "not found" && echo "WARNING: libraries not found"
fi
tree_id() {  # what was measured: HEAD (where the copy has git) and a digest of the library's sources
  local sum
  sum=$(cd "$1" && find spec_cache store schemas -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
  echo "$(git rev-parse --short HEAD 2>/dev/null || echo no-git) sources-sha256:$sum"
}
IMPORTS="import spec_cache.decode.generator, spec_cache.tiers.cache, spec_cache.apps.bench.ttft, spec_cache.store, spec_cache.state.device_copy"
if [ "${SPEC_CACHE_BENCH_TREE:-}" = head ] && [ -d .gpu/src ]; then  # the committed snapshot, not edits in progress
  farm "$PWD/.gpu/src" || exit 1
  export SPEC_CACHE_GIT="HEAD snapshot (asked): $(tree_id .gpu/src)"
else
  farm "$PWD" || exit 1
  export SPEC_CACHE_GIT="working tree: $(tree_id .)"
  if ! $PY -P -c "$IMPORTS"; then
    if [ ! -d .gpu/src ]; then echo "the working tree does not import and no .gpu/src was carried"; exit 1; fi
    echo "working tree does not import: using the HEAD snapshot .gpu/src"
    farm "$PWD/.gpu/src" || exit 1
    export SPEC_CACHE_GIT="HEAD snapshot only: $(tree_id .gpu/src)"
  fi
fi
echo "tree: $SPEC_CACHE_GIT"
$PY -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device()); print(mx.sum(mx.ones((1024, 1024))).item())" || exit 1
$PY -P -c "from spec_cache.state import device_copy; print('copy route:', device_copy.status()); print('capture route:', device_copy.capture_status())"
if [ "${INSTALL:-1}" = 1 ]; then
  df -h /tmp /dev/shm | tail -2; free -g | head -2
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
fi
LEFT=$(( ${DEADLINE:-530} - ($(date +%s) - START) ))
echo "setup took $(( $(date +%s) - START )) s; $LEFT s left"
if [ $LEFT -lt 40 ]; then echo "only $LEFT s left of DEADLINE=${DEADLINE:-530}: not starting"; exit 1; fi
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
elif [ "${1:-}" = "--profile" ]; then
  shift
  timeout -k 5 $(( LEFT - 5 )) $PY tools/device/profile_warm.py "$@" 2>&1 | tee "$OUTDIR/profile-warm.log"
else
  # the driver skips a step that would not fit in --deadline; SIGTERM (timeout) makes it save its JSON and exit
  timeout -k 10 $(( LEFT - 5 )) $PY tools/device/bench_gpu.py --out "$OUTDIR/bench-gpu.json" \
    --deadline $(( LEFT - 15 )) "$@" 2>&1 | tee "$OUTDIR/bench-gpu.log"
  echo "driver exit ${PIPESTATUS[0]}; total $(( $(date +%s) - START )) s"
fi
