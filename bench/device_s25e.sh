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
mkdir -p /tmp/s25e
for run in "a:- --capture 4 --trivial 1 --time 4" "b:1 --capture 4 --trivial 1 --time 4" \
           "c:32 --capture 4 --trivial 1 --time 4" "d:- --capture 4 --trivial 1 --time 4 --replay-stream" \
           "k:- --capture 4 --trivial-kept --time 4" "e:32 --capture 1 4 16 --time 16" "f:- --capture 1 4 16 --time 16 --replay-stream"; do
  name=${run%%:*}; a=${run#*:}; conn=${a%% *}; a=${a#* }
  if [ "$conn" = - ]; then env=(); else env=(CUDA_DEVICE_MAX_CONNECTIONS=$conn); fi
  env "${env[@]}" python3 bench/graph_probe.py $a --out "/tmp/s25e/$name.json" 2>&1 | grep -v "Warning\|_warn_once" | tail -1 | cut -c1-80
  [ $(( $(date +%s) - t0 )) -gt 100 ] && break
done
python3 - <<'PY'
import glob, json, os
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/s25e/*.json"))}
json.dump(runs, open(os.environ["OUT"] + "/probe5.json", "w"), indent=1)
for name, r in runs.items():
    print(name, r["capture"], f'trivial {r["trivial"]} conn {r["max_connections"]} side {r["replay_stream"]} kept {r["trivial_kept"]}', "time", r["time"], r["graph_ms_median"])
PY
echo "done in $(( $(date +%s) - t0 )) s"
