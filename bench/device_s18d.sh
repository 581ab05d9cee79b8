#!/usr/bin/env bash
# The eighteenth session's last call on one H200 (docs/benchmarks.md, "Eighteenth session"), on 9eccbf2
# (f81d03c's attention split rule, since reverted in 8c234a7, without the fp32 logits): the model's GPU tests, the graphed 1.5B forward at context 100 of main and of
# the base tree ($BASE, see bench/device_s18.sh), then the serving bench (plain target vs the draft inside
# the target, fixed and adaptive, B = 1, 4, 16, 64; bench/device_s11.sh).
#   bash bench/device_s18d.sh         # run with carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
BASE=${BASE:-.wt/base}
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider tests/test_gpu_model.py tests/test_cuda_graphs.py -k "not tp2" 2>&1 \
  | tail -5 > "$OUT/gpu-tests.txt"
tail -2 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/s18d
python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 --out /tmp/s18d/main-ctx100.json 2>&1 \
  | grep '^{"' | cut -c1-90 | sed "s/^/main: /"
(cd "$BASE" && PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 \
  --steps 20 --out /tmp/s18d/base-ctx100.json 2>&1 | grep '^{"' | cut -c1-90 | sed "s/^/base: /")
collect_steps /tmp/s18d "$OUT/steps.json"
echo "forward done in $(( $(date +%s) - t0 )) s"
NAME=s18 MODES=plain EXTRA="--local-modes fixed adaptive" bash bench/device_s11.sh | tail -3
echo "all done in $(( $(date +%s) - t0 )) s"
