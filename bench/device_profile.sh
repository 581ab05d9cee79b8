#!/usr/bin/env bash
# py-spy of the services during one (batch, mode) of bench_e2e, colocated on one GPU (docs/benchmarks.md):
# the GIL holders per thread (--gil) and every thread's samples with idle frames (--idle), so that the
# scheduler thread's step can be split into waits (GPU, draft) and host work. Needs .whl (py-spy and the
# gRPC wheels).
#   PROF_BATCH=1 PROF_MODE=fixed PROF_NEW=1024 PROF_REPEATS=10 bash bench/device_profile.sh
set -euo pipefail
source bench/device_env.sh
B=${PROF_BATCH:-1}
MODE=${PROF_MODE:-fixed}
rm -f /tmp/pyspy-*.txt
(until grep -q "services ready" /tmp/prof.txt 2>/dev/null; do sleep 1; done; sleep "${PROF_DELAY:-3}"
 for p in $(pgrep -f "m (target|draft)_service" || true); do
   tr '\0' ' ' < "/proc/$p/cmdline" | grep -o -- "-m [a-z_]*service.*--speculation-policy [a-z]*\|-m [a-z_]*service" \
     | head -1 > "/tmp/pyspy-cmd-$p.txt" || true
   timeout 60 /tmp/site/bin/py-spy record -p "$p" -d "${PROF_SECONDS:-12}" -r 500 --threads --gil -f raw \
     -o "/tmp/pyspy-gil-$p.txt" >/dev/null 2>&1 &
   timeout 60 /tmp/site/bin/py-spy record -p "$p" -d "${PROF_SECONDS:-12}" -r 500 --threads --idle -f raw \
     -o "/tmp/pyspy-all-$p.txt" >/dev/null 2>&1 &
 done; wait) &
python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --models /tmp/models \
  --placement colocated --batches "$B" --modes "$MODE" --no-k0 --repeats "${PROF_REPEATS:-10}" \
  --new-tokens "${PROF_NEW:-1024}" --logs /tmp/e2e-logs-prof --out "$OUT/e2e-prof-b$B-$MODE.json" \
  | tee /tmp/prof.txt | grep -v '^{' | tail -4
wait
cat /tmp/pyspy-*.txt > "$OUT/pyspy-b$B-$MODE.txt" 2>/dev/null || true
python3 bench/pyspy_summary.py /tmp/pyspy-gil-*.txt /tmp/pyspy-all-*.txt | tee "$OUT/pyspy-summary-b$B-$MODE.txt" || true
