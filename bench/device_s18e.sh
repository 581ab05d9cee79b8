#!/usr/bin/env bash
# The eighteenth session's sixth call on one H200 (docs/benchmarks.md, "Eighteenth session"): whether an
# attention row is bit-identical between a plain step (1 token) and a verify step (5) for each split count
# and query-block size (bench/attention_invariance.py, $OUT/invariance.jsonl), then the graphed forward
# with every attention program compiled for at least 16 (main) or 64 query rows. The knob
# SPECSPLIT_ATTN_BLOCK_M_MIN existed only in the tree that call ran on (f8649e9 plus,
# in `attention`, `block_m = max(BLOCK_M_MIN, ...)`); on main the script refuses rather than compare one
# kernel with itself.
#   bash bench/device_s18e.sh         # run with carry [".whl"]
if ! grep -q SPECSPLIT_ATTN_BLOCK_M_MIN common/kernels/fused.py; then
  echo "common/kernels/fused.py has no SPECSPLIT_ATTN_BLOCK_M_MIN knob: see this script's header" >&2
  exit 2
fi
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
python3 bench/attention_invariance.py > "$OUT/invariance.jsonl" 2>&1; tail -18 "$OUT/invariance.jsonl"
echo "invariance took $(( $(date +%s) - t0 )) s"
mkdir -p /tmp/s18e
for bm in 16 64; do
  SPECSPLIT_ATTN_BLOCK_M_MIN=$bm python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 \
    --out /tmp/s18e/bm$bm.json 2>&1 | grep '^{"' | cut -c1-80 | sed "s/^/bm$bm: /"
done
collect_steps /tmp/s18e "$OUT/steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
