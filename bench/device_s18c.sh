#!/usr/bin/env bash
# The eighteenth session's third call on one H200 (docs/benchmarks.md, "Eighteenth session"): the GPU tests
# on main's code, then the graphed 1.5B forward (bench/profile_step.py, B = 1, 4, 16, width 5) at
# $CONTEXTS keys already in the cache, and the base tree ($BASE, see bench/device_s18.sh) at its fixed
# context of 100 beside them, interleaved, $REPS rounds (the first with the per-kernel profile). Every
# run's JSON in $OUT/steps.json.
# That call ran on f81d03c (the attention split rule since reverted in 8c234a7); run on main, it measures
# main's rule at those contexts.
#   bash bench/device_s18c.sh         # run with carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
BASE=${BASE:-.wt/base}
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py tests/test_cuda_graphs.py \
  tests/test_gpu_model.py tests/test_skinny_linear.py tests/test_rejection_greedy.py tests/test_draft_chain.py \
  tests/test_draft_catch_up.py -k "not tp2" 2>&1 \
  | tail -30 > "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/s18c
for rep in $(seq 1 "${REPS:-2}"); do
  prof=""; [ "$rep" = 1 ] && prof=--profile
  for ctx in ${CONTEXTS:-100 400 1000 2000}; do
    python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 --context "$ctx" $prof \
      --out "/tmp/s18c/main-ctx$ctx-r$rep.json" 2>&1 | grep '^{"' | cut -c1-90 | sed "s/^/main ctx$ctx r$rep: /"
  done
  (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 \
    --steps 20 $prof --out "/tmp/s18c/base-ctx100-r$rep.json" 2>&1 | grep '^{"' | cut -c1-90 | sed "s/^/base r$rep: /")
  echo "elapsed $(( $(date +%s) - t0 )) s"
done
collect_steps /tmp/s18c "$OUT/steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
