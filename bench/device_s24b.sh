#!/usr/bin/env bash
# Twenty-fourth session, call 2 on one H200: can gate_up with SiLU-and-mul in its epilogue match cuBLAS +
# silu_and_mul at 20-80 rows (B=4's and B=16's width-5 verify) with tiles made for those row blocks (more
# warps, fewer stages for two programs an SM, wider N tiles)? 1. `bench/glu_sweep.py --wide` at 20, 32 and
# 80 rows; 2. the best tiles of each row block (every bit check true) into SPECSPLIT_GLU_TILES and the
# graphed forward at B=4 and 16, width 5, with SPECSPLIT_GLU_MAX_ROWS 16 (as landed) against 80, 3
# interleaved rounds; 3. the GPU equality test of the GLU path against cuBLAS's 80-row GEMM with those tiles.
#   bash bench/device_s24b.sh            # carry [".whl"]
set -uo pipefail
source bench/device_env.sh
t0=$(date +%s)
python3 bench/glu_sweep.py --wide --rows 20 32 80 --out "$OUT/glu-wide.jsonl" > /tmp/sweep.log 2>&1
echo "sweep done at $(( $(date +%s) - t0 )) s"
tiles=$(python3 - "$OUT/glu-wide.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
base = {r["rows"]: r["us"] for r in rows if r["kernel"].startswith("cublas")}
ok = [r for r in rows if "us" in r and r["kernel"] == "stream_glu" and r["same_as_cublas"] and r["invariant"]]
spec = []
for m in sorted(base):
    mine = sorted((r for r in ok if r["rows"] == m), key=lambda r: r["us"])[:3]
    print(f"rows {m}: cublas+silu {base[m]} us; best", [(r["us"], r["block_m"], r["block_n"], r["block_k"],
          r["stages"], r["warps"]) for r in mine], file=sys.stderr)
    if mine and m in (32, 80):
        r = mine[0]
        spec.append(f'{r["block_m"]}={r["block_n"]},{r["block_k"]},{r["stages"]},{r["warps"]}')
print(";".join(spec))
PY
)
echo "tiles: $tiles"
mkdir -p /tmp/s24b
for rep in 1 2 3; do
  for g in 16 80; do
    SPECSPLIT_GLU_MAX_ROWS=$g SPECSPLIT_GLU_TILES="$tiles" python3 bench/profile_step.py --preset qwen1.5b \
      --batch 4 16 --width 5 --steps 30 --context 100 --out /tmp/s24b/glu$g-w5-r$rep.json 2>&1 | grep -i error | head -3
  done
done
collect_steps /tmp/s24b "$OUT/steps-glu-wide.json"
echo "forwards done at $(( $(date +%s) - t0 )) s"
SPECSPLIT_GLU_TILES="$tiles" TESTS="tests/test_skinny_linear.py" gpu_tests
echo "all done in $(( $(date +%s) - t0 )) s"
