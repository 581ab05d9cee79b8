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
mkdir -p /tmp/s25d
for rep in 1 2; do
  for run in "a:--capture 4 --time 4" "b:--capture 4 --trivial 1 --time 4" \
             "c:--capture 16 --time 16 --gaps" "d:--capture 16 --trivial 1 --time 16 --gaps" \
             "e:PDL0 --capture 4 --time 4" "f:PDL0 --capture 4 --trivial 1 --time 4" \
             "g:EAGER --capture 4 --time 4" "h:EAGER --capture 4 --trivial 1 --time 4"; do
    name=${run%%:*}; a=${run#*:}; env=()
    case $a in PDL0*) env=(SPECSPLIT_PDL=0); a=${a#PDL0 };; EAGER*) env=(CUDA_MODULE_LOADING=EAGER); a=${a#EAGER };; esac
    env "${env[@]}" python3 bench/graph_probe.py $a --out "/tmp/s25d/$name-r$rep.json" 2>&1 | grep -v "Warning\|_warn_once" | tail -1 | cut -c1-200
  done
done
python3 - <<'PY'
import glob, json, os
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/s25d/*.json"))}
json.dump(runs, open(os.environ["OUT"] + "/probe4.json", "w"), indent=1)
for name, r in runs.items():
    print(name, r["capture"], f'trivial {r["trivial"]}', "time", r["time"], r["graph_ms_median"])
for name in ("c-r1", "d-r1"):
    g = runs.get(name, {}).get("gaps")
    if g:
        print(name, "span", g["span_us_per_replay"], "kernels", g["kernel_us_per_replay"])
        for p in g["pairs"][:14]:
            print(f'  {p["gap_us_per_replay"]:8.1f} {p["mean_gap_us"]:7.2f} {p["count_per_replay"]:5.1f}  {p["pair"]}')
PY
echo "done in $(( $(date +%s) - t0 )) s"
