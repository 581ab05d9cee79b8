#!/usr/bin/env bash
# Draft branches on nvidia-h200-x2 (docs/benchmarks.md, "Serving loop"): the GPU tests of the branch
# attention and the branch rounds, then the split placement (draft GPU 0, target GPU 1) at B = 1, 4, 16
# with branches (the default) and without (--no-draft-branches: one all-accepted guess, kept in the
# draft), 3 repeats each, plain / fixed / adaptive targets.
#   bash bench/device_branches.sh [tests|bench|all]
set -euo pipefail
WHAT=${1:-all}
source bench/device_env.sh
trap 'tail -n 25 /tmp/e2e-logs*/*.log 2>/dev/null' ERR
if [ "$WHAT" != bench ]; then
  python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_draft_branches.py tests/test_fused_kernels.py \
    -k "branch or prefix" 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.txt"
fi
[ "$WHAT" = tests ] && exit 0
common=(--preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --new-tokens 128 --models /tmp/models
        --placement split --modes plain fixed adaptive)
for variant in branches single; do
  extra=(); [ "$variant" = single ] && extra=(--draft-args=--no-draft-branches)
  python3 bench/bench_e2e.py "${common[@]}" "${extra[@]}" --batches ${BATCHES:-1 4 16} \
    --logs "/tmp/e2e-logs-$variant" --out "$OUT/e2e-split-$variant.json" | tee "$OUT/e2e-split-$variant.txt" | grep -v '^{'
done
