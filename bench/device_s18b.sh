#!/usr/bin/env bash
# The eighteenth session's attention-split sweep on one H200 (docs/benchmarks.md, "Eighteenth session"):
# the graphed 1.5B forward (bench/profile_step.py, B = 1, 4, 16, width 5) at $CONTEXTS keys already in the
# cache, with each attention split given at least SPECSPLIT_ATTN_SPLIT_KEYS = $KEYS keys (128: the
# heuristic before this session), interleaved, $REPS rounds; then the base tree ($BASE, see
# bench/device_s18.sh) at context 100 beside them. Every run's JSON in $OUT/steps.json.
# SPECSPLIT_ATTN_SPLIT_KEYS existed only in the tree that call ran on (9e81dfd plus, in `_num_splits`,
# `SPLIT_KEYS = int(os.environ.get("SPECSPLIT_ATTN_SPLIT_KEYS", "256"))` in place of `2 * block_n`); main's
# rule (f81d03c) has no knob, so on main the script refuses rather than compare one rule with itself.
#   bash bench/device_s18b.sh         # run with carry [".whl", ".wt/base"]
set -uo pipefail
if ! grep -q SPECSPLIT_ATTN_SPLIT_KEYS common/kernels/fused.py; then
  echo "common/kernels/fused.py has no SPECSPLIT_ATTN_SPLIT_KEYS knob: see this script's header" >&2
  exit 2
fi
source bench/device_env.sh
BASE=${BASE:-.wt/base}
t0=$(date +%s)
mkdir -p /tmp/s18b
for rep in $(seq 1 "${REPS:-2}"); do
  for ctx in ${CONTEXTS:-100 400 1000 2000}; do
    for keys in ${KEYS:-128 256 512}; do
      SPECSPLIT_ATTN_SPLIT_KEYS=$keys python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 20 \
        --context "$ctx" --out "/tmp/s18b/ctx$ctx-keys$keys-r$rep.json" 2>&1 | grep '^{"' | cut -c1-90 \
        | sed "s/^/ctx$ctx keys$keys r$rep: /"
    done
  done
  (cd "$BASE" && PYTHONPATH=/tmp/site:$PWD python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 \
    --steps 20 --out "/tmp/s18b/base-ctx100-r$rep.json" 2>&1 | grep '^{"' | cut -c1-90 | sed "s/^/base r$rep: /")
  echo "elapsed $(( $(date +%s) - t0 )) s"
done
collect_steps /tmp/s18b "$OUT/steps.json"
echo "all done in $(( $(date +%s) - t0 )) s"
