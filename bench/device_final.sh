#!/usr/bin/env bash
# The serving-loop runs on nvidia-h200-x2 in one call (docs/benchmarks.md, "Serving loop"):
# split placement (draft on GPU 0, target on GPU 1) at B = 1, 4, 16, 64, colocated (both on GPU 0) at
# B = 1 and 16, and the whole-step profile of plain (width 1) and speculative (width 5) steps at B=16.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
trap 'tail -n 25 /tmp/e2e-logs*/*.log 2>/dev/null' ERR
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
common=(--preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --new-tokens 128 --models /tmp/models)
python3 bench/bench_e2e.py "${common[@]}" --batches 1 4 16 64 --placement split --logs /tmp/e2e-logs-split \
  --out "$OUT/e2e-split.json" | tee "$OUT/e2e-split.txt" | grep -v '^{'
python3 bench/bench_e2e.py "${common[@]}" --batches 1 16 --placement colocated --logs /tmp/e2e-logs-coloc \
  --out "$OUT/e2e-colocated.json" | tee "$OUT/e2e-colocated.txt" | grep -v '^{'
for w in 1 5; do
  timeout 90 python3 bench/profile_step.py --model /tmp/models/qwen1.5b-target --batch 16 --width $w --whole-step \
    2>&1 | grep -v Warning | head -14 | tee -a "$OUT/profile_b16.txt"
done
