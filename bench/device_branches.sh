#!/usr/bin/env bash
# Draft branches on nvidia-h200-x2 (docs/benchmarks.md, "Serving loop"): the GPU tests of the branch
# attention and the branch rounds, then PLACEMENT (split: draft GPU 0, target GPU 1; or colocated) at
# BATCHES with branches (the default) and, at AB_BATCHES, without (--no-draft-branches: one all-accepted
# guess, kept in the draft), 3 repeats each, plain / fixed / adaptive targets.
#   [PLACEMENT=split] [BATCHES="1 4 16 64"] [AB_BATCHES="1 16"] bash bench/device_branches.sh [tests|bench|all]
set -euo pipefail
WHAT=${1:-all}
source bench/device_env.sh
trap 'tail -n 25 /tmp/e2e-logs*/*.log 2>/dev/null' ERR
if [ "$WHAT" != bench ]; then
  python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_draft_branches.py tests/test_fused_kernels.py \
    -k "branch or prefix" 2>&1 | tail -n 15 | tee "$OUT/gpu_tests.txt"
fi
[ "$WHAT" = tests ] && exit 0
P=${PLACEMENT:-split}
common=(--preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --new-tokens 128 --models /tmp/models
        --placement "$P" --modes plain fixed adaptive)
python3 bench/bench_e2e.py "${common[@]}" --batches ${BATCHES:-1 4 16 64} --logs "/tmp/e2e-logs-$P-branches" \
  --out "$OUT/e2e-$P-branches.json" | tee "$OUT/e2e-$P-branches.txt" | grep -v '^{'
if [ -n "${AB_BATCHES-1 16}" ]; then
  python3 bench/bench_e2e.py "${common[@]}" --draft-args=--no-draft-branches --batches ${AB_BATCHES:-1 16} \
    --logs "/tmp/e2e-logs-$P-single" --out "$OUT/e2e-$P-single.json" | tee "$OUT/e2e-$P-single.txt" | grep -v '^{'
fi
if [ -n "${THEN_COLOCATED:-}" ]; then
  PLACEMENT=colocated BATCHES="1 16 64" AB_BATCHES="" THEN_COLOCATED="" bash bench/device_branches.sh bench
fi
