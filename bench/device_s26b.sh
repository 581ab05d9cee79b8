#!/usr/bin/env bash
# Twenty-sixth session, call 2 on one H200: every test file that runs on CUDA (kernels, model, graphs,
# rejection, draft chain / catch-up / branches / draft-ahead), but the two-GPU ones, on main's final code;
# the summary in $OUT/gpu-tests.txt.
#   bash bench/device_s26b.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
gpu_tests "$(grep -l cuda tests/test_*.py | tr '\n' ' ')"
