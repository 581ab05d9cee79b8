#!/usr/bin/env bash
# The twenty-first session's first call on one H200: the GPU tests of the model on this tree (the rotary
# table's whole-model checks), then bench/stream_sweep.py (the streaming Triton GEMM's tiles against
# cuBLAS on the 1.5B shapes), its JSON lines in $OUT/stream-sweep.jsonl.
#   bash bench/device_s21.sh          # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
[ -n "${NO_TESTS:-}" ] || gpu_tests "tests/test_cuda_graphs.py tests/test_gpu_model.py tests/test_fused_kernels.py
  tests/test_skinny_linear.py"
timeout "${SWEEP_S:-380}" python3 bench/stream_sweep.py --out "$OUT/stream-sweep.jsonl" ${SWEEP_ARGS:-} \
  2>&1 | grep -v '"error"' | tail -5
echo "all done in $(( $(date +%s) - t0 )) s"
