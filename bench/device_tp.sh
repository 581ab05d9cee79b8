#!/usr/bin/env bash
# TP=2 on nvidia-h200-x2 (docs/benchmarks.md, issue 11): the GPU tests (NCCL TP=2 forward equals TP=1,
# local argmax inside a graph replay equals the full argmax; the fused forward equals the CPU reference),
# then the seeds' four draft modes with draft TP=2 + target TP=2 sharing both GPUs: local argmax or
# full-vocab gather x replicated or sharded Markov head (rank 64), and no head, B = 1 and 16, plain vs
# fixed k=4.
#   bash bench/device_tp.sh [tests|modes|all]
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
  --draft-markov-rank 64 --draft-tp-size 2 --target-tp-size 2 --placement colocated --batches 1 16)
i=0
for flags in "" "--markov-head-mode sharded" "--no-use-local-argmax-reduction" \
  "--no-use-local-argmax-reduction --markov-head-mode sharded"; do
  i=$((i + 1))
  [ "$i" -lt "${FROM_MODE:-1}" ] && continue
  modes=(fixed); [ $i = 1 ] && modes=(plain fixed adaptive)  # plain does not depend on the mode
  python3 bench/bench_e2e.py "${common[@]}" --modes "${modes[@]}" --draft-args="$flags" --logs "/tmp/tp-logs-$i" \
    --out "$OUT/tp2-mode$i.json" | grep -v '^{' | tail -4
done
# The same draft without a Markov head (local argmax): the head's cost at TP=2.
python3 bench/bench_e2e.py "${common[@]}" --draft-markov-rank 0 --modes fixed --logs /tmp/tp-logs-5 \
  --out "$OUT/tp2-mode5-nomarkov.json" | grep -v '^{' | tail -4
