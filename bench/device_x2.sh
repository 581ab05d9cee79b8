#!/usr/bin/env bash
# Two-GPU runs (nvidia-h200-x2): the TP=2 GPU tests, the draft round's overhead, and the serving-loop
# benchmark with the draft on GPU 0 and the target on GPU 1 (`split`) or both on GPU 0 (`colocated`).
#   bash bench/device_x2.sh split|colocated [extra bench_e2e.py flags]
set -euo pipefail
OUT=${OUT:-/tmp/out}
PLACEMENT=${1:-split}
shift || true
mkdir -p "$OUT"
trap 'tail -n 25 /tmp/e2e-logs/*.log 2>/dev/null' ERR
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
if [ "$PLACEMENT" = split ]; then
  timeout 150 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_gpu_model.py 2>&1 | tail -5 \
    | tee "$OUT/gpu_tests.txt" || echo "gpu tests: exit $?"
fi
python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --batches 1 4 16 64 \
  --repeats 3 --new-tokens 128 --placement "$PLACEMENT" --models /tmp/models --logs /tmp/e2e-logs \
  --out "$OUT/e2e-$PLACEMENT.json" "$@" | tee "$OUT/e2e-$PLACEMENT.txt" | grep -v '^{'
if [ "$PLACEMENT" = split ]; then
  python3 bench/draft_round.py --model /tmp/models/qwen1.5b-draft --batch 1 16 64 --k 4 --out "$OUT/draft_round.json"
fi
