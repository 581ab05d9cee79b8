#!/usr/bin/env bash
# The eighteenth session's forward A/B on one H200 (docs/benchmarks.md, "Eighteenth session"): the GPU
# tests of the kernels and the model, then the graphed 1.5B forward (bench/profile_step.py) of this tree
# against a base tree ($BASE, default .wt/base: `git archive <base commit>` of everything but drafts/ and
# docs/, carried), interleaved, $REPS rounds (the first with the per-kernel profile); every run's JSON in
# $OUT/steps.json. $CONTEXTS (keys in the cache, default 100) and $BATCHES (default 1 4 16) widen it.
#   mkdir -p .wt/base && git archive d06031b $(git ls-tree --name-only d06031b | grep -v '^drafts$\|^docs$') \
#     | tar -x -C .wt/base
#   bash bench/device_s18.sh          # run with carry [".whl", ".wt/base"]
#   REPS=3 CONTEXTS="100 400 1000" BATCHES="1 4 16 64" bash bench/device_s18.sh   # nineteenth session
set -uo pipefail
source bench/device_env.sh
BASE=${BASE:-.wt/base}
t0=$(date +%s)
[ -n "${NO_TESTS:-}" ] || gpu_tests "tests/test_fused_kernels.py tests/test_cuda_graphs.py tests/test_gpu_model.py
  tests/test_skinny_linear.py"
mkdir -p /tmp/s18
for rep in $(seq 1 "${REPS:-2}"); do
  prof=""; [ "$rep" = 1 ] && prof=--profile
  for ctx in ${CONTEXTS:-100}; do
    for tree in new base; do
      dir=$PWD; [ "$tree" = base ] && dir=$BASE
      name=$tree-r$rep; [ "${CONTEXTS:-100}" = 100 ] || name=ctx$ctx-$name
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/profile_step.py --preset qwen1.5b \
        --batch ${BATCHES:-1 4 16} --steps 20 --context "$ctx" $prof --out "/tmp/s18/$name.json" 2>&1 \
        | grep '^{"' | cut -c1-140 | sed "s/^/$name: /")
      echo "elapsed $(( $(date +%s) - t0 )) s"
    done
  done
done
collect_steps /tmp/s18 "$OUT/steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
