#!/usr/bin/env bash
# The tenth session's colocated run on one H200 (docs/benchmarks.md, "Tenth session"): B = 1, 4, 16, 64,
# plain / k=0 with a draft / fixed k=4 / adaptive, 3 interleaved repeats, 384 new tokens, and plain and
# fixed each beside a twin started with `--stream-messages-per-step 0` (no limit: the A/B of the new
# default, 16). The adaptive target's policy and gate lines go to $OUT/adaptive-debug.txt.
# NAME=gates VARIANT=0 bash bench/device_s10.sh: the same without the twins (the run after the gate fix).
set -euo pipefail
NAME=${NAME:-s10}
variant=(--variant-args '--stream-messages-per-step 0' --variant-modes plain fixed)
[ "${VARIANT:-1}" = 1 ] || variant=()
source bench/device_env.sh
python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --models /tmp/models \
  --placement colocated --modes plain fixed adaptive --target-log-level DEBUG --logs /tmp/e2e-logs \
  --new-tokens 384 --batches 1 4 16 64 --probe-divergences 2 "${variant[@]}" \
  --out "$OUT/e2e-$NAME.json" | tee "$OUT/e2e-$NAME.txt" | grep -v '^{'
grep -h "policy at\|gates:\|policy costs" /tmp/e2e-logs/target-adaptive-*.log | tail -n 60 \
  > "$OUT/adaptive-debug-$NAME.txt" || true
