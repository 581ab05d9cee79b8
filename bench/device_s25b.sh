#!/usr/bin/env bash
# Twenty-fifth session, call 3 on one H200: device_s25 found B=4's graph 1.542 ms alone and 1.658 ms once
# any other forward graph was captured (before or after it), with the same kernel times in the profile.
# Does freeing the other graphs restore it, does a one-kernel graph beside it slow it, and do B=1 and
# B=16 gain the same when alone? ($OUT/probe2.json)
#   bash bench/device_s25b.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
graph_probes probe2.json \
  "a:--capture 4 --time 4" \
  "b:--capture 4 1 --drop --time 4" \
  "c:--capture 4 --trivial 1 --time 4" \
  "d:--capture 16 --time 16" \
  "e:--capture 4 16 --time 16" \
  "f:--capture 1 --time 1" \
  "g:--capture 4 1 --time 1"
echo "done in $(( $(date +%s) - t0 )) s"
