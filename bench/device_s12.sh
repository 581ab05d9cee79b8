#!/usr/bin/env bash
# The twelfth session's diagnosis on one H200: what the draft's first round after plain steps costs
# (bench/draft_round.py --catch-up: B x pending tokens, first call, steady wall, GPU kernels, profile
# tables), then the colocated bench_e2e of bench/device_s11.sh with the draft flags in DRAFT_ARGS.
#   NAME=noahead DRAFT_ARGS="--no-draft-ahead" BATCHES="1 16 64" bash bench/device_s12.sh
# TESTS=1 first runs the draft's GPU tests (catch-up chunks and branches through the CUDA graphs);
# PROFILE=1 records py-spy profiles (GIL holders, and every thread with its waits) of the fixed target
# and the draft during long B=1 runs, summarised by bench/pyspy_summary.py.
set -euo pipefail
NAME=${NAME:-s12}
source bench/device_env.sh
python3 -c "
import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from bench_e2e import make_models; print(make_models(Path('/tmp/models'), 'qwen1.5b'))"
if [ "${TESTS:-0}" = 1 ]; then
  timeout 300 python3 -m pytest -q --noconftest -p no:cacheprovider tests/test_draft_catch_up.py \
    tests/test_draft_branches.py 2>&1 | tail -n 15 | tee "$OUT/gpu-tests-$NAME.txt"
fi
if [ "${CATCH_UP:-1}" = 1 ]; then
  python3 bench/draft_round.py --model /tmp/models/qwen1.5b-draft --batch 1 16 64 --k 4 \
    --catch-up 1 2 8 48 241 --profile-table --out "$OUT/catch-up-$NAME.json" > "$OUT/catch-up-$NAME.txt" 2>&1
  grep '^{' "$OUT/catch-up-$NAME.txt"
fi
if [ -n "${BATCHES:-}" ]; then  # then the draft's stream log: no draft-ahead for a target on its GPU
  NAME=$NAME BATCHES="$BATCHES" bash bench/device_s11.sh
  grep -h "shares GPU\|stream opened" /tmp/e2e-logs-$NAME/draft-*.log | head -n 6 | tee "$OUT/draft-streams-$NAME.txt" || true
fi
if [ "${PROFILE:-0}" = 1 ]; then
  (pyspy_services /tmp/prof.txt 12 12 500 --idle) &
  python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --models /tmp/models \
    --placement colocated --modes plain fixed --batches 1 --repeats 3 --new-tokens 2048 --no-k0 \
    "--draft-args=${DRAFT_ARGS:-}" --logs /tmp/e2e-logs-prof --out "$OUT/e2e-prof-$NAME.json" \
    | tee /tmp/prof.txt | grep -v '^{' | tail -n 4
  wait
  for f in /tmp/pyspy-cmd-*.txt; do echo "$f: $(cat "$f")"; done > "$OUT/pyspy-$NAME.txt"
  cat /tmp/pyspy-*.txt >> "$OUT/pyspy-$NAME.txt" 2>/dev/null || true
  python3 bench/pyspy_summary.py /tmp/pyspy-gil-*.txt /tmp/pyspy-all-*.txt > "$OUT/pyspy-summary-$NAME.txt" || true
fi
