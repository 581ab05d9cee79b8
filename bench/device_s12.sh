#!/usr/bin/env bash
# The twelfth session's diagnosis on one H200: what the draft's first round after plain steps costs
# (bench/draft_round.py --catch-up: B x pending tokens, first call, steady wall, GPU kernels, profile
# tables), then the colocated bench_e2e of bench/device_s11.sh with the draft flags in DRAFT_ARGS.
#   NAME=noahead DRAFT_ARGS="--no-draft-ahead" BATCHES="1 16 64" bash bench/device_s12.sh
set -euo pipefail
NAME=${NAME:-s12}
source bench/device_env.sh
python3 -c "
import sys; from pathlib import Path; sys.path.insert(0, 'bench')
from bench_e2e import make_models; print(make_models(Path('/tmp/models'), 'qwen1.5b'))"
if [ "${CATCH_UP:-1}" = 1 ]; then
  python3 bench/draft_round.py --model /tmp/models/qwen1.5b-draft --batch 1 16 64 --k 4 \
    --catch-up 1 2 8 48 241 --profile-table --out "$OUT/catch-up-$NAME.json" > "$OUT/catch-up-$NAME.txt" 2>&1
  grep '^{' "$OUT/catch-up-$NAME.txt"
fi
if [ -n "${BATCHES:-}" ]; then
  NAME=$NAME BATCHES="$BATCHES" bash bench/device_s11.sh
fi
