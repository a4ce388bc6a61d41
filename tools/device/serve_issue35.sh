#!/bin/bash
# Issue 35's serving figures on a lent GPU, one call per part, into $OUT (at most 8 files come back):
#
#   call 0 (fresh machine, carry .gpu/p1):         mkdir -p /tmp/parts && cp .gpu/p1/* /tmp/parts/
#   call 0b (carry .gpu/p3):                       mkdir -p /tmp/p3 && cp .gpu/p3/* /tmp/p3/
#   call 1 (carry .gpu/p2 .gpu/serve):             ln -sfn /tmp/p3 .gpu/p3 && PART=chat bash tools/device/serve_issue35.sh
#   call 2 (same warm machine, no carry needed):   PART=agent bash tools/device/serve_issue35.sh
#   (PART=agent on a fresh machine carries .gpu/p2 .gpu/serve as call 1 does and installs first)
# (p1 and p3 together with the tree passed 64 MiB on 2026-12-07: a call carries at most 64 MiB in all.)
# To measure exactly one commit while the working tree moves (helpers' edits travel with it), carry the commit as
# a tarball: `git archive <commit> | gzip > .gpu/src/tree.tgz` here, carry .gpu/src too in call 1, and run
#   rm -rf /tmp/src && mkdir -p /tmp/src && tar xzf .gpu/src/tree.tgz -C /tmp/src && cp -r .gpu /tmp/src/ &&
#   cd /tmp/src && PART=chat ... bash tools/device/serve_issue35.sh
# (call 2: `cd /tmp/src && PART=agent ...`). The machine stays warm ~30 s after a call: chain the calls at once.
#
# PART=chat: the tool's defaults (1500-word system prompt, 150-word turns; 8 conversations x 3 turns, 32-token greedy
# replies, --warmup shapes) on the 8B-shaped bf16 llama with SmolLM2's tokenizer (tools/device/serve_8b_model.py),
# mlx_lm.server then serve (then the launcher while time is left) at CLIENTS (default "4"; "1 4 8" resumes over
# calls), with serve's scheduler trace and py-spy on serve's process (where its threads wait: GIL, device, LMDB).
# PART=agent: tools/bench_serve.py --workload agent at CLIENTS (default 2) on the same model, sized in SmolLM2's
# tokens as the issue states the workload (its w<N> words are ~3.7 tokens each there): 2200 system words = ~8.1k
# tokens, tool results of 80-400 words = ~300-1500 tokens, user lines of 3-6 words.
# Files back: serve-8b.json / agent-c<N>.json, run.log, serve-pyspy.txt, the largest scheduler trace, every serve
# process's trace (traces.tgz), the tail of serve's log, the kernels compiled during the call (ptx-compiles.txt:
# `python tools/diag/trace_summary.py traces.tgz --compiles ptx-compiles.txt` names them beside the slow steps). MLXLM_CACHE_BYTES=N (agent): mlx_lm.server's
# --prompt-cache-bytes (at 4 agent clients on an 80 GB H100 its prompt cache ran it out of device memory).
# LAYER_TIMES=1 (a diagnostic run, not figures): serve writes per-layer times of its multi-token forwards
# (spec_cache/rows/layer_times.py) into traces.tgz as layers.<pid>.jsonl: the agent's slow sixth turn.
# PART=probe (~1-2 min on a machine that has the install and the model, else it installs them first): the attention
# probe (tools/device/attention_probe.py): sdpa alone at the 8B shape, causal vs array masks, a new shape's first
# call vs repeats, and whole forwards over a 12k-token row with the runtime's mask vs the array mask forced; probe.json.
# On the CPU (a check of the script): INSTALL=0 PY=.venv/bin/python LAYERS=2 HIDDEN=64 HEADS=4 KV_HEADS=2 HEAD_DIM=16
#   INTER=128 OUT=/tmp/p35 WORK=/tmp/p35w PART=probe PROBE_ARGS="--contexts 64 --chunks 4,16 --repeats 1 --heads 4
#   --kv-heads 2 --head-dim 16 --prefix 100 --step 32" bash tools/device/serve_issue35.sh
# Env as in serve_8b_shaped.sh (DEADLINE, SERVERS, ...).
set -u
PART=${PART:-chat}
FINAL=${OUT:-/tmp/out}
WORKOUT=/tmp/issue35-out
mkdir -p "$FINAL" "$WORKOUT"
# the kernels MLX's CUDA backend compiles during this call (NVRTC output cached on disk; a later process on this
# machine loads them): ptx-compiles.txt, read beside the traces by tools/diag/trace_summary.py --compiles
MARK=$WORKOUT/.call-began.$$; touch "$MARK"
compiles() {
  find "${MLX_PTX_CACHE_DIR:-${TMPDIR:-/tmp}/mlx}" -type f -newer "$MARK" -printf '%T@ %s %p\n' 2>/dev/null | sort -n \
    > "$FINAL/ptx-compiles.txt"
}
[ "${LAYER_TIMES:-0}" = 1 ] && export SPEC_CACHE_LAYER_TIMES=$WORKOUT/layers
if [ "$PART" = probe ]; then
  PY=${PY:-python3}
  SITE=${SITE:-/tmp/site}
  export PYTHONPATH=$SITE:${WORK:-/tmp/serve-8b}/sc-site PYTHONUNBUFFERED=1
  if [ ! -e ${WORK:-/tmp/serve-8b}/model/config.json ]; then
    SETUP_ONLY=1 OUT=$WORKOUT bash tools/device/serve_8b_shaped.sh || exit 3
  fi
  timeout "${DEADLINE:-300}" $PY tools/device/attention_probe.py --model ${WORK:-/tmp/serve-8b}/model \
    --json "$FINAL/probe.json" ${PROBE_ARGS:-} 2>&1 | tee "$FINAL/probe.log"
  compiles
  exit 0
