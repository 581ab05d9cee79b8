#!/usr/bin/env bash
# The twentieth session's forward A/B on one H200 (docs/benchmarks.md, "Twentieth session"): the GPU tests
# of the kernels and the model, then the graphed 1.5B forward (bench/profile_step.py) in configurations
# run interleaved, $REPS rounds (the first with the per-kernel profile), every run's JSON in
# $OUT/steps.json:
#   base   the base tree ($BASE, default .wt/base: `git archive a9592b6` of everything but drafts/ and
#          docs/, carried): split combine kernel, fp32 logits
#   fp32   this tree with --fp32-logits (the fp32 copy of the logits, as the base)
#   new    this tree: the logits in bf16 as the target's step now computes them
# $CFGS picks some of them. Runs stop being started after $BUDGET seconds (default 520). Call 1 ran a
# since-reverted tree (the attention folding its own splits) whose runs are named `fold` (= fp32 here)
# and `foldN` (every split folded; its knob went with it) in docs/results/issue11/s20/call1-steps.json.
#   mkdir -p .wt/base && git archive a9592b6 $(git ls-tree --name-only a9592b6 | grep -v '^drafts$\|^docs$') \
#     | tar -x -C .wt/base
#   bash bench/device_s20.sh          # run with carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
BASE=${BASE:-.wt/base}
t0=$(date +%s)
[ -n "${NO_TESTS:-}" ] || gpu_tests "tests/test_fused_kernels.py tests/test_cuda_graphs.py tests/test_gpu_model.py
  tests/test_skinny_linear.py tests/test_rejection_greedy.py"
mkdir -p /tmp/s20
for rep in $(seq 1 "${REPS:-2}"); do
  prof=""; [ "$rep" = 1 ] && prof=--profile
  for ctx in ${CONTEXTS:-100 400 1000}; do
    for cfg in ${CFGS:-base fp32 new}; do
      if [ $(( $(date +%s) - t0 )) -gt "${BUDGET:-520}" ]; then echo "budget spent: skip $cfg ctx$ctx r$rep"; continue; fi
      dir=$PWD; flags=""
      case $cfg in
        base) dir=$BASE ;;
        fp32) flags=--fp32-logits ;;
      esac
      name=ctx$ctx-$cfg-r$rep
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/profile_step.py --preset qwen1.5b \
        --batch ${BATCHES:-1 4 16 64} --steps 20 --context "$ctx" $prof $flags --out "/tmp/s20/$name.json" 2>&1 \
        | grep '^{"' | cut -c1-140 | sed "s/^/$name: /")
      echo "elapsed $(( $(date +%s) - t0 )) s"
    done
  done
done
collect_steps /tmp/s20 "$OUT/steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
