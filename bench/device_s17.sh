#!/usr/bin/env bash
# The seventeenth session's second call on one H200 (docs/benchmarks.md, "Model speed and TP", seventeenth
# session): the kernel GPU tests, then the graphed 1.5B forward (bench/profile_step.py) with
# skinny_linear's dot split over K_PARTS warps or not, and up to 16, 32 or 80 rows, the configurations
# interleaved, twice (PROFILE=1: the per-kernel breakdown in the first round). Every run's JSON goes into
# one file, $OUT/steps.json ({config-round: result}), as a call brings back at most 8 files.
#   bash bench/device_s17.sh
#   TESTS= CFGS="8:8:16 1:4:16" bash bench/device_s17.sh
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
if [ -n "${TESTS-x}" ]; then
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_skinny_linear.py tests/test_fused_kernels.py \
    tests/test_cuda_graphs.py tests/test_gpu_model.py} -k "not tp2" 2>&1 | tail -30 > "$OUT/gpu-tests.txt"
  tail -3 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
fi
mkdir -p /tmp/s17
for rep in ${REPS:-1 2}; do
  # each: SPECSPLIT_SKINNY_K_PARTS:SPECSPLIT_SKINNY_WARPS:SPECSPLIT_SKINNY_MAX_ROWS
  for cfg in ${CFGS:-8:8:16 1:4:16 4:4:16 16:8:16 8:8:32 8:8:80}; do
    IFS=: read -r parts warps rows <<< "$cfg"
    prof=""; [ "$rep" = 1 ] && [ -n "${PROFILE:-}" ] && prof=--profile
    SPECSPLIT_SKINNY_K_PARTS=$parts SPECSPLIT_SKINNY_WARPS=$warps SPECSPLIT_SKINNY_MAX_ROWS=$rows \
      python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 $prof \
      --out "/tmp/s17/$parts-$warps-$rows-r$rep.json" 2>&1 | grep -v Warning | grep '^{"' | cut -c1-120 \
      | sed "s/^/$cfg r$rep: /"
  done
  echo "elapsed $(( $(date +%s) - t0 )) s"
done
python3 - "$OUT/steps.json" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/s17/*.json"))}
json.dump(runs, open(sys.argv[1], "w"), indent=1)
PY
