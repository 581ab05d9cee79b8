#!/usr/bin/env bash
# The twentieth session's fourth call on one H200 (docs/benchmarks.md, "Twentieth session"), short (the
# session's last device time): the kernels' GPU tests, then the graphed forward of the 1.5B (width 5) and
# of the serving bench's 2-layer draft (width 1, one position per row) on this tree (the rotary table)
# against .wt/base (`git archive 55ba027`, its bench/profile_step.py replaced by this tree's for the
# draft2 preset), interleaved; every JSON in $OUT/steps.json, written as it goes.
#   bash bench/device_s20c.sh         # carry [".whl", ".wt/base"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
gpu_tests tests/test_fused_kernels.py
mkdir -p /tmp/s20c
for rep in 1 2; do
  for preset in qwen1.5b:5 draft2:1; do
    for tree in new base; do
      dir=$PWD; [ "$tree" = base ] && dir=.wt/base
      name=${preset%:*}-$tree-r$rep
      (cd "$dir" && PYTHONPATH=/tmp/site:$dir python3 bench/profile_step.py --preset "${preset%:*}" \
        --width "${preset#*:}" --batch 1 16 --steps 20 --out "/tmp/s20c/$name.json" 2>&1 | grep '^{"' | cut -c1-120 \
        | sed "s/^/$name: /")
      collect_steps /tmp/s20c "$OUT/steps.json" > /dev/null
      echo "elapsed $(( $(date +%s) - t0 )) s"
    done
  done
done
collect_steps /tmp/s20c "$OUT/steps.json"
