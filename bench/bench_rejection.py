"""Time the verification kernels against the PyTorch reference on one GPU.

    python bench/bench_rejection.py --out rejection.json [--batch 1 16 64 256] [--vocab 151936]

For each (mode, dtype, B) it reports the median time (triton.testing.do_bench; CUDA-graph replay
for B <= --graph-max-batch) and the effective bandwidth = bytes of target logits read once / time,
next to the device-to-device copy bandwidth measured in the same run. Prints a markdown table.
Modes: greedy (T = 0, greedy drafting), sampled (T = 1, one-hot q), sampled_topk (T = 1, sparse q).

    python bench/bench_rejection.py --out tune.json --tune

sweeps the launch parameters of the stats pass (rejection.STATS_*) instead, at --tune-batch.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
import triton
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.cuda_graphs import capture
from common.kernels import rejection
from common.kernels.rejection import verify
from common.kernels.rejection_ref import verify_reference

MODES = ("greedy", "sampled", "sampled_topk")


def make_inputs(mode: str, batch: int, max_k: int, vocab: int, dtype: torch.dtype, topk: int):
    g = torch.Generator(device="cuda").manual_seed(0)
    logits = torch.randn(batch * (max_k + 1), vocab, device="cuda", generator=g).to(dtype)
    target = logits.view(batch, max_k + 1, vocab)[:, :max_k].argmax(-1)
    kw = dict(
        target_logits=logits,
        draft_token_ids=target.clone(),  # mostly accepted: every position gets decided
        num_draft_tokens=torch.full((batch,), max_k, dtype=torch.int32, device="cuda"),
        temperature=torch.full((batch,), 0.0 if mode == "greedy" else 1.0, device="cuda"),
        seeds=torch.arange(batch, device="cuda"),
        positions=torch.full((batch,), 100, device="cuda"),
    )
    if mode == "sampled_topk":
        ids = torch.randint(0, vocab, (batch, max_k, topk), device="cuda", generator=g)
        ids[..., 0] = target
        probs = torch.softmax(torch.randn(batch, max_k, topk, device="cuda", generator=g), -1)
        kw.update(draft_topk_ids=ids, draft_topk_probs=probs)
    return kw


def time_call(fn, use_graph: bool) -> float:
    """Median milliseconds per call."""
    if not use_graph:
        return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
    graph, _, _ = capture(fn, torch.device("cuda"), None)
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def copy_bandwidth(nbytes: int) -> float:
    """Device-to-device copy bandwidth in bytes/s (bytes read + bytes written)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=25, rep=100, return_mode="median")
    return 2 * src.numel() * 4 / (ms * 1e-3)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256], help="requests per call")
    parser.add_argument("--max-k", type=int, default=4, help="draft tokens per request")
    parser.add_argument("--vocab", type=int, default=151936, help="vocabulary size")
    parser.add_argument("--topk", type=int, default=8, help="K of the sparse draft distribution")
    parser.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES, help="kernels timed")
    parser.add_argument(
        "--graph-max-batch", type=int, default=1 << 20, help="CUDA-graph replay up to this B (default: all)"
    )
    parser.add_argument("--skip-reference", action="store_true", help="do not time the PyTorch reference")
    parser.add_argument("--tune", action="store_true", help="sweep rejection.STATS_* launch parameters")
    parser.add_argument("--tune-batch", type=int, nargs="+", default=[1, 64, 256], help="batches of --tune")
    args = parser.parse_args()
    if args.tune:
        tune(args)
        return

    rows_max = max(args.batch) * (args.max_k + 1)
    copy_bw = copy_bandwidth(rows_max * args.vocab * 4)
    results = []
    for mode in args.modes:
        for dtype in (torch.float32, torch.bfloat16):
            for batch in args.batch:
                kw = make_inputs(mode, batch, args.max_k, args.vocab, dtype, args.topk)
                use_graph = batch <= args.graph_max_batch
                logit_bytes = kw["target_logits"].numel() * kw["target_logits"].element_size()
                row = dict(mode=mode, dtype=str(dtype).removeprefix("torch."), batch=batch, graph=use_graph)
                row["kernel_ms"] = time_call(lambda kw=kw: verify(**kw), use_graph)
                # Eager: includes the host launch overhead whenever it exceeds the GPU time.
                row["kernel_eager_ms"] = time_call(lambda kw=kw: verify(**kw), False)
                if not args.skip_reference:
                    row["reference_ms"] = time_call(lambda kw=kw: verify_reference(**kw), use_graph)
                row["logit_bytes"] = logit_bytes
                row["kernel_bw_frac"] = logit_bytes / (row["kernel_ms"] * 1e-3) / copy_bw
                results.append(row)
                print(json.dumps(row), flush=True)
                del kw
                torch.cuda.empty_cache()

    meta = dict(
        device=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        max_k=args.max_k,
        vocab=args.vocab,
        topk=args.topk,
        copy_bw_bytes_per_s=copy_bw,
    )
    Path(args.out).write_text(json.dumps(dict(meta=meta, results=results), indent=2))
    print(markdown_table(meta, results))


