#!/usr/bin/env bash
# The seventeenth session's first call on one H200 (docs/benchmarks.md, "Model speed and TP", seventeenth
# session): the kernel GPU tests, then the graphed 1.5B forward (bench/profile_step.py) with the down
# projection on cuBLAS (split rows 0) or split over K in skinny_linear at several tiles, interleaved,
# twice (PROFILE=1: the per-kernel breakdown in the first round); then the 7B shapes off / on.
#   bash bench/device_s17.sh
#   TESTS=tests/test_skinny_linear.py CFGS="16:16:1024:8 0:16:1024:8" bash bench/device_s17.sh
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
if [ "${TESTS:-x}" != "" ]; then
  python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_skinny_linear.py tests/test_fused_kernels.py \
    tests/test_cuda_graphs.py tests/test_gpu_model.py} -k "not tp2" 2>&1 | tail -30 > "$OUT/gpu-tests.txt"
  tail -3 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
fi
run() {  # $1 SPLIT_ROWS:BLOCK_N:SPLIT_K:WARPS, $2 tag, rest: profile_step arguments
  IFS=: read -r rows bn sk nw <<< "$1"
  SPECSPLIT_SKINNY_SPLIT_ROWS=$rows SPECSPLIT_SKINNY_SPLIT_BLOCK_N=$bn SPECSPLIT_SKINNY_SPLIT_K=$sk \
    SPECSPLIT_SKINNY_SPLIT_WARPS=$nw python3 bench/profile_step.py "${@:3}" \
    --out "$OUT/step-$2-split$rows-$bn-$sk-$nw.json" 2>&1 | grep -v Warning | grep '^{"' | cut -c1-400 \
    | sed "s/^/$1 $2: /"
}
for rep in ${REPS:-1 2}; do
  for cfg in ${CFGS:-16:16:1024:8 0:16:1024:8 16:16:512:4 16:32:512:8 80:16:1024:8 16:16:2048:8}; do
    prof=""; [ "$rep" = 1 ] && [ -n "${PROFILE:-}" ] && prof=--profile
    run "$cfg" "r$rep" --preset qwen1.5b --batch 1 4 16 --steps 20 $prof
  done
  echo "elapsed $(( $(date +%s) - t0 )) s"
done
for cfg in ${CFGS7B:-0:16:1024:8 16:16:1024:8}; do
  run "$cfg" qwen7b --preset qwen7b --batch 1 16 --steps 20
done
echo "elapsed $(( $(date +%s) - t0 )) s"
