#!/usr/bin/env bash
# The attention's fused split combine (SPECSPLIT_ATTN_FUSED_COMBINE=1: the last split program of each query
# block combines the partials, no second kernel; opt-in since the eighteenth session, unmeasured) on one
# H200: the kernel and model GPU tests with it on, the graphed 1.5B forward with it off and on at
# $CONTEXTS keys (interleaved, $REPS rounds, every JSON in $OUT/steps.json), then, with it on, the
# serving bench (plain target vs the draft inside the target; bench/device_s11.sh) for the bf16
# identical-sequence counts and throughput.
#   bash bench/device_fused_combine.sh        # run with carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
SPECSPLIT_ATTN_FUSED_COMBINE=1 python3 -m pytest -q -p no:cacheprovider tests/test_fused_kernels.py \
  tests/test_cuda_graphs.py tests/test_gpu_model.py -k "not tp2" 2>&1 | tail -20 > "$OUT/gpu-tests.txt"
tail -2 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/fc
for rep in $(seq 1 "${REPS:-2}"); do
  for ctx in ${CONTEXTS:-100 400 1000}; do
    for on in 0 1; do
      SPECSPLIT_ATTN_FUSED_COMBINE=$on python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 \
        --context "$ctx" --out "/tmp/fc/ctx$ctx-fc$on-r$rep.json" 2>&1 | grep '^{"' | cut -c1-80 \
        | sed "s/^/ctx$ctx fc$on r$rep: /"
    done
  done
done
collect_steps /tmp/fc "$OUT/steps.json"
echo "forward done in $(( $(date +%s) - t0 )) s"
[ -n "${NO_SERVING:-}" ] || SPECSPLIT_ATTN_FUSED_COMBINE=1 NAME=fc MODES=plain \
  EXTRA="--local-modes fixed adaptive" bash bench/device_s11.sh | tail -3
echo "all done in $(( $(date +%s) - t0 )) s"
