#!/usr/bin/env bash
# The few-row fused GEMMs (common/kernels/small_linear.py) on one H200: GPU tests, the tile sweep per
# GEMM shape (bench/small_linear.py), then the graphed 1.5B forward with them off and on (tuned), interleaved.
#   [SWEEP_TP="1"] [AB_ROUNDS=2] bash bench/device_small_linear.sh [tests|sweep|ab|all]
set -euo pipefail
WHAT=${1:-all}
source bench/device_env.sh
if [ "$WHAT" = all ] || [ "$WHAT" = tests ]; then
  python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_small_linear.py tests/test_fused_kernels.py \
    tests/test_cuda_graphs.py "tests/test_gpu_model.py::test_fused_gpu_forward_matches_cpu_reference" 2>&1 \
    | tail -n 15 | tee "$OUT/gpu_tests.txt"
fi
CONFIGS=${CONFIGS:-$OUT/small_linear_qwen1.5b.json}
if [ "$WHAT" = all ] || [ "$WHAT" = sweep ]; then
  python3 bench/small_linear.py --preset qwen1.5b --tp ${SWEEP_TP:-1} --sweep --out "$CONFIGS" 2>/dev/null \
    | tee "$OUT/small_linear_qwen1.5b.txt"
fi
if [ "$WHAT" = all ] || [ "$WHAT" = ab ]; then
  for round in $(seq ${AB_ROUNDS:-2}); do
    for v in off on; do
      if [ $v = off ]; then export SPECSPLIT_SMALL_M_LINEAR=0; unset SPECSPLIT_SMALL_M_CONFIGS
      else export SPECSPLIT_SMALL_M_LINEAR=1 SPECSPLIT_SMALL_M_CONFIGS=$CONFIGS; fi
      prof=""; [ "$round" = 1 ] && prof=--profile
      python3 bench/profile_step.py --preset qwen1.5b --batch 1 16 --steps 20 $prof \
        --out "$OUT/step_qwen1.5b_tp1_${v}_$round.json" 2>&1 | grep -v "^\s*$" | tail -n 30 \
        | tee "$OUT/step_qwen1.5b_tp1_${v}_$round.txt"
    done
  done
fi
