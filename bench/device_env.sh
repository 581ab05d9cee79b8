# Sourced by the bench/device_*.sh scripts on the GPU machine: $OUT, the wheels the image lacks (carried
# in .whl: grpcio-health-checking, grpcio-reflection, py-spy) in /tmp/site, and the environment. The two
# grpcio wheels must be the image's grpcio version (1.84.0): 1.84.2's generated code refuses to import
# under grpcio 1.84.0 (the twenty-first session's call 4 lost its serving bench to that).
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
[ -d /tmp/site/grpc_health ] || python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir \
  --upgrade --target /tmp/site .whl/grpcio_health*.whl .whl/grpcio_reflection*.whl
if [ ! -x /tmp/site/bin/py-spy ] && compgen -G ".whl/py_spy*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/pyspy .whl/py_spy*.whl
  mkdir -p /tmp/site/bin && cp /tmp/pyspy/bin/py-spy /tmp/site/bin/
fi
# NVLink multicast stays off (the device README).
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1

# py-spy of every target and draft process once bench_e2e (its output going to file $1) says the
# services are ready: after $2 s, for $3 s at $4 Hz, the GIL holders (/tmp/pyspy-gil-PID.txt) and every
# thread (/tmp/pyspy-all-PID.txt; $5: more flags, e.g. --idle), each process's command line in
# /tmp/pyspy-cmd-PID.txt. Run it in the background beside the bench: `(pyspy_services F 15 15 250) &`.
pyspy_services() {
  until grep -q "services ready" "$1" 2>/dev/null; do sleep 1; done; sleep "$2"
  for p in $(pgrep -f "m (target|draft)_service" || true); do
    tr '\0' ' ' < "/proc/$p/cmdline" | grep -o -- "-m [a-z_]*service.*--speculation-policy [a-z]*\|-m [a-z_]*service" \
      | head -1 > "/tmp/pyspy-cmd-$p.txt" || true
    timeout 40 /tmp/site/bin/py-spy record -p "$p" -d "$3" -r "$4" --threads --gil -f raw \
      -o "/tmp/pyspy-gil-$p.txt" >/dev/null 2>&1 &
    timeout 40 /tmp/site/bin/py-spy record -p "$p" -d "$3" -r "$4" --threads ${5:-} -f raw \
      -o "/tmp/pyspy-all-$p.txt" >/dev/null 2>&1 &
  done
  wait
}

# Every bench/profile_step.py JSON in directory $1 into one file $2 (a device call returns at most 8
# files), keyed by file name, each run's graph ms per batch printed.
collect_steps() {
  python3 - "$1" "$2" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/*.json"))}
json.dump(runs, open(sys.argv[2], "w"), indent=1)
for name, r in runs.items():
    print(name, {b: v["graph_ms_median"] for b, v in r["batches"].items()})
PY
}

# The GPU tests: $TESTS (default: the files in $1), all but the two-GPU ones; the last 30 lines of the
# output in $OUT/gpu-tests.txt, the summary printed.
gpu_tests() {
  local t0
  t0=$(date +%s)
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-$1} -k "not tp2" 2>&1 | tail -30 > "$OUT/gpu-tests.txt"
  tail -3 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
}

# bench/graph_probe.py once per case, each a fresh process, every case $REPS times over (default twice),
# interleaved. A case is "name:[VAR=value ...] flags". Every run's JSON goes into $OUT/$1 (keyed
# name-rREP), one line per run is printed, and the first round's kernel list or timeline gaps, if asked.
graph_probes() {
  local out=$1 dir=/tmp/probes-${1%.json} run name a rep
  shift
  mkdir -p "$dir"
  for rep in ${REPS:-1 2}; do
    for run in "$@"; do
      name=${run%%:*}; a=${run#*:}
      local env=()
      while [[ $a == *" "* && ${a%% *} == *=* ]]; do env+=("${a%% *}"); a=${a#* }; done
      env "${env[@]}" python3 bench/graph_probe.py $a --out "$dir/$name-r$rep.json" 2>&1 \
        | grep -v "Warning\|_warn_once" | tail -1 | cut -c1-160
    done
  done
  python3 - "$dir" "$OUT/$out" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/*.json"))}
json.dump(runs, open(sys.argv[2], "w"), indent=1)
skip = {"graph_ms", "graph_ms_median", "kernels", "gaps", "width"}
for name, r in runs.items():
    flags = {k: v for k, v in r.items() if k not in skip and v not in (False, None, 0, [])}
    print(name, flags, r["graph_ms_median"])
for name, r in runs.items():
    if name.endswith("-r1") and r.get("kernels"):
        print(name, "kernels, us per replay:")
        for k in r["kernels"][:12]:
            print(f'  {k["us_per_replay"]:8.1f} {k["per_replay"]:5.1f}  {k["kernel"][:90]}')
    if name.endswith("-r1") and r.get("gaps"):
        g = r["gaps"]
        print(name, "span", g["span_us_per_replay"], "us per replay; kernels", g["kernel_us_per_replay"])
        for p in g["pairs"][:14]:
            print(f'  {p["gap_us_per_replay"]:8.1f} {p["mean_gap_us"]:7.2f} {p["count_per_replay"]:5.1f}  {p["pair"]}')
PY
}

# bench/device_s11.sh (the colocated serving bench) for $1 = NAME and $2 = BATCHES, $3 = MODES (default
# plain) and $4 = EXTRA (default: fixed and adaptive with the draft in the target); its table printed
# without the per-request lines.
serve_bench() {
  NAME=$1 BATCHES=$2 MODES=${3:-plain} EXTRA=${4:---local-modes fixed adaptive} bash bench/device_s11.sh 2>&1 \
    | grep -v "^  \|^target-\|^divergence" | tail -30
}
