#!/usr/bin/env bash
# The sixteenth session's sixth call on one H200 (docs/benchmarks.md, "Model speed and TP", sixteenth
# session): the kernel GPU tests, then the graphed 1.5B forward (bench/profile_step.py) with
# silu_and_down off (SPECSPLIT_SILU_DOWN_MAX_ROWS=0: the SiLU kernel and cuBLAS) and on at several
# (BLOCK_N, CHUNK_K) tiles, interleaved, twice.
#   bash bench/device_s16b.sh
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider tests/test_skinny_linear.py tests/test_fused_kernels.py \
  tests/test_gpu_model.py -k "not tp2" 2>&1 | tail -30 > "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
for rep in 1 2; do
  # each: SPECSPLIT_SILU_DOWN_MAX_ROWS:SPECSPLIT_SILU_DOWN_BLOCK_N:SPECSPLIT_SILU_DOWN_CHUNK_K
  for cfg in ${CFGS:-0:16:1024 128:16:1024 128:16:512 128:32:512 128:16:2048 128:64:256}; do
    IFS=: read -r mr bn ck <<< "$cfg"
    SPECSPLIT_SILU_DOWN_MAX_ROWS=$mr SPECSPLIT_SILU_DOWN_BLOCK_N=$bn SPECSPLIT_SILU_DOWN_CHUNK_K=$ck \
      python3 bench/profile_step.py --preset qwen1.5b --batch 1 4 16 --steps 10 \
      --out "$OUT/step-sd$mr-$bn-$ck-r$rep.json" 2>&1 | grep '^{"' | cut -c1-80 | sed "s/^/$cfg r$rep: /"
  done
  echo "elapsed $(( $(date +%s) - t0 )) s"
done
