#!/usr/bin/env bash
# The twenty-first session's call 4 on one H200: the GPU tests, the graphed 1.5B forward of .wt/base
# (9558099, before stream_linear) against this tree, interleaved, 3 rounds (bench/device_s20.sh), then the
# serving bench (bench/device_s11.sh: plain, fixed and adaptive with the draft in the target, B = 1, 4,
# 16, 64; in call 4 it failed to start: the carried grpcio-health-checking wheel needed a newer grpcio),
# its files in one $OUT/serving-s21.tgz (a call returns at most 8 files). Call 4 ran it on a since-reverted
# tree whose down projection left its split partials to the next norm to sum; on main it measures
# stream_linear as landed.
#   bash bench/device_s21c.sh         # carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
gpu_tests "tests/test_skinny_linear.py tests/test_gpu_model.py tests/test_cuda_graphs.py tests/test_fused_kernels.py
  tests/test_rejection_greedy.py"
NO_TESTS=1 CFGS="base new" CONTEXTS="100 400" REPS=3 BATCHES="${BATCHES:-1 4 16 64}" BUDGET=${BUDGET:-200} \
  bash bench/device_s20.sh 2>&1 | grep -v "^ctx.*: {"
[ -n "${NO_SERVING:-}" ] && exit 0
mkdir -p /tmp/o-s21
OUT=/tmp/o-s21 NAME=s21 MODES=plain EXTRA="--local-modes fixed adaptive" bash bench/device_s11.sh 2>&1 \
  | grep -v '^{' | tail -60
tar czf "$OUT/serving-s21.tgz" -C /tmp/o-s21 .
echo "all done in $(( $(date +%s) - t0 )) s"
