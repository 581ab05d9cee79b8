#!/usr/bin/env bash
# The twenty-first session's forward A/B on one H200: the GPU tests (stream_linear, the model, graphs,
# kernels), bench/stream_sweep.py --sweep 3 on the 7B's down projection, then the graphed 1.5B forward
# of .wt/base (main before stream_linear) against this tree, interleaved, 3 rounds (bench/device_s20.sh),
# and the 2-layer draft's forward, one round each. JSON: $OUT/steps.json, $OUT/draft-steps.json,
# $OUT/stream-sweep.jsonl.
#   rm -rf .wt/base && mkdir -p .wt/base && git archive 9558099 $(git ls-tree --name-only 9558099 \
#     | grep -v '^drafts$\|^docs$') | tar -x -C .wt/base
#   bash bench/device_s21b.sh         # carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
gpu_tests "tests/test_skinny_linear.py tests/test_gpu_model.py tests/test_cuda_graphs.py tests/test_fused_kernels.py
  tests/test_rejection_greedy.py"
timeout 60 python3 bench/stream_sweep.py --sweep 3 --shapes down7b --rows 1 5 16 --out "$OUT/stream-sweep.jsonl" \
  2>&1 | cut -c1-150 | grep -v '"error"'
NO_TESTS=1 CFGS="base new" CONTEXTS="100 400" REPS=3 BUDGET=${BUDGET:-330} bash bench/device_s20.sh 2>&1 \
  | grep -v "^ctx.*: {"
mkdir -p /tmp/draft
for dir in .wt/base .; do
  name=$(basename "$dir"); [ "$name" = . ] && name=new
  (cd "$dir" && PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset draft2 --width 1 --batch 1 16 \
    --steps 20 --out "/tmp/draft/draft-$name.json" 2>&1 | grep '^{"' | cut -c1-140)
done
collect_steps /tmp/draft "$OUT/draft-steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
