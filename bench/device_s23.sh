#!/usr/bin/env bash
# The next session's first forward call on one H200 (prepared in the twenty-second session): the GPU tests
# of the kernels and the model (the GLU path among them), bench/glu_sweep.py (the gate_up GEMM with
# SiLU-and-mul in its epilogue against cuBLAS + silu_and_mul, $OUT/glu-sweep.jsonl), then the graphed 1.5B
# forward of this tree without and with SPECSPLIT_GLU_MAX_ROWS=80, 3 interleaved rounds at 100 keys
# (bench/device_s22.sh, $OUT/steps.json).
#   bash bench/device_s23.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
gpu_tests "tests/test_skinny_linear.py tests/test_fused_kernels.py tests/test_gpu_model.py tests/test_cuda_graphs.py"
timeout 200 python3 bench/glu_sweep.py --out "$OUT/glu-sweep.jsonl" 2>&1 | cut -c1-160 | grep -v '"error"' | tail -40
echo "sweep done at $(( $(date +%s) - t0 )) s"
NO_TESTS=1 CFGS="new=. glu=.,SPECSPLIT_GLU_MAX_ROWS=80" CONTEXTS=100 BUDGET=${BUDGET:-300} \
  bash bench/device_s22.sh 2>&1 | grep -v "^ctx.*: {"
echo "all done in $(( $(date +%s) - t0 )) s"
