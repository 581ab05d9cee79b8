#!/usr/bin/env bash
# Twenty-fifth session, call 6 on one H200: device_s25d: with PDL off B=4's graph takes 1.71 ms alone and
# beside a second graph; with PDL on, 1.557 alone, 1.667 beside one: a second graph in the process takes
# away part of the overlap, at the boundaries between cuBLAS and Triton kernels (gaps 0.13 -> 0.47-0.95
# us). Last shot at a knob: the hardware queue count, replaying on a side stream; and whether a second
# capture that is never instantiated does it too. ($OUT/probe5.json)
#   bash bench/device_s25e.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
REPS=1 graph_probes probe5.json \
  "a:--capture 4 --trivial 1 --time 4" \
  "b:CUDA_DEVICE_MAX_CONNECTIONS=1 --capture 4 --trivial 1 --time 4" \
  "c:CUDA_DEVICE_MAX_CONNECTIONS=32 --capture 4 --trivial 1 --time 4" \
  "d:--capture 4 --trivial 1 --time 4 --replay-stream" \
  "k:--capture 4 --trivial-kept --time 4" \
  "e:CUDA_DEVICE_MAX_CONNECTIONS=32 --capture 1 4 16 --time 16" \
  "f:--capture 1 4 16 --time 16 --replay-stream"
echo "done in $(( $(date +%s) - t0 )) s"
