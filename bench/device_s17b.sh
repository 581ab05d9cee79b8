#!/usr/bin/env bash
# The seventeenth session's fourth call on one H200 (docs/benchmarks.md, seventeenth session): the graphed
# 1.5B forward with skinny_linear on and off (cuBLAS for every GEMM, PDL still on), interleaved, twice,
# into $OUT/steps.json; then the sixteenth session's serving bench (plain target vs the draft inside the
# target, fixed and adaptive, B = 1, 4, 16, 64). That call ran it on the K-sliced skinny_linear of
# 28d95eb (since reverted); run on main, it measures main's kernel.
#   bash bench/device_s17b.sh
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
mkdir -p /tmp/s17b
for rep in 1 2; do
  for sk in 1 0; do
    SPECSPLIT_SKINNY_LINEAR=$sk python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 \
      --out "/tmp/s17b/skinny$sk-r$rep.json" 2>&1 | grep '^{"' | cut -c1-100 | sed "s/^/skinny$sk r$rep: /"
  done
done
python3 - "$OUT/steps.json" <<'PY'
import glob, json, os, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob("/tmp/s17b/*.json"))}
json.dump(runs, open(sys.argv[1], "w"), indent=1)
PY
echo "forward done in $(( $(date +%s) - t0 )) s"
NAME=s17 MODES=plain EXTRA="--local-modes fixed adaptive" bash bench/device_s11.sh
echo "all done in $(( $(date +%s) - t0 )) s"
