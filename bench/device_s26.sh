#!/usr/bin/env bash
# The next session's first call on one H200 (prepared in the twenty-fifth session): the serving bench of
# the landed code at B = 64, 16, 1 with plain / fixed / adaptive (the draft in the target), to measure the
# policy's UNTIMED_AGE change (a never-timed k tried once its bucket is 8 steady steps old: the twenty-fifth
# session's first B=64 adaptive run sat 27 steps at k = 3), B=64 first so its bucket is new in the first
# repeat; then the forwards as a service replays them (profile_step now keeps a second graph beside the
# timed ones), and the multi-graph probe's knobs (device_s25e) if time is left. ~330 s of serving.
#   bash bench/device_s26.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
serve_bench s26 "64 16 1"
echo "serving done at $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/s26
for rep in 1 2; do
  PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 64 --width 5 \
    --steps 20 --context 100 --out "/tmp/s26/served-r$rep.json" 2>&1 | grep -i error | head -3
done
collect_steps /tmp/s26 "$OUT/steps-s26.json"
echo "forwards done at $(( $(date +%s) - t0 )) s"
[ $(( $(date +%s) - t0 )) -lt 430 ] && bash bench/device_s25e.sh
echo "all done in $(( $(date +%s) - t0 )) s"
