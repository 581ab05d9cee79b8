#!/usr/bin/env bash
# The twentieth session's last call on one H200 (docs/benchmarks.md, "Twentieth session"): the GPU tests
# of the kernels, the model and the rejection kernel on this tree, its forward against .wt/base
# (bench/device_s20.sh: contexts 100 and 400, 3 rounds), then the serving bench (bench/device_s11.sh:
# plain, fixed and adaptive with the draft in the target, B = 1, 4, 16, 64), its files in one
# $OUT/serving-s20final.tgz (a call returns at most 8 files).
#   bash bench/device_s20b.sh         # carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
gpu_tests "tests/test_fused_kernels.py tests/test_cuda_graphs.py tests/test_gpu_model.py tests/test_rejection_greedy.py
  tests/test_rejection_sampled.py"
NO_TESTS=1 CFGS="base new" CONTEXTS="100 400" REPS=3 BUDGET=240 bash bench/device_s20.sh 2>&1 | grep -v "^ctx.*: {"
mkdir -p /tmp/o-final
OUT=/tmp/o-final NAME=s20final MODES=plain EXTRA="--local-modes fixed adaptive" bash bench/device_s11.sh 2>&1 \
  | grep -v '^{' | tail -60
tar czf "$OUT/serving-s20final.tgz" -C /tmp/o-final .
echo "all done in $(( $(date +%s) - t0 )) s"