fi
if [ "$PART" = chat ]; then
  CLIENTS=${CLIENTS:-4} SERVERS=${SERVERS:-mlx-lm,serve,spec-cache} CONV=${CONV:-8} TURNS=${TURNS:-3} \
    SYSW=${SYSW:-1500} USERW=${USERW:-150} MAXTOK=${MAXTOK:-32} TRACE=1 PYSPY=${PYSPY:-300} \
    DEADLINE=${DEADLINE:-540} OUT=$WORKOUT bash tools/device/serve_8b_shaped.sh
  cp "$WORKOUT/serve-8b.json" "$WORKOUT/run.log" "$FINAL/" 2>/dev/null
else
  PY=${PY:-python3}
  SITE=${SITE:-/tmp/site}
  export PYTHONPATH=$SITE:${WORK:-/tmp/serve-8b}/sc-site PYTHONUNBUFFERED=1 SPEC_CACHE_SCHED_TRACE=$WORKOUT/trace
  if [ ! -e ${WORK:-/tmp/serve-8b}/model/config.json ]; then  # a fresh machine: the install and the model first
    SETUP_ONLY=1 OUT=$WORKOUT bash tools/device/serve_8b_shaped.sh || exit 3
  fi
  # the agent's prompts reach ~17k tokens: the random-weight model's context (8192) is raised in its config
  $PY -c "import json, sys; p = sys.argv[1]; c = json.load(open(p)); c['max_position_embeddings'] = 32768; \
json.dump(c, open(p, 'w'))" "${WORK:-/tmp/serve-8b}/model/config.json" || exit 1
  (for _ in $(seq 1 900); do
     pid=$(pgrep -f "spec_cache.apps.server --model" | head -1); [ -n "$pid" ] && break; sleep 1
   done
   [ -n "$pid" ] && "$SITE/bin/py-spy" record -p "$pid" -f raw -o "$WORKOUT/serve-pyspy.txt" -d "${PYSPY:-240}" \
     -r 50 --threads --idle --nonblocking > "$WORKOUT/pyspy.log" 2>&1) > /dev/null 2>&1 &
  SPY=$!
  C=${CLIENTS:-2}
  timeout "${DEADLINE:-540}" $PY tools/bench_serve.py --workload agent --model ${WORK:-/tmp/serve-8b}/model \
    --cwd ${WORK:-/tmp/serve-8b}/sc-site --servers "${SERVERS:-mlx-lm,serve}" --sessions "${SESSIONS:-$C}" --clients "$C" \
    --system-words "${SYSW:-2200}" --tool-result-words "${TOOLW:-80-400}" --user-words "${USERW:-3-6}" \
    --warmup shapes --serve-arg=--warmup --serve-arg=on \
    ${MLXLM_CACHE_BYTES:+--mlx-lm-arg=--prompt-cache-bytes --mlx-lm-arg=$MLXLM_CACHE_BYTES} \
    --json "$FINAL/agent-c$C.json" 2>&1 | tee "$WORKOUT/run.log"
  cp "$WORKOUT/run.log" "$FINAL/agent-run.log"
  sleep 2; kill "$SPY" 2>/dev/null
fi
cp "$WORKOUT/serve-pyspy.txt" "$FINAL/" 2>/dev/null
largest=$(ls -S "$WORKOUT"/trace.*.jsonl 2>/dev/null | head -1)
[ -n "$largest" ] && cp "$largest" "$FINAL/serve-trace.jsonl"
# every serve process's trace (each client count's turns and its restart, in start order: the restart's restores
# come from LMDB, issue 39's path), one file: at most 8 files come back
(cd "$WORKOUT" && ls -tr trace.*.jsonl 2>/dev/null > trace-order.txt && tar czf "$FINAL/traces.tgz" trace-order.txt \
  trace.*.jsonl $(ls layers.*.jsonl 2>/dev/null) 2>/dev/null)
log=$(ls "$WORKOUT"/logs/*serve* 2>/dev/null | head -1)
[ -n "$log" ] && tail -c 16000 "$log" > "$FINAL/serve-log-tail.txt"
compiles
ls -la "$FINAL"
