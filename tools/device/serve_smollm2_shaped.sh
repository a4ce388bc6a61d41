#!/bin/bash
# Issue 27 on the lent H200: does `spec-cache serve` decode as fast as mlx_lm.server after the pipelined plain
# decode? A SmolLM2-135M-shaped 4-bit llama with random weights (tools/bench_decode.py's synthetic_smollm2) and
# SmolLM2's real tokenizer files, then tools/device/serve_decode.py (tools/bench_serve.py's workload and table,
# plus each request's decode rate) for each client count, within one deadline.
#
# Two calls to one warm machine (the MLX CUDA wheel is over the 64 MiB carry limit, so it travels in two parts):
#   1. carry .gpu/p1:  mkdir -p /tmp/parts && cp .gpu/p1/* /tmp/parts/
#   2. carry .gpu/p2 .gpu/p3 .gpu/serve:  bash tools/device/serve_smollm2_shaped.sh
# .gpu/p1: mlxcuda.whl.part-00 of mlx-cuda-13==0.32.4 (split -b 44m -d); .gpu/p2: part-01 plus the cp312 wheels of
# mlx 0.32.4, mlx-lm 0.32.2, lmdb, blake3, xxhash, msgpack; .gpu/p3: starlette, uvicorn, prometheus-client, redis,
# gguf and their pure-Python dependencies; .gpu/serve/tok: tokenizer.json, tokenizer_config.json,
# generation_config.json as `spec-cache convert-gguf` writes them for SmolLM2-135M-Instruct.
# On the CPU, to check the script: INSTALL=0 PY=.venv/bin/python bash tools/device/serve_smollm2_shaped.sh
# Env: SERVERS (mlx-lm,serve; add spec-cache for the launcher),
#      CLIENTS ("1 4"), CONV (4), TURNS (3), MAXTOK (128), SYSW (300), USERW (50), DEADLINE (520 s from the start),
#      TOK (.gpu/serve/tok), OUT (where the JSON goes, default /tmp/out).
set -u
START=$(date +%s)
PY=${PY:-python3}
SC=/tmp/sc-site
OUTDIR=${OUT:-/tmp/out}
TOK=${TOK:-.gpu/serve/tok}
mkdir -p "$OUTDIR"
. tools/device/site.sh
install_site || exit $?
farm "$PWD" || exit 1
$PY -c "import mlx.core as mx, mlx_lm, sys; print('python', sys.version.split()[0], 'mlx', mx.__version__,
mx.default_device(), 'mlx_lm', mlx_lm.__version__)" || exit 1
echo "tree: $(git rev-parse --short HEAD 2>/dev/null) $(git status --short -- spec_cache store schemas 2>/dev/null \
  | wc -l) changed files under spec_cache/ store/ schemas/"

M=/tmp/smollm2-shaped-serve/smollm2-shaped-4bit
if [ ! -e $M/model.safetensors ]; then
  $PY -P - "$TOK" <<'PY' || exit 1
import json, shutil, sys
from pathlib import Path
sys.path.insert(0, "tools")  # -P: the checkout's spec_cache (no store/ inside) is not on the path
from bench_decode import synthetic_smollm2
m = synthetic_smollm2(Path("/tmp/smollm2-shaped-serve"))
tok = Path(sys.argv[1])
for f in m.iterdir():  # the tiny WordLevel tokenizer goes; SmolLM2's tokenizer and chat template come
    if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "generation_config")):
        f.unlink()
for f in tok.iterdir():
    shutil.copy(f, m / f.name)
c = json.loads((m / "config.json").read_text())
c.update(bos_token_id=1, eos_token_id=2, pad_token_id=2)
(m / "config.json").write_text(json.dumps(c, indent=1))
print("model ready:", sorted(p.name for p in m.iterdir()))
PY
fi
echo "setup took $(( $(date +%s) - START )) s"
for C in ${CLIENTS:-1 4}; do
  LEFT=$(( ${DEADLINE:-520} - ($(date +%s) - START) ))
  if [ $LEFT -lt 40 ]; then echo "== clients $C: skipped, $LEFT s left"; continue; fi
  echo "== clients $C ($LEFT s left)"
  timeout $LEFT $PY tools/device/serve_decode.py --cwd $SC --model $M --servers ${SERVERS:-mlx-lm,serve} \
    --conversations ${CONV:-4} --turns ${TURNS:-3} --clients $C --max-tokens ${MAXTOK:-128} \
    --system-words ${SYSW:-300} --user-words ${USERW:-50} \
    --json "$OUTDIR/serve-c$C.json" 2>&1 | tail -30
done
echo "total $(( $(date +%s) - START )) s"
