#!/usr/bin/env bash
# The twenty-second session's forward A/B on one H200: the GPU tests of the kernels and the model, then the
# graphed 1.5B forward (bench/profile_step.py) in configurations run interleaved, $REPS rounds (the first
# with the per-kernel profile), every run's JSON in $OUT/steps.json. A configuration is NAME=DIR[,VAR=VALUE...]:
#   base=.wt/base        main at the session's start (14aaa22, carried)
#   new=.                this tree
#   name=.,VAR=VALUE     this tree with an environment switch (calls 1-2 used switches of trees since
#                        reverted: SPECSPLIT_ATTENTION_BLOCK_N/_STAGES/_WARPS, SPECSPLIT_SKIP; docs/benchmarks.md)
# Runs stop being started after $BUDGET seconds (default 480). $TESTS overrides the GPU test files.
#   rm -rf .wt/base && mkdir -p .wt/base && git archive 14aaa22 $(git ls-tree --name-only 14aaa22 \
#     | grep -v '^drafts$\|^docs$') | tar -x -C .wt/base
#   bash bench/device_s22.sh            # carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
[ -n "${NO_TESTS:-}" ] || gpu_tests "tests/test_skinny_linear.py tests/test_fused_kernels.py tests/test_gpu_model.py
  tests/test_cuda_graphs.py"
mkdir -p /tmp/s22
for rep in $(seq 1 "${REPS:-3}"); do
  prof=""; [ "$rep" = 1 ] && prof=--profile
  for ctx in ${CONTEXTS:-100}; do
    for cfg in ${CFGS:-base=.wt/base new=.}; do
      if [ $(( $(date +%s) - t0 )) -gt "${BUDGET:-480}" ]; then echo "budget spent: skip $cfg ctx$ctx r$rep"; continue; fi
      name=${cfg%%=*}; spec=${cfg#*=}; dir=${spec%%,*}; envs=""
      [ "$spec" != "$dir" ] && envs=$(echo "${spec#*,}" | tr ',' ' ')
      run=ctx$ctx-$name-r$rep
      (cd "$dir" && env $envs PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset ${PRESET:-qwen1.5b} \
        --batch ${BATCHES:-1 4 16 64} --steps 20 --context "$ctx" $prof --out "/tmp/s22/$run.json" 2>&1 \
        | grep '^{"\|Error' | cut -c1-140 | sed "s/^/$run: /")
      echo "elapsed $(( $(date +%s) - t0 )) s"
    done
  done
done
collect_steps /tmp/s22 "$OUT/steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
