#!/usr/bin/env bash
# The sixteenth session's first call on one H200 (docs/benchmarks.md, "Model speed and TP", sixteenth
# session): the kernel GPU tests, then the graphed 1.5B forward (bench/profile_step.py) with programmatic
# dependent launch and skinny_linear each on and off, the configurations interleaved, twice (PROFILE=1:
# the per-kernel breakdown in the first round).
#   bash bench/device_s16.sh
#   TESTS=tests/test_skinny_linear.py CFGS="1:1 0:0" bash bench/device_s16.sh
# (The session's third call ran the L2-prefetch variant of commit 5c3cf98 with a third field,
# SPECSPLIT_L2_PREFETCH_MB: CFGS="1:1:0 1:1:8 1:1:32 1:1:64 0:0:0".)
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
python3 -m pytest -q -p no:cacheprovider ${TESTS:-tests/test_skinny_linear.py tests/test_fused_kernels.py \
  tests/test_cuda_graphs.py tests/test_gpu_model.py} -k "not tp2" 2>&1 | tail -30 > "$OUT/gpu-tests.txt"
tail -3 "$OUT/gpu-tests.txt"; echo "tests took $(( $(date +%s) - t0 )) s"
for rep in 1 2; do
  # each: SPECSPLIT_PDL:SPECSPLIT_SKINNY_LINEAR
  for cfg in ${CFGS:-1:1 0:0 1:0 0:1}; do
    IFS=: read -r pdl sk <<< "$cfg"
    prof=""; [ "$rep" = 1 ] && [ -n "${PROFILE:-}" ] && prof=--profile
    SPECSPLIT_PDL=$pdl SPECSPLIT_SKINNY_LINEAR=$sk python3 bench/profile_step.py \
      --preset qwen1.5b --batch 1 4 16 --steps 20 $prof --out "$OUT/step-pdl$pdl-skinny$sk-r$rep.json" 2>&1 \
      | grep -v Warning | grep '^{"' | sed "s/^/pdl$pdl skinny$sk r$rep: /"
    echo "elapsed $(( $(date +%s) - t0 )) s"
  done
done
