#!/usr/bin/env bash
# Twenty-fifth session, call 4 on one H200: device_s25b found B=4's graph slow (1.67 against 1.56 ms) once
# any second graph was captured in the process, even a one-kernel one, and still after freeing it; B=16
# likewise (1.80 against 1.69), B=1 not. Is it torch.cuda.graph's empty_cache at each capture?
# ($OUT/probe3.json)
#   bash bench/device_s25c.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
graph_probes probe3.json \
  "a:--capture 4 --time 4" \
  "b:--capture 4 --trivial 1 --time 4" \
  "c:--capture 4 --trivial 1 --no-empty-cache --time 4" \
  "d:--capture 4 --empty-after device --time 4" \
  "e:--capture 4 --empty-after host --time 4" \
  "f:--capture 4 --trivial-first --time 4" \
  "g:--capture 1 4 16 --no-empty-cache --time 16" \
  "h:--capture 1 4 16 --no-empty-cache --time 4"
echo "done in $(( $(date +%s) - t0 )) s"
