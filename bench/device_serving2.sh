#!/usr/bin/env bash
# Serving-loop re-measure on nvidia-h200-x2 after the host-path changes (docs/benchmarks.md, "Serving
# loop"): `colocated` runs both services on GPU 0 at B = 1, 16, 64 and records a py-spy profile (GIL
# holders, per thread) of the targets during a B=16 run; `split` runs the draft on GPU 0 and the target
# on GPU 1 at B = 1, 4, 16, 64; `both` runs split, then colocated. PROFILE=0 skips the py-spy run.
# The adaptive target logs its policy's cost table (whole step vs its parts) into $OUT/policy-*.txt.
# Needs .whl (grpcio-health-checking, grpcio-reflection, py-spy).
#   [PROFILE=0] bash bench/device_serving2.sh colocated|split|both
set -euo pipefail
PLACEMENT=${1:-colocated}
source bench/device_env.sh
trap 'tail -n 25 /tmp/e2e-logs*/*.log 2>/dev/null' ERR
common=(--preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --new-tokens 128 --models /tmp/models)
if [ "$PLACEMENT" = colocated ] && [ "${PROFILE:-1}" = 1 ]; then
  # GIL profile of every target and draft process during a long B=16 run (1024 new tokens, after the warm-up).
  (pyspy_services /tmp/prof.txt 15 15 250) &
  python3 bench/bench_e2e.py "${common[@]}" --batches 16 --repeats 3 --new-tokens 1024 --placement colocated \
    --logs /tmp/e2e-logs-prof --out "$OUT/e2e-prof.json" | tee /tmp/prof.txt | grep -v '^{' | tail -4
  wait
  cat /tmp/pyspy-*.txt > "$OUT/pyspy.txt" 2>/dev/null || true
  python3 bench/pyspy_summary.py /tmp/pyspy-gil-*.txt /tmp/pyspy-all-*.txt | tee "$OUT/pyspy_summary.txt" || true
fi
for p in ${PLACEMENT/both/split colocated}; do
  batches=(1 4 16 64); [ "$p" = colocated ] && batches=(1 16 64)
  python3 bench/bench_e2e.py "${common[@]}" --batches "${batches[@]}" --placement "$p" --target-log-level DEBUG \
    --logs "/tmp/e2e-logs-$p" --out "$OUT/e2e-$p.json" | tee "$OUT/e2e-$p.txt" | grep -v '^{'
  grep -h "policy costs" /tmp/e2e-logs-"$p"/target-adaptive-*.log | tail -n 12 > "$OUT/policy-$p.txt" || true
done
