#!/usr/bin/env bash
# Twenty-fifth session, call 2 on one H200: why B=4's width-5 forward runs 1.556 ms in a process that
# never captured B=1 and 1.670 ms in one that did (device_s24c's probe). bench/graph_probe.py in fresh
# processes, twice each, interleaved: the capture order, B=1 eager only, a pool per graph, other batches
# first; the kernels of B=4's graph after and without B=1 ($OUT/probe.json).
#   bash bench/device_s25.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
graph_probes probe.json \
  "a:--capture 1 4 --time 4 --kernels" \
  "b:--capture 4 --time 4 --kernels" \
  "c:--capture 4 1 --time 4" \
  "d:--eager 1 --capture 4 --time 4" \
  "e:--capture 1 4 --pool-per-graph --time 4" \
  "f:--capture 2 4 --time 4" \
  "g:--capture 16 4 --time 4"
echo "done in $(( $(date +%s) - t0 )) s"
