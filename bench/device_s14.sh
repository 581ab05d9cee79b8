#!/usr/bin/env bash
# The fourteenth session's first call on one H200 (docs/benchmarks.md): the target's GEMMs per cuBLAS
# call / layout (issue 11), then py-spy of a target with its draft inside (--draft-local, fixed k=4) at
# B=1 and at B=64 beside a plain target (issue 10: where the speculative step's host time goes).
#   bash bench/device_s14.sh            (PARTS="gemm b1 b64" by default)
# then the chained draft rounds (--draft-chain): their GPU test, and plain / fixed / fixed without chaining
# / adaptive, all with the draft inside the target, 3 interleaved repeats at B = 1, 4, 16, 64:
#   PARTS=chain NAME=s14a bash bench/device_s14.sh
set -euo pipefail
source bench/device_env.sh
read -ra parts <<< "${PARTS:-gemm b1 b64}"
for part in "${parts[@]}"; do
  case $part in
    gemm)
      python3 bench/gemm_sweep.py --out "$OUT/gemm-default.json" | tee "$OUT/gemm-default.txt" | tail -3
      CUBLASLT_WORKSPACE_SIZE=65536 python3 bench/gemm_sweep.py --tag ws64m --out "$OUT/gemm-ws64m.json" \
        > "$OUT/gemm-ws64m.txt" ;;
    chain)
      (python3 -m pytest -q -p no:cacheprovider tests/test_draft_chain.py 2>&1 || true) | tail -30 \
        > "$OUT/chain-tests.txt"
      tail -3 "$OUT/chain-tests.txt"
      NAME=${NAME:-s14a} MODES=plain BATCHES="${BATCHES:-1 4 16 64}" \
        EXTRA="--local-modes fixed fixed-nochain adaptive" bash bench/device_s11.sh ;;
    b*)
      b=${part#b}
      rm -f /tmp/pyspy-*.txt
      (pyspy_services "/tmp/prof-$b.txt" 3 "${PROF_SECONDS:-10}" 500 --idle) &
      python3 bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --models /tmp/models \
        --placement colocated --batches "$b" --modes plain --local-modes fixed --no-k0 --repeats 4 \
        --new-tokens 1024 --logs "/tmp/e2e-logs-prof$b" --out "$OUT/e2e-prof-b$b.json" \
        | tee "/tmp/prof-$b.txt" | grep -v '^{' | tail -4
      wait
      mkdir -p "$OUT/pyspy-b$b" && cp /tmp/pyspy-*.txt "$OUT/pyspy-b$b/" 2>/dev/null || true
      python3 bench/pyspy_summary.py /tmp/pyspy-gil-*.txt /tmp/pyspy-all-*.txt > "$OUT/pyspy-summary-b$b.txt" || true
      ;;
  esac
done
