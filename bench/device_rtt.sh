#!/usr/bin/env bash
# Where the draft round trip goes (issue 10), nvidia-h200-x2, split placement, B = 1 and 16: the same
# bench three times: as served by default, with a 0.1 ms GIL switch interval in both services
# (--switch-interval), and with draft-ahead off. Each JSON row has round_trip_ms (target: ask sent to
# answer received), draft_handle_ms (draft: ask arrived to answer handed to gRPC) and draft_round_ms.
#   bash bench/device_rtt.sh
set -euo pipefail
source bench/device_env.sh
trap 'tail -n 25 /tmp/rtt-logs*/*.log 2>/dev/null' ERR
common=(--preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --new-tokens 128 --models /tmp/models
  --placement split --batches 1 16 --target-log-level DEBUG)
python3 bench/bench_e2e.py "${common[@]}" --logs /tmp/rtt-logs-a --out "$OUT/rtt-default.json" | grep -v '^{' | tail -4
SPECSPLIT_SWITCH_INTERVAL=0.0001 python3 bench/bench_e2e.py "${common[@]}" --logs /tmp/rtt-logs-b \
  --out "$OUT/rtt-switch100us.json" | grep -v '^{' | tail -4
python3 bench/bench_e2e.py "${common[@]}" --modes plain fixed --draft-args="--no-draft-ahead" --logs /tmp/rtt-logs-c \
  --out "$OUT/rtt-no-ahead.json" | grep -v '^{' | tail -4
for f in "$OUT"/rtt-*.json; do
  python3 -c "
import json, sys
d = json.load(open('$f'))
for r in d['rows']:
    x = r['fixed']
    print('$(basename "$f")', r['batch'], 'fixed x%.2f' % x['speedup_vs_plain'], 'rt %.2f handle %.2f round %.2f ms' % (
        x['round_trip_ms'], x['draft_handle_ms'], x['draft_round_ms']))"
done
