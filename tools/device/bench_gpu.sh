#!/bin/bash
# On the lent H200, from the repo root: installs the carried MLX CUDA build (once per warm machine), lays out
# spec_cache as it installs (store/ and schemas/ at the repository root become spec_cache.store /
# spec_cache.schemas: a symlink farm in $SC, as pyproject's package-dir mapping does), then runs
# tools/device/bench_gpu.py. The MLX CUDA wheel (89 MB) is over the 64 MiB carry limit, so it travels as an
# xz tarball of its unpacked files split in two: part-00 in an earlier call (tools/device/stage_part.sh copies it
# to /tmp/parts), part-01 plus the small wheels in .whl/p2 with this call.
# Usage: bash tools/device/bench_gpu.sh [bench_gpu.py options: --sections limits,routes,gpu_8b,store_io ...]
#        bash tools/device/bench_gpu.sh --profile [profile_warm.py options]   (warm-path stage timings)
#        bash tools/device/bench_gpu.sh --setup-only                           (install, print the route, exit)
set -u
SITE=/tmp/site
SC=/tmp/sc-site
PARTS=/tmp/parts
SHA=2d73b14a61cbc10b9297b5f8695810470e143694f829fda6c1efd8ca0a41b475
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$PARTS" "$OUTDIR"
if [ ! -e "$SITE/mlx/lib/libmlx.so" ]; then
  cp .whl/p2/*.whl .whl/p2/mlxcuda.tar.xz.part-* "$PARTS"/ || exit 1
  cat "$PARTS"/mlxcuda.tar.xz.part-* > /tmp/mlxcuda.tar.xz || exit 1
  echo "$SHA  /tmp/mlxcuda.tar.xz" | sha256sum -c - || exit 1
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$PARTS"/*.whl || exit 1
  tar xJf /tmp/mlxcuda.tar.xz -C "$SITE" || exit 1
  # libmlx.so finds the CUDA libraries at $ORIGIN/../../nvidia/...: point that at the image's nvidia packages
  NV=$(python3 -c "import nvidia; print(list(nvidia.__path__)[0])") || exit 1
  ln -sfn "$NV" "$SITE/nvidia"
fi
ldd "$SITE/mlx/lib/libmlx.so" | grep "not found" && echo "WARNING: libraries not found"

farm() {  # $1: a source tree holding spec_cache/, store/, schemas/
  rm -rf "$SC" && mkdir -p "$SC/spec_cache" || return 1
  for e in "$1"/spec_cache/*; do ln -s "$(readlink -f "$e")" "$SC/spec_cache/"; done
  ln -sfn "$(readlink -f "$1/store")" "$SC/spec_cache/store"
  ln -sfn "$(readlink -f "$1/schemas")" "$SC/spec_cache/schemas"
}
export PYTHONPATH=$SITE:$SC PYTHONUNBUFFERED=1
export SPEC_CACHE_GIT="$(cat .whl/p2/GIT_STATE 2>/dev/null)"
if [ "${SPEC_CACHE_BENCH_TREE:-}" = head ]; then  # measure the committed snapshot, not others' edits in progress
  farm "$PWD/.whl/p2/src" || exit 1
  export SPEC_CACHE_GIT="HEAD snapshot (asked): $SPEC_CACHE_GIT"
else
  farm "$PWD" || exit 1
fi
if ! python3 -P -c "import spec_cache.generator, spec_cache.cache, spec_cache.testing.tiny, spec_cache.apps.bench.ttft, spec_cache.apps.bench.store_io, spec_cache.store, spec_cache.device_copy"; then
  # another session may be mid-edit in the working tree: fall back to the committed snapshot carried in .whl/p2/src
  echo "working tree does not import: using the HEAD snapshot"
  farm "$PWD/.whl/p2/src" || exit 1
  export SPEC_CACHE_GIT="HEAD snapshot only: $SPEC_CACHE_GIT"
fi
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device()); print(mx.sum(mx.ones((1024, 1024))).item())" || exit 1
python3 -P -c "from spec_cache import device_copy; print('copy route:', device_copy.status()); print('capture route:', device_copy.capture_status())"
python3 -m pip list 2>/dev/null | grep -iE "^(mlx|transformers|tokenizers|lmdb|blake3|xxhash|msgpack|safetensors|numpy|tqdm) "
df -h /tmp /dev/shm | tail -2; free -g | head -2
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
if [ "${1:-}" = "--setup-only" ]; then
  exit 0
elif [ "${1:-}" = "--profile" ]; then
  shift
  python3 tools/device/profile_warm.py "$@" 2>&1 | tee "$OUTDIR/profile-warm.log"
else
  python3 tools/device/bench_gpu.py --out "$OUTDIR/bench-gpu.json" "$@" 2>&1 | tee "$OUTDIR/bench-gpu.log"
fi
