#!/usr/bin/env bash
# Twenty-fifth session, call 2 on one H200: why B=4's width-5 forward runs 1.556 ms in a process that
# never captured B=1 and 1.670 ms in one that did (device_s24c's probe). bench/graph_probe.py in fresh
# processes, twice each, interleaved: the capture order, B=1 eager only, a pool per graph, other batches
# first; the kernels of B=4's graph after and without B=1 ($OUT/probe.json).
#   bash bench/device_s25.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
mkdir -p /tmp/s25
for rep in 1 2; do
  for run in "a:--capture 1 4 --kernels" "b:--capture 4 --kernels" "c:--capture 4 1" "d:--eager 1 --capture 4" \
             "e:--capture 1 4 --pool-per-graph" "f:--capture 2 4" "g:--capture 16 4"; do
    name=${run%%:*}
    python3 bench/graph_probe.py ${run#*:} --time 4 --out "/tmp/s25/$name-r$rep.json" 2>&1 | grep -v Warning | tail -2
  done
done
python3 - <<'PY'
import glob, json, os
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/s25/*.json"))}
json.dump(runs, open(os.environ["OUT"] + "/probe.json", "w"), indent=1)
for name, r in runs.items():
    print(name, r["capture"], r["eager"], r["pool_per_graph"], r["graph_ms_median"])
a, b = runs.get("a-r1", {}).get("kernels", []), runs.get("b-r1", {}).get("kernels", [])
kb = {k["kernel"]: k for k in b}
print("B=4 kernels, us per replay: after B=1 (a) / without (b)")
for k in a[:40]:
    o = kb.get(k["kernel"], {})
    print(f'{k["us_per_replay"]:8.1f} {o.get("us_per_replay", float("nan")):8.1f} {k["per_replay"]:5.1f} {o.get("per_replay", 0):5.1f}  {k["kernel"][:90]}')
for k in b:
    if k["kernel"] not in {x["kernel"] for x in a}:
        print("only without B=1:", k["us_per_replay"], k["per_replay"], k["kernel"][:90])
PY
echo "done in $(( $(date +%s) - t0 )) s"
