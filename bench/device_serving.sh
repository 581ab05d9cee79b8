#!/usr/bin/env bash
# The serving-loop benchmark on a GPU machine (docs/benchmarks.md: "Serving loop"). Run from the repo root:
#   bash bench/device_serving.sh [extra bench_e2e.py flags]
# Installs the two gRPC wheels the GPU image lacks (carried in .whl/), then: the verify-shape compile costs,
# a smoke run on the tiny preset, and the 1.5B run at B = 1, 4, 16, 64 with 3 interleaved repeats.
set -euo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
trap 'tail -n 25 /tmp/smoke-logs/*.log /tmp/e2e-logs/*.log 2>/dev/null' ERR
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv
python3 bench/verify_shapes.py --out "$OUT/verify_shapes.json" | tail -4
python3 bench/bench_e2e.py --preset tiny --device cuda --batches 1 16 --repeats 1 --new-tokens 32 \
  --logs /tmp/smoke-logs --out "$OUT/smoke.json" | tail -8
python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --batches 1 4 16 64 \
  --repeats 3 --new-tokens 128 --models /tmp/models --logs /tmp/e2e-logs --out "$OUT/e2e.json" "$@" \
  | tee "$OUT/e2e.txt" | grep -v '^{'
