#!/bin/bash
# Issue 27's GPU serving bench on the lent H200: mlx_lm.server vs `spec-cache serve` vs the launcher
# (`spec-cache mlx-lm-server`) on a Llama-3-8B-shaped bf16 llama (random weights, tools/device/serve_8b_model.py)
# carrying SmolLM2's tokenizer and chat template, at 1, 4 and 8 clients (tools/device/serve_8b_bench.py, which runs
# tools/bench_serve.py's workload one server at a time), into $OUT/serve-8b.json.
#
# Calls to one warm machine, back to back (it is released after ~30 s idle; /tmp survives while it is held):
#   1. carry .gpu/p1:                      mkdir -p /tmp/parts && cp .gpu/p1/* /tmp/parts/
#   2. carry .gpu/p2 .gpu/p3 .gpu/serve:   bash tools/device/serve_8b_shaped.sh
#   3. (no carry) the same command again:  bash tools/device/serve_8b_shaped.sh
# Each call installs what is missing, writes the model if it is not there, then measures the units (one server at
# one client count) not yet finished, in order, until DEADLINE; the JSON holds every unit finished so far.
# .gpu/ as in serve_smollm2_shaped.sh (p1: part 00 of the mlx-cuda-13 0.32.4 wheel; p2: part 01 + cp312 wheels;
# p3: the server's pure-Python wheels; serve/tok: SmolLM2-135M-Instruct's tokenizer files).
# On the CPU, to check the script (tiny shape, tiny workload):
#   INSTALL=0 PY=.venv/bin/python LAYERS=2 HIDDEN=64 HEADS=4 KV_HEADS=2 HEAD_DIM=16 INTER=128 CONV=1 TURNS=2 \
#     MAXTOK=4 SYSW=20 USERW=5 SERVE_ARGS="--warmup off" WORK=/tmp/serve-8b-cpu OUT=/tmp/serve-8b-cpu/out \
#     bash tools/device/serve_8b_shaped.sh
# Env: TRACE (1: serve's scheduler trace), PYSPY (seconds of py-spy on serve), CLIENTS ("1 4 8"), SERVERS (mlx-lm,serve,spec-cache), CONV (4; at least the clients), TURNS (3),
#      SYSW (300), USERW (50), MAXTOK (48), WARMUP (shapes), SERVE_ARGS ("--warmup on"), LAUNCHER_ARGS (""),
#      DEADLINE (540 s from this script's start), MIN_UNIT (60 s), FRESH (1: forget earlier calls' units),
#      RESUME_FROM (an earlier call's serve-8b.json, carried in: on a fresh machine its finished units count),
#      WORK (/tmp/serve-8b: model, state, stores, logs), TOK (.gpu/serve/tok), OUT (/tmp/out), and the model shape
#      (LAYERS HIDDEN HEADS KV_HEADS HEAD_DIM INTER VOCAB DTYPE; serve_8b_model.py).
set -u
START=$(date +%s)
PY=${PY:-python3}
OUTDIR=${OUT:-/tmp/out}
TOK=${TOK:-.gpu/serve/tok}
WORK=${WORK:-/tmp/serve-8b}
SC=$WORK/sc-site  # this run's own (it is rebuilt each call)
DEADLINE=${DEADLINE:-540}
mkdir -p "$OUTDIR" "$WORK"
. tools/device/site.sh
install_site || exit $?
farm "$PWD" || exit 1
$PY -c "import mlx.core as mx, mlx_lm, sys; print('python', sys.version.split()[0], 'mlx', mx.__version__,
mx.default_device(), 'mlx_lm', mlx_lm.__version__)" || exit 1
$PY tools/device/check_ranged_copy.py || exit 1  # checkpoints copy only what the store lacks: bytes checked first
echo "tree: $(git rev-parse --short HEAD 2>/dev/null) $(git status --short -- spec_cache store schemas 2>/dev/null \
  | wc -l) changed files under spec_cache/ store/ schemas/"
$PY tools/device/serve_8b_model.py --tok "$TOK" --out "$WORK/model" || exit 1
echo "setup took $(( $(date +%s) - START )) s"
[ "${SETUP_ONLY:-0}" = 1 ] && exit 0  # the install and the model alone (serve_issue35.sh PART=agent on a fresh machine)
LEFT=$(( DEADLINE - ($(date +%s) - START) ))
FRESH_FLAG=""; [ "${FRESH:-0}" = 1 ] && FRESH_FLAG=--fresh
[ -n "${RESUME_FROM:-}" ] && FRESH_FLAG="$FRESH_FLAG --resume-from=$RESUME_FROM"
# TRACE=1: serve's scheduler trace into $OUT (trace.<pid>.jsonl); PYSPY=N: py-spy samples the first serve process
# (its threads, idle ones too: a thread waiting for the GIL or the device shows where it waits) for N seconds from
# its start, into $OUT/serve-pyspy.txt (collapsed stacks; py-spy from .gpu/p3)
[ "${TRACE:-0}" = 1 ] && export SPEC_CACHE_SCHED_TRACE="$OUTDIR/trace"
if [ "${PYSPY:-0}" != 0 ]; then
  (for _ in $(seq 1 900); do
     pid=$(pgrep -f "spec_cache.apps.server --model" | head -1); [ -n "$pid" ] && break; sleep 1
   done
   [ -n "$pid" ] && "$SITE/bin/py-spy" record -p "$pid" -f raw -o "$OUTDIR/serve-pyspy.txt" -d "$PYSPY" -r 50 \
     --threads --idle --nonblocking > "$OUTDIR/pyspy.log" 2>&1) > /dev/null 2>&1 &
fi
timeout $(( LEFT + 30 )) $PY tools/device/serve_8b_bench.py --cwd $SC --model "$WORK/model" --work "$WORK/work" \
  --json "$OUTDIR/serve-8b.json" --deadline-at $(( START + DEADLINE )) --min-unit-s ${MIN_UNIT:-60} \
  --clients "${CLIENTS:-1 4 8}" --servers "${SERVERS:-mlx-lm,serve,spec-cache}" --conversations ${CONV:-4} \
  --turns ${TURNS:-3} --system-words ${SYSW:-300} --user-words ${USERW:-50} --max-tokens ${MAXTOK:-48} \
  --warmup ${WARMUP:-shapes} --serve-args="${SERVE_ARGS:---warmup on}" --launcher-args="${LAUNCHER_ARGS:-}" \
  $FRESH_FLAG 2>&1 | tee "$OUTDIR/run.log"  # streamed: a call killed at 600 s still shows what ran
# each server's log, the last 20 kB (server errors, serve's warm-up time)
mkdir -p "$OUTDIR/logs"
for f in "$WORK"/work/c*/*.log; do
  [ -e "$f" ] && tail -c 20000 "$f" > "$OUTDIR/logs/$(basename "$(dirname "$f")")-$(basename "$f")"
done
df -h /tmp | tail -1
echo "total $(( $(date +%s) - START )) s"
