#!/usr/bin/env bash
# Twenty-fifth session, call 3 on one H200: device_s25 found B=4's graph 1.542 ms alone and 1.658 ms once
# any other forward graph was captured (before or after it), with the same kernel times in the profile.
# Does freeing the other graphs restore it, does a one-kernel graph beside it slow it, and do B=1 and
# B=16 gain the same when alone? ($OUT/probe2.json)
#   bash bench/device_s25b.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
mkdir -p /tmp/s25b
for rep in 1 2; do
  for run in "a:--capture 4 --time 4" "b:--capture 4 1 --drop --time 4" "c:--capture 4 --trivial 1 --time 4" \
             "d:--capture 16 --time 16" "e:--capture 4 16 --time 16" "f:--capture 1 --time 1" "g:--capture 4 1 --time 1"; do
    name=${run%%:*}
    python3 bench/graph_probe.py ${run#*:} --out "/tmp/s25b/$name-r$rep.json" 2>&1 | grep -v "Warning\|_warn_once" | tail -2
  done
done
python3 - <<'PY'
import glob, json, os
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/s25b/*.json"))}
json.dump(runs, open(os.environ["OUT"] + "/probe2.json", "w"), indent=1)
for name, r in runs.items():
    print(name, r["capture"], "drop" if r["drop"] else "", f'trivial {r["trivial"]}', "time", r["time"], r["graph_ms_median"])
PY
echo "done in $(( $(date +%s) - t0 )) s"
