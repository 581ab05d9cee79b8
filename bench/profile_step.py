"""Time and profile the target's graphed verify forward (forward + full-vocab logits) on the GPU.

    python bench/profile_step.py --preset qwen1.5b --batch 1 16 --width 5 [--tp 2] [--out step.json]
    python bench/profile_step.py --model DIR --batch 1 --width 5
    python bench/profile_step.py --model DIR --batch 1 --width 5 --whole-step   # the service's step

A preset builds random bf16 weights of real model shapes on the GPU (no checkpoint to write): qwen1.5b
(Qwen2.5-1.5B) and qwen7b (Qwen2.5-7B). For each batch it reports, 3 repeats each:
  - graph_ms: one CUDA-graph replay (GPU time over 200 back-to-back replays);
  - step_ms: a whole step as a service runs it (TPExecutor broadcast to the other ranks, pack, graph
    replay, synchronise) on rank 0;
  - the weight-read floor (this rank's weight bytes / HBM bandwidth) and graph_ms's fraction of it;
  - a per-kernel breakdown from torch.profiler of eager steps (kernel GPU time, grouped).
--tp 2 spawns the second rank (NCCL); every rank builds its own shard and replays the same graphs.
Every figure is timed beside a one-kernel graph, the regime a service replays in (a process that holds a
single graph replays it faster at B >= 4); --alone leaves it out. --context N puts N keys in the cache.
The logits are what the target's step computes (bf16 for these models, read as fp32 by the rejection
kernel); --fp32-logits adds an fp32 copy of them in the graph (what an fp32 consumer would cost).
--whole-step instead times the target service's own step (TargetRunner.step: forward + rejection kernel
in one replay, TP=1) and prints its top kernels.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.batch import pack
from common.config import ModelConfig
from common.cuda_graphs import StaticStep
from common.distributed import Comm, init_tp
from common.kv_cache import KVCache
from common.loader import load_model
from common.models.transformer import Transformer
from common.tp_executor import NO_MULTICAST_ENV, TPExecutor
from target_service.config import TargetConfig
from target_service.runner import StepRow, TargetRunner

PRESETS = {
    # Qwen2.5-1.5B: 1.54B parameters, tied embeddings.
    "qwen1.5b": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                     num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2.5-7B: 7.6B parameters, untied LM head.
    "qwen7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                   num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
}  # fmt: skip
# The serving bench's 2-layer draft (bench/bench_e2e.py): the 1.5B's shapes, two layers.
PRESETS["draft2"] = dict(PRESETS["qwen1.5b"], num_hidden_layers=2)
HBM_BYTES_PER_S = 4.2e12  # H200: the achievable figure (4.8 TB/s peak)
MAX_BATCH = 16


def preset_model(name: str, comm: Comm, device: torch.device) -> Transformer:
    raw = dict(PRESETS[name], architectures=["Qwen2ForCausalLM"], max_position_embeddings=4096,
               rope_theta=1000000.0, rms_norm_eps=1e-6)  # fmt: skip
    model = Transformer(ModelConfig.from_dict(raw, name), comm, dtype=torch.bfloat16, device=device)
    gen = torch.Generator(device=device).manual_seed(comm.rank)
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.fill_(1.0)
            elif p.is_floating_point():
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


def weight_bytes(model: Transformer) -> int:
    """Bytes a decode step reads: every matrix once (the embedding only as the tied LM head)."""
    total = 0
    for name, p in model.named_parameters():
        if name == "model.embed_tokens.weight" and not model.config.tie_word_embeddings:
            continue  # a lookup of a few rows
        total += p.numel() * p.element_size()
    return total


def one_kernel_graph(device: torch.device) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """A CUDA graph of one small kernel. Kept beside the timed graphs: a process that has instantiated a
    single graph replays it faster than once it holds two or more (B=4 width 5: 1.557 against 1.667 ms,
    B=16: 1.689 against 1.795; B=1 the same), whatever the second graph is and even after it is freed, and
    a service holds dozens (docs/kernels.md, "One graph replays faster than two")."""
    x = torch.zeros(16, device=device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        x.add_(1)
    return graph, x


class Bench:
    """What every rank holds: the model shard, its cache, the graphed step and an executor around it."""

    def __init__(self, comm: Comm, args):
        self.device = torch.device("cuda", comm.rank)
        torch.cuda.set_device(self.device)
        if args.model:
            self.model = load_model(args.model, comm, device=self.device, dtype=torch.bfloat16)
        else:
            self.model = preset_model(args.preset, comm, self.device)
        self.fp32_logits = args.fp32_logits
        # --context: keys already in the cache (positions context .. context + width - 1 are verified)
        self.start = args.context
        # a power of two with room for the verified rows; 512 (split_chunk 128) as before at context 100
        self.max_len = max(512, 2 ** (args.context + 64).bit_length())
        # one slot per row (the largest --batch; at least MAX_BATCH's buckets, as before) + a scratch slot:
        # a row past the cache's slots would write outside it (the kernels do not bound-check slots)
        max_batch = max(MAX_BATCH, *args.batch)
        self.cache = KVCache.for_model(self.model, max_batch + 1, self.max_len)
        self.step = StaticStep(self._logits, max_batch, self.max_len, max_batch, self.device, use_graphs=True,
                               copy_output=False)  # fmt: skip
        self.executor = TPExecutor(comm, {"verify": self.verify, "replay": self.replay, "eager": self.eager})
        self.beside = None if getattr(args, "alone", False) else one_kernel_graph(self.device)

    @torch.inference_mode()
    def _logits(self, input_ids, positions, slots, ctx_len):
        hidden = self.model(input_ids, positions, slots, self.cache, ctx_len)
        return self.model.compute_logits(hidden.reshape(-1, hidden.shape[-1]), upcast=self.fp32_logits)

    def _batch(self, batch: int, width: int):
        rows = [[1 + b] * width for b in range(batch)]
        return pack(rows, [self.start] * batch, list(range(batch)), self.device, self.max_len, width=width)

    def verify(self, batch: int, width: int) -> torch.Tensor:
        """A service step: pack host lists, replay the graph for the bucket."""
        p = self._batch(batch, width)
        return self.step(p.input_ids, p.positions, p.slots, p.ctx_len)

    @torch.inference_mode()
    def replay(self, batch: int, width: int, count: int) -> float:
        """GPU ms per graph replay over `count` back-to-back replays (every rank replays: NCCL pairs up)."""
        p = self._batch(batch, width)
        self.step(p.input_ids, p.positions, p.slots, p.ctx_len)  # captures on first use
        graph = self.step.graphs[(batch, width, self.step._bucket(self.step.ctx_buckets, p.ctx_len))][0]
        torch.cuda.synchronize()
        t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0.record()
        for _ in range(count):
            graph.replay()
        t1.record()
        t1.synchronize()
        return t0.elapsed_time(t1) / count

    @torch.inference_mode()
    def eager(self, batch: int, width: int) -> None:
        p = self._batch(batch, width)
        self._logits(p.input_ids, p.positions, p.slots, p.ctx_len)


def kernel_group(name: str) -> str:
    n = name.lower()
    for key, group in (("nccl", "nccl collectives"), ("_attention", "attention (triton)"),
                       ("rotary_cache", "rotary + KV write"), ("rms_norm", "rmsnorm (+add)"),
                       ("silu", "silu_and_mul"), ("skinny", "skinny linear (triton)"),
                       ("gemv", "gemm/gemv"), ("gemm", "gemm/gemv"),
                       ("nvjet", "gemm/gemv"), ("cutlass", "gemm/gemv"),
                       ("splitk", "gemm/gemv")):  # fmt: skip
        if key in n:
            return group
    return "other"


def profile(bench: Bench, batch: int, width: int, executor: TPExecutor) -> dict:
    """Per-kernel GPU time of eager steps (the kernels a graph replays, without the launch gaps)."""
    steps = 5
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            executor.run("eager", batch=batch, width=width)
        torch.cuda.synchronize()
    kernels: dict[str, list[float]] = {}
    for evt in prof.key_averages():
        if evt.device_type == torch.autograd.DeviceType.CUDA and evt.device_time_total > 0:
            kernels[evt.key] = [evt.count / steps, evt.device_time_total / steps / 1e3]
    groups: dict[str, list[float]] = {}
    for name, (count, ms) in kernels.items():
        g = groups.setdefault(kernel_group(name), [0.0, 0.0])
        g[0] += count
        g[1] += ms
    top = sorted(kernels.items(), key=lambda kv: -kv[1][1])[:15]
    return {
        "kernels_per_step": sum(c for c, _ in kernels.values()),
        "kernel_ms_per_step": sum(ms for _, ms in kernels.values()),
        "groups": {g: {"launches": round(c, 1), "ms": round(ms, 4)} for g, (c, ms) in sorted(groups.items())},
        "top": [{"kernel": k[:90], "launches": round(c, 1), "ms": round(ms, 4)} for k, (c, ms) in top],
    }


def run_rank0(comm: Comm, args) -> dict:
    bench = Bench(comm, args)
    ex = bench.executor
    wbytes = weight_bytes(bench.model)
    floor_ms = wbytes / HBM_BYTES_PER_S * 1e3
    result = {"preset": args.preset or args.model, "tp": comm.world_size, "width": args.width,
              "context": args.context, "fp32_logits": args.fp32_logits, "alone": args.alone,
              "weight_bytes_per_rank": wbytes, "floor_ms": round(floor_ms, 4),
              "hbm_bytes_per_s": HBM_BYTES_PER_S, "batches": {}}  # fmt: skip
    for batch in args.batch:
        for _ in range(3):  # warm-up: capture, autotune, NCCL
            ex.run("verify", batch=batch, width=args.width)
        torch.cuda.synchronize()
        graph_ms, step_ms = [], []
        for _ in range(3):
            graph_ms.append(ex.run("replay", batch=batch, width=args.width, count=200))
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(args.steps):
                ex.run("verify", batch=batch, width=args.width)
                torch.cuda.synchronize()
            step_ms.append((time.perf_counter() - t0) / args.steps * 1e3)
        row = {
            "graph_ms": [round(x, 4) for x in graph_ms],
            "graph_ms_median": round(statistics.median(graph_ms), 4),
            "step_ms": [round(x, 4) for x in step_ms],
            "step_ms_median": round(statistics.median(step_ms), 4),
            "floor_fraction": round(floor_ms / statistics.median(graph_ms), 3),
        }
        if args.profile:
            row["profile"] = profile(bench, batch, args.width, ex)
        result["batches"][batch] = row
        print(json.dumps({batch: {k: v for k, v in row.items() if k != "profile"}}), flush=True)
    ex.shutdown()
    return result


def _worker(rank: int, world: int, init_method: str, args) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    comm = init_tp(world, rank, init_method=init_method, device=torch.device("cuda", rank))
    Bench(comm, args).executor.serve_forever()


def whole_step(args) -> None:
    """The target service's verify step (forward + rejection kernel, one graph replay), TP=1."""
    config = TargetConfig(
        model=args.model,
        device="cuda",
        dtype="bfloat16",
        max_batch_size=16,
        log_format="json",  # no progress bar
        num_speculative_tokens=args.width - 1,
    )
    runner = TargetRunner(init_tp(1, 0, device=torch.device("cuda")), config)
    for b in args.batch:
        w = args.width
        # Rows that accept nothing: the step's shape is what matters here, not the tokens.
        rows = [StepRow(1, [1] * (w - 1), 100, slot, 0.0, slot) for slot in range(b)]
        for _ in range(5):
            runner.step(rows, w)
        torch.cuda.synchronize()
        gpu = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            gpu += runner.step(rows, w).gpu_seconds
        wall = time.perf_counter() - t0
        print(f"B={b}: whole step (forward + rejection kernel, one replay): "
              f"{wall / args.steps * 1e3:.3f} ms wall, {gpu / args.steps * 1e3:.3f} ms GPU")  # fmt: skip
        with torch.profiler.profile(
            activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
        ) as prof:
            for _ in range(10):
                runner.step(rows, w)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=50))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", help="a checkpoint directory (loaded in bf16)")
    src.add_argument("--preset", choices=list(PRESETS), help="random weights of these shapes")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16], help="batch sizes, each captured")
    ap.add_argument("--width", type=int, default=5, help="positions per request (k + 1)")
    ap.add_argument("--tp", type=int, default=1, help="TP ranks (NCCL, one GPU each)")
    ap.add_argument("--steps", type=int, default=50, help="eager steps profiled / step timings")
    ap.add_argument("--context", type=int, default=100, help="keys in the cache before the verified rows")
    ap.add_argument("--profile", action="store_true", help="add the per-kernel breakdown")
    ap.add_argument("--fp32-logits", action="store_true", help="add an fp32 copy of the logits to the graph")
    ap.add_argument("--alone", action="store_true", help="no second graph (faster at B>=4 than served)")
    ap.add_argument("--out", help="write the JSON result here")
    ap.add_argument("--whole-step", action="store_true", help="time TargetRunner.step (needs --model)")
    args = ap.parse_args()
    if args.whole_step:
        if not args.model:
            ap.error("--whole-step needs --model")
        whole_step(args)
        return 0
    os.environ.update(NO_MULTICAST_ENV)
    procs = []
    if args.tp > 1:
        init_method = f"tcp://127.0.0.1:{29500 + os.getpid() % 1000}"
        ctx = mp.get_context("spawn")
        procs = [ctx.Process(target=_worker, args=(r, args.tp, init_method, args)) for r in range(1, args.tp)]
        for p in procs:
            p.start()
        comm = init_tp(args.tp, 0, init_method=init_method, device=torch.device("cuda", 0))
    else:
        comm = init_tp(1, 0, device=torch.device("cuda", 0))
    result = run_rank0(comm, args)
    for p in procs:
        p.join()
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
