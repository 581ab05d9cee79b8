#!/usr/bin/env bash
# The eleventh session's colocated runs on one H200 (docs/benchmarks.md, "Eleventh session"): plain /
# fixed k=4 / adaptive, 3 interleaved repeats, 384 new tokens, every target writing its step trace
# (--step-traces); bench/step_trace_summary.py splits each batch's wall time into fill, full and tail
# ($OUT/steps-$NAME.txt), the traces travel in $OUT/traces-$NAME.tgz.
#   NAME=diag BATCHES="1 64" bash bench/device_s11.sh     (the diagnosis)
#   NAME=final bash bench/device_s11.sh                   (B = 1, 4, 16, 64)
#   DRAFT_ARGS="--no-draft-ahead" NAME=noahead bash bench/device_s11.sh   (extra draft flags)
#   MODES="plain adaptive" NAME=gate bash bench/device_s11.sh            (some of the modes)
#   K0=" " MODES="plain fixed adaptive" ...                                  (also k = 0 on the fixed target)
#   PLACEMENT=split ...                   (nvidia-h200-x2: the draft on GPU 0, the target on GPU 1)
set -euo pipefail
NAME=${NAME:-s11}
source bench/device_env.sh
read -ra batches <<< "${BATCHES:-1 4 16 64}"
python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --models /tmp/models \
  --placement ${PLACEMENT:-colocated} --modes ${MODES:-plain fixed adaptive} --target-log-level DEBUG --logs /tmp/e2e-logs-$NAME \
  --new-tokens 384 --batches "${batches[@]}" --probe-divergences 2 ${K0:---no-k0} --step-traces "--draft-args=${DRAFT_ARGS:-}" ${EXTRA:-} \
  --out "$OUT/e2e-$NAME.json" | tee "$OUT/e2e-$NAME.txt" | grep -v '^{'
for b in "${batches[@]}"; do
  python3 bench/step_trace_summary.py /tmp/e2e-logs-$NAME/*-steps.jsonl --batch "$b" --min-tokens $((b * 300))
done > "$OUT/steps-$NAME.txt"
cat "$OUT/steps-$NAME.txt"
tar czf "$OUT/traces-$NAME.tgz" -C /tmp/e2e-logs-$NAME .
grep -h "policy at\|gates:\|policy costs" /tmp/e2e-logs-$NAME/target-adaptive*.log | tail -n 60 \
  > "$OUT/adaptive-debug-$NAME.txt" || true