# (STATS_BLOCK_BYTES, STATS_WARPS, STATS_MAX_BLOCKS, STATS_PROGRAMS)
TUNE_GRID = [
    (4096, 4, 32, 4096),
    (8192, 8, 32, 4096),
    (2048, 4, 64, 4096),
]


def tune(args) -> None:
    """Time verify for every stats-pass configuration in TUNE_GRID (greedy and sampled)."""
    copy_bw = copy_bandwidth(max(args.tune_batch) * (args.max_k + 1) * args.vocab * 4)
    results = []
    for block_bytes, warps, max_blocks, programs in TUNE_GRID:
        rejection.STATS_BLOCK_BYTES, rejection.STATS_WARPS = block_bytes, warps
        rejection.STATS_MAX_BLOCKS, rejection.STATS_PROGRAMS = max_blocks, programs
        for mode in ("greedy", "sampled"):
            for dtype in (torch.float32, torch.bfloat16):
                for batch in args.tune_batch:
                    kw = make_inputs(mode, batch, args.max_k, args.vocab, dtype, args.topk)
                    ms = time_call(lambda kw=kw: verify(**kw), batch <= args.graph_max_batch)
                    nbytes = kw["target_logits"].numel() * kw["target_logits"].element_size()
                    row = dict(block_bytes=block_bytes, warps=warps, max_blocks=max_blocks, programs=programs)
                    row.update(mode=mode, dtype=str(dtype).removeprefix("torch."), batch=batch)
                    row.update(us=round(ms * 1e3, 1), bw_frac=round(nbytes / (ms * 1e-3) / copy_bw, 3))
                    results.append(row)
                    print(json.dumps(row), flush=True)
    # The one-row Gumbel pass: (SAMPLE_BLOCK, SAMPLE_WARPS, SAMPLE_MAX_BLOCKS, SAMPLE_PROGRAMS).
    for block, warps, max_blocks, programs in SAMPLE_GRID:
        rejection.SAMPLE_BLOCK, rejection.SAMPLE_WARPS = block, warps
        rejection.SAMPLE_MAX_BLOCKS, rejection.SAMPLE_PROGRAMS = max_blocks, programs
        for mode in ("sampled", "sampled_topk"):
            for batch in [b for b in args.tune_batch if b > 1]:
                kw = make_inputs(mode, batch, args.max_k, args.vocab, torch.float32, args.topk)
                ms = time_call(lambda kw=kw: verify(**kw), batch <= args.graph_max_batch)
                row = dict(sample_block=block, warps=warps, max_blocks=max_blocks, programs=programs)
                row.update(mode=mode, dtype="float32", batch=batch, us=round(ms * 1e3, 1))
                results.append(row)
                print(json.dumps(row), flush=True)
    Path(args.out).write_text(json.dumps(dict(copy_bw_bytes_per_s=copy_bw, results=results), indent=2))


SAMPLE_GRID = [
    (1024, 4, 16, 2048),
    (2048, 8, 16, 2048),
    (1024, 4, 64, 512),
    (512, 4, 16, 4096),
    (2048, 4, 8, 4096),
    (1024, 2, 16, 2048),
]


def markdown_table(meta: dict, results: list[dict]) -> str:
    lines = [
        f"{meta['device']}, torch {meta['torch']}, triton {meta['triton']}, k={meta['max_k']}, "
        f"V={meta['vocab']}; copy bandwidth {meta['copy_bw_bytes_per_s'] / 1e12:.2f} TB/s",
        "",
        "| mode | dtype | B | graph | kernel | kernel eager | reference | floor (logits / copy bw) "
        "| kernel % of copy bw |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        floor_us = r["logit_bytes"] / meta["copy_bw_bytes_per_s"] * 1e6
        ref = f"{r['reference_ms'] * 1e3:.1f} µs" if "reference_ms" in r else "-"
        lines.append(
            f"| {r['mode']} | {r['dtype']} | {r['batch']} | {'yes' if r['graph'] else 'no'} | "
            f"{r['kernel_ms'] * 1e3:.1f} µs | {r['kernel_eager_ms'] * 1e3:.1f} µs | {ref} | "
            f"{floor_us:.1f} µs | {100 * r['kernel_bw_frac']:.0f}% |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
