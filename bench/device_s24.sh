#!/usr/bin/env bash
# The next session's first call on one H200 (prepared in the twenty-third session): the serving bench of the
# landed code at B = 1, 16, 64 with plain / fixed / adaptive (the draft in the target), to check the
# adaptive policy's B=1 fix (a step that started requests is no verify sample: call 7 of the twenty-third
# session priced k = 4 out and ran adaptive at 1.53-1.73x where fixed ran 1.95x), then the graphed forward
# at 100 and 400 keys and the 2-layer draft's forward with the gate_up + SiLU epilogue (on by default up
# to 16 rows; its 400-key and draft figures predate it). ~300 s of serving, ~100 s of forwards.
#   bash bench/device_s24.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
serve_bench s24 "1 16 64"
echo "serving done at $(( $(date +%s) - t0 )) s"
NO_TESTS=1 CFGS="new=." CONTEXTS="100 400" BUDGET=${BUDGET:-500} bash bench/device_s22.sh 2>&1 | grep -v "^ctx.*: {"
PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset draft2 --batch 1 16 --width 1 --steps 30 \
  --out "$OUT/draft-step.json" 2>&1 | grep -i "error" | head -3
echo "all done in $(( $(date +%s) - t0 )) s"
