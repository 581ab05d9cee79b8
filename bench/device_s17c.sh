#!/usr/bin/env bash
# The seventeenth session's divergence check on one H200 (docs/benchmarks.md, seventeenth session): B=16,
# plain target vs fixed k=4 with the draft in the target, 384 tokens, one repeat, every divergence from
# plain probed (the target's top-2 margin there), with skinny_linear's dot in 8 slices on 8 warps and in
# one on 4 warps (the one-dot summation of main's kernel): does the slicing change how often bf16
# speculative output differs from bf16 plain output, and is every difference a tie? The two knobs exist
# only in 28d95eb's common/kernels/skinny.py (the K-sliced kernel, since reverted):
#   git checkout 28d95eb -- common/kernels/skinny.py && bash bench/device_s17c.sh
set -uo pipefail
grep -q SPECSPLIT_SKINNY_K_PARTS common/kernels/skinny.py \
  || { echo "needs 28d95eb's common/kernels/skinny.py (see above): on main both runs would be one kernel"; exit 2; }
source bench/device_env.sh
for cfg in 8:8 1:4; do
  IFS=: read -r parts warps <<< "$cfg"
  SPECSPLIT_SKINNY_K_PARTS=$parts SPECSPLIT_SKINNY_WARPS=$warps python3 bench/bench_e2e.py --preset qwen1.5b \
    --device cuda --dtypes bfloat16 --repeats 1 --models /tmp/models --placement colocated --modes plain \
    --local-modes fixed --new-tokens 384 --batches 16 --probe-divergences 16 --no-k0 \
    --out "$OUT/e2e-parts$parts.json" > "$OUT/e2e-parts$parts.txt" 2>&1
  grep -v '^{' "$OUT/e2e-parts$parts.txt" | grep -c "divergence" | sed "s/^/parts $parts: divergences /"
  python3 -c "import json,sys; r=json.load(open(sys.argv[1]))['rows'][0]; print({m: r[m].get('identical_sequences') for m in r if isinstance(r[m], dict)})" "$OUT/e2e-parts$parts.json"
done
