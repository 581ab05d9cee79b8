#!/usr/bin/env bash
# Twenty-fifth session, call 5 on one H200: device_s25c: not torch's empty_cache; a one-kernel graph
# captured before or after slows B=4's graph all the same. The profile's kernel times are equal, and the
# fast replay (1.56 ms) is shorter than its kernels' summed durations (1.69): kernels overlap (PDL). Which
# boundaries lose their overlap with a second graph, and does the effect remain with PDL off or with CUDA
# modules loaded eagerly? ($OUT/probe4.json)
#   bash bench/device_s25d.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
graph_probes probe4.json \
  "a:--capture 4 --time 4" \
  "b:--capture 4 --trivial 1 --time 4" \
  "c:--capture 16 --time 16 --gaps" \
  "d:--capture 16 --trivial 1 --time 16 --gaps" \
  "e:SPECSPLIT_PDL=0 --capture 4 --time 4" \
  "f:SPECSPLIT_PDL=0 --capture 4 --trivial 1 --time 4" \
  "g:CUDA_MODULE_LOADING=EAGER --capture 4 --time 4" \
  "h:CUDA_MODULE_LOADING=EAGER --capture 4 --trivial 1 --time 4"
echo "done in $(( $(date +%s) - t0 )) s"
