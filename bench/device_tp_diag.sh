#!/usr/bin/env bash
# One x2 call: the NCCL TP=2 GPU test under a timeout, with py-spy dumps of every test process 90 s in
# (where it waits if it hangs), then the four draft modes (bench/device_tp.sh modes).
set -uo pipefail
source bench/device_env.sh
(sleep 90; for p in $(pgrep -f "pytest|multiprocessing" || true); do
   echo "== $p $(tr '\0' ' ' < /proc/$p/cmdline | cut -c1-150)"; timeout 20 /tmp/site/bin/py-spy dump -p "$p"
 done > "$OUT/tp_test_dump.txt" 2>&1) &
NCCL_DEBUG=WARN timeout 120 python3 -m pytest -q -x -rA --noconftest -p no:cacheprovider \
  tests/test_gpu_model.py -k nccl 2>&1 | tail -15 | tee "$OUT/gpu_tp_test.txt"
wait
head -c 6000 "$OUT/tp_test_dump.txt"
bash bench/device_tp.sh modes
