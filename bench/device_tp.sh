#!/usr/bin/env bash
# TP=2 on nvidia-h200-x2 (docs/benchmarks.md, issue 11): the GPU tests (NCCL TP=2 forward equals TP=1,
# local argmax inside a graph replay equals the full argmax; the fused forward equals the CPU reference),
# then the seeds' four draft modes with draft TP=2 + target TP=2 sharing both GPUs: local argmax or
# full-vocab gather x replicated or sharded Markov head (rank 64), and no head, B = 1 and 16, plain vs
# fixed k=4.
#   bash bench/device_tp.sh [tests|modes|all]
# Issue 15, the intended deployment on nvidia-h200-x4 (draft TP=2 on GPUs 0-1, target TP=2 on GPUs 2-3):
#   PLACEMENT=split BATCHES="1 16 64" bash bench/device_tp.sh modes
# FROM_MODE/TO_MODE (1-5) pick a range of the modes below, so that a run can span several device calls.
set -euo pipefail
WHAT=${1:-all}
source bench/device_env.sh
trap 'tail -n 25 /tmp/tp-logs*/*.log 2>/dev/null' ERR
if [ "$WHAT" != modes ]; then
  timeout 200 python3 -m pytest -q -rA --noconftest -p no:cacheprovider tests/test_gpu_model.py 2>&1 \
    | tail -8 | tee "$OUT/gpu_tests.txt" || echo "gpu tests: exit $?"
fi
[ "$WHAT" = tests ] && exit 0
common=(--preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --new-tokens 128 --models /tmp/models
  --draft-markov-rank 64 --draft-tp-size 2 --target-tp-size 2 --placement "${PLACEMENT:-colocated}" --batches ${BATCHES:-1 16})
tag=${PLACEMENT:-colocated}; tag=${tag/colocated/tp2}; tag=${tag/split/x4}
i=0
for flags in "" "--markov-head-mode sharded" "--no-use-local-argmax-reduction" \
  "--no-use-local-argmax-reduction --markov-head-mode sharded"; do
  i=$((i + 1))
  [ "$i" -lt "${FROM_MODE:-1}" ] || [ "$i" -gt "${TO_MODE:-5}" ] && continue
  modes=(plain fixed); [ $i = 1 ] && modes=(plain fixed adaptive)  # plain beside each mode: interleaved repeats
  python3 bench/bench_e2e.py "${common[@]}" --modes "${modes[@]}" --draft-args="$flags" --logs "/tmp/tp-logs-$i" \
    --target-log-level DEBUG --out "$OUT/$tag-mode$i.json" | grep -v '^{' | tail -4
  # The adaptive target's cost table (whole steps per bucket and k, beside their parts): why it picks its k.
  grep -h "policy costs\|mean ms per step" /tmp/tp-logs-$i/target-adaptive-*.log 2>/dev/null | tail -n 12 \
    > "$OUT/$tag-mode$i-policy.txt" || true
done
# The same draft without a Markov head (local argmax): the head's cost at TP=2.
[ "${TO_MODE:-5}" -lt 5 ] && exit 0
python3 bench/bench_e2e.py "${common[@]}" --draft-markov-rank 0 --modes plain fixed adaptive --logs /tmp/tp-logs-5 \
  --target-log-level DEBUG --out "$OUT/$tag-mode5-nomarkov.json" | grep -v '^{' | tail -4
grep -h "policy costs\|mean ms per step" /tmp/tp-logs-5/target-adaptive-*.log 2>/dev/null | tail -n 12 \
  > "$OUT/$tag-mode5-policy.txt" || true
