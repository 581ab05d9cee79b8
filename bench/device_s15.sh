#!/usr/bin/env bash
# The fifteenth session's call on one H200 (docs/benchmarks.md, "Fifteenth session"): the chained rounds'
# GPU tests, then plain / fixed k=4 / adaptive with the draft inside the target (asks drafted from the
# chained round without waiting for the draft's answer), 3 interleaved repeats at B = 1, 4, 16, 64.
#   NAME=s15a bash bench/device_s15.sh                        (the draft inside the target only)
#   NAME=s15c MODES="plain adaptive" bash bench/device_s15.sh  (and adaptive against the draft service)
set -euo pipefail
source bench/device_env.sh
(python3 -m pytest -q -p no:cacheprovider tests/test_draft_chain.py 2>&1 || true) | tail -30 > "$OUT/chain-tests.txt"
tail -3 "$OUT/chain-tests.txt"
NAME=${NAME:-s15a} MODES="${MODES:-plain}" BATCHES="${BATCHES:-1 4 16 64}" EXTRA="${EXTRA:---local-modes fixed adaptive}" \
  bash bench/device_s11.sh
