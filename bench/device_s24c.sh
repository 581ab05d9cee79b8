#!/usr/bin/env bash
# Twenty-fourth session, call 3 on one H200: issue 10's whole colocated table on the landed code, B = 1, 4,
# 16, 64, 3 interleaved repeats of plain (no draft), fixed and adaptive with the draft service beside the
# target (both services on the GPU, the issue's own placement), k = 0 through that fixed target (the
# draft attached), and fixed and adaptive with the draft inside the target (--draft-local).
#   bash bench/device_s24c.sh            # carry [".whl"]
set -uo pipefail
t0=$(date +%s)
K0=" " NAME=s24c BATCHES="1 4 16 64" MODES="plain fixed adaptive" EXTRA="--local-modes fixed adaptive" \
  bash bench/device_s11.sh 2>&1 | grep -v "^  \|^target-\|^divergence" | tail -30
echo "all done in $(( $(date +%s) - t0 )) s"
