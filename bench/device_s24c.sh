#!/usr/bin/env bash
# Twenty-fourth session, call 3 on one H200: issue 10's whole colocated table on the landed code, B = 1, 4,
# 16, 64, 3 interleaved repeats of plain (no draft), fixed k = 4 with the draft service beside the
# target (both services on the GPU, the issue's own placement), k = 0 through that fixed target (the
# draft attached), and fixed and adaptive with the draft inside the target (--draft-local).
#   bash bench/device_s24c.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
K0=" " serve_bench s24c "1 4 16 64" "plain fixed"
echo "all done in $(( $(date +%s) - t0 )) s"
# Then, if time is left: why B=4's width-5 forward measured 1.553 ms in a process whose largest batch was 16
# and 1.672 in one whose largest was 64 (calls 1 and 2): the same B=4 graph beside other batch lists.
mkdir -p /tmp/s24c
for rep in 1 2; do
  for batches in "4 16" "4 16 64" "1 4 16"; do
    [ $(( $(date +%s) - t0 )) -gt 500 ] && { echo "no time for B=4 probe ($batches, r$rep)"; continue; }
    PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset qwen1.5b --batch $batches --width 5 --alone \
      --steps 20 --context 100 --out "/tmp/s24c/b${batches// /-}-r$rep.json" 2>&1 | grep -i error | head -3
  done
done
collect_steps /tmp/s24c "$OUT/steps-b4-probe.json"
echo "probe done in $(( $(date +%s) - t0 )) s"
