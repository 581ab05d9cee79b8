#!/usr/bin/env bash
# What is left of issues 10 and 11 needs nvidia-h200-x2, withheld from the fourth session to the
# twenty-sixth: the whole of it in three calls of at most 600 s on one warm machine (30 min of device time),
# each writing under $OUT, every figure 3 interleaved repeats. In order of what the issues weigh:
#   bash bench/device_x2_next.sh serve   # issue 10: the intended deployment, draft on GPU 0, target on GPU 1
#   bash bench/device_x2_next.sh tp      # issue 11: NCCL TP=2 tests, TP=1 vs TP=2 forwards and plain TPOT
#   bash bench/device_x2_next.sh modes   # issue 11: the seeds' four draft modes at TP=2 (device_tp.sh)
# carry [".whl"] on each. `tp7b` is tp's 7B half alone (run it if tp ran out of time).
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
since() { echo "$1 at $(( $(date +%s) - t0 )) s"; }
e2e=(python3 bench/bench_e2e.py --device cuda --dtypes bfloat16 --repeats 3 --models /tmp/models --new-tokens 384)

# plain TPOT of a target at TP=2 against one at TP=1, interleaved (both plain, no draft asked; the draft
# service idles beside them), B = 1 and 16, for preset $1.
plain_tp() {
  "${e2e[@]}" --preset "$1" --modes plain --no-k0 --plain-tp 2 --placement colocated --batches 1 16 \
    --logs "/tmp/e2e-logs-tp-$1" --out "$OUT/e2e-plain-tp-$1.json" | grep -v '^{' | grep "plain@tp\|^| bf"
  since "plain TP=1 vs TP=2 ($1)"
}

# graphed forwards at TP=1 and TP=2, widths 1 and 5, B = 1 and 16, for preset $1 (one JSON per run).
forwards_tp() {
  mkdir -p /tmp/fwd
  for tp in 1 2; do
    for w in 1 5; do
      timeout 150 python3 bench/profile_step.py --preset "$1" --tp $tp --batch 1 16 --width $w --steps 20 \
        --out "/tmp/fwd/$1-tp$tp-w$w.json" 2>&1 | grep -i "error\|Traceback" | head -3
    done
  done
  collect_steps /tmp/fwd "$OUT/forwards-tp.json"
  since "forwards ($1)"
}

case "${1:-serve}" in
  serve)
    # bench/device_s11.sh with the services on their own GPUs: plain (no draft), k=0 requests on the fixed
    # target, fixed k=4 and adaptive against the draft service drafting ahead; step traces and the adaptive
    # target's cost tables beside the JSON.
    PLACEMENT=split K0=" " serve_bench x2 "1 4 16 64" "plain fixed adaptive" " "
    since serve
    ;;
  tp)
    # The NCCL TP=2 forward equals TP=1 and local argmax in a graph replay equals the full argmax; the
    # draft ahead on its own GPU.
    timeout 240 python3 -m pytest -q -p no:cacheprovider tests/test_gpu_model.py tests/test_draft_ahead_gpus.py \
      2>&1 | tail -15 | tee "$OUT/gpu-tests-x2.txt" | tail -3
    since tests
    forwards_tp qwen1.5b
    plain_tp qwen1.5b
    [ $(( $(date +%s) - t0 )) -lt 300 ] && { forwards_tp qwen7b; plain_tp qwen7b; }
    ;;
  tp7b)
    forwards_tp qwen7b
    plain_tp qwen7b
    ;;
  modes)
    bash bench/device_tp.sh modes
    since modes
    ;;
esac
