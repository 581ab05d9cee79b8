"""Static-shape steps, replayed from CUDA graphs on the GPU.

Eager PyTorch spends most of a small-batch decode step launching kernels from Python (hundreds per
forward). A `StaticStep` pads every call to a bucket (batch size, rows width, context length), copies
the inputs into static buffers and replays a graph captured once per bucket. Padding rows write their
KV into a scratch slot that no request owns. On the CPU (or with graphs off) the same padded path runs
eagerly, so the bucketing logic is tested everywhere.

Collectives inside a captured step still move their bytes on every replay, but the Python that
counts them only ran at capture: the counts observed during capture are added again on each replay.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from common.distributed import add_comm_stats, comm_stats


def capture(fn: Callable[[], Any], device: torch.device, pool) -> tuple[torch.cuda.CUDAGraph, Any, dict]:
    """Runs `fn` once on a side stream (allocator, Triton compiles), then captures it into a CUDA graph.

    Returns (graph, fn's output in the graph's memory, per-replay collective counts): the Python that
    counts collectives only runs at capture, so the counts seen then are added again on every replay.
    """
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    before = comm_stats()
    with torch.cuda.graph(graph, pool=pool):
        out = fn()
    after = comm_stats()
    per_replay = {
        k: (c - before.get(k, (0, 0))[0], b - before.get(k, (0, 0))[1])
        for k, (c, b) in after.items()
        if (c, b) != before.get(k, (0, 0))
    }
    return graph, out, per_replay


def copy_from_host(out: Tensor, values: Tensor) -> None:
    """values (on the CPU, as many elements as `out`) -> out (contiguous), without waiting for it. On a GPU
    the bytes go through page-locked memory from PyTorch's caching host allocator, which reuses a block
    only once the copy that read it is done; a copy from pageable memory may make the host wait for the
    device."""
    src = values.reshape(-1)
    out.view(-1).copy_(src.pin_memory() if out.is_cuda else src, non_blocking=True)


def to_device(values: Tensor, device: torch.device) -> Tensor:
    """values (on the CPU) -> a new tensor of the same shape on `device` (copy_from_host)."""
    out = torch.empty(values.shape, dtype=values.dtype, device=device)
    copy_from_host(out, values)
    return out


def buckets(limit: int, start: int = 1) -> list[int]:
    """Powers of two from `start`, the last one clipped to `limit`."""
    out = [start]
    while out[-1] < limit:
        out.append(min(out[-1] * 2, limit))
    return out


class StaticStep:
    """`fn(input_ids [B, L], positions [B, L], slots [B], ctx_len) -> Tensor` made static-shape.

    `fn` must be deterministic in shape: its output's first dimension is B (or B * L).
    """

    def __init__(
        self,
        fn: Callable[[Tensor, Tensor, Tensor, int], Tensor],
        max_batch: int,
        max_len: int,
        scratch_slot: int,
        device: torch.device,
        use_graphs: bool,
        min_ctx: int = 256,
        copy_output: bool = True,
    ):
        self.fn = fn
        # A replay overwrites the previous output in place: return a copy unless the caller consumes the
        # output before the next call (the target's logits, read by the rejection kernel at once).
        self.copy_output = copy_output
        self.device = device
        self.scratch_slot = scratch_slot
        self.batch_buckets = buckets(max_batch)
        self.ctx_buckets = buckets(max_len, min(min_ctx, max_len))
        self.use_graphs = use_graphs and device.type == "cuda"
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, dict, Tensor, dict]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None

    def _bucket(self, values: list[int], n: int) -> int:
        return values[bisect.bisect_left(values, n)]

    def _inputs(self, batch: int, width: int) -> dict[str, Tensor]:
        return {
            "input_ids": torch.zeros(batch, width, dtype=torch.int64, device=self.device),
            "positions": torch.arange(width, device=self.device).repeat(batch, 1),
            "slots": torch.full((batch,), self.scratch_slot, dtype=torch.int64, device=self.device),
            "pad_positions": torch.arange(width, device=self.device).repeat(batch, 1),  # padding rows' own
        }

    def _capture(self, batch: int, width: int, ctx: int):
        static = self._inputs(batch, width)
        graph, out, per_replay = capture(
            lambda: self.fn(static["input_ids"], static["positions"], static["slots"], ctx),
            self.device,
            self.pool,
        )
        return graph, static, out, per_replay

    @torch.inference_mode()
    def warm_up(self, widths: list[int], max_ctx: int | None = None, capture: bool = True) -> int:
        """One eager step on the scratch slot (kernels warm, every collective site of the step counted
        once, so its metric series exist), then, on the GPU, captures every (batch bucket, width, context
        bucket) up front so no request pays for a capture. Returns the number of graphs."""
        static = self._inputs(1, 1)
        self.fn(static["input_ids"], static["positions"], static["slots"], 1)
        if not (self.use_graphs and capture):
            return 0
        for ctx in self.ctx_buckets:
            if max_ctx is not None and ctx > max_ctx:
                break
            for batch in self.batch_buckets:
                for width in widths:
                    if (batch, width, ctx) not in self.graphs:
                        self.graphs[batch, width, ctx] = self._capture(batch, width, ctx)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    @torch.inference_mode()
    def __call__(self, input_ids: Tensor, positions: Tensor, slots: Tensor, ctx_len: int) -> Tensor:
        """Inputs [B, L] / [B]; returns fn's output for the B real rows."""
        batch, width = input_ids.shape
        if batch > self.batch_buckets[-1] or ctx_len > self.ctx_buckets[-1]:
            return self.fn(input_ids, positions, slots, ctx_len)
        padded = self._bucket(self.batch_buckets, batch)
        ctx = self._bucket(self.ctx_buckets, ctx_len)
        if not self.use_graphs:
            static = self._inputs(padded, width)
            self._fill(static, input_ids, positions, slots)
            out = self.fn(static["input_ids"], static["positions"], static["slots"], ctx)
            return self._real_rows(out, batch, width, padded)
        key = (padded, width, ctx)
        if key not in self.graphs:
            self.graphs[key] = self._capture(padded, width, ctx)
        graph, static, out, per_replay = self.graphs[key]
        self._fill(static, input_ids, positions, slots)
        graph.replay()
        add_comm_stats(per_replay)
        rows = self._real_rows(out, batch, width, padded)
        return rows.clone() if self.copy_output else rows

    def _fill(self, static: dict[str, Tensor], input_ids: Tensor, positions: Tensor, slots: Tensor) -> None:
        batch = input_ids.shape[0]
        static["input_ids"][:batch].copy_(input_ids)
        static["positions"][:batch].copy_(positions)
        static["slots"][:batch].copy_(slots)
        # Rows past the real ones must write only into the scratch slot, whatever the last call left.
        static["input_ids"][batch:].zero_()
        static["positions"][batch:].copy_(static["pad_positions"][batch:])  # no allocation per call
        static["slots"][batch:].fill_(self.scratch_slot)

    @staticmethod
    def _real_rows(out: Tensor, batch: int, width: int, padded: int) -> Tensor:
        if out.shape[0] == padded:
            return out[:batch]
        return out[: batch * width]  # flattened [B * L, ...] outputs


@torch.inference_mode()
def warm_eager_shapes(model, cache, scratch_slot: int, forward=None) -> None:
    """Compiles at start-up every kernel variant an eager forward inside `fused.eager_shapes()` can need
    (prefills, a draft's catch-up), on the scratch slot. On every TP rank: the forwards hold collectives.
    forward(ids, positions, slots, ctx): the forward to warm when it is not model(..., cache, ctx)."""
    from common.batch import CTX_ROUND
    from common.kernels.fused import ATTENTION_BLOCK_N, EAGER_WARM_SHAPES, eager_shapes, split_chunk

    device = cache.k[0].device
    if device.type != "cuda":
        return
    # A --batch-invariant target's eager attention splits its keys as the graphs do, so its split count
    # (a kernel constant) follows the context: each count is compiled here too.
    chunk = split_chunk(cache.max_len, ATTENTION_BLOCK_N)
    extra = range(chunk, cache.max_len, chunk) if getattr(model, "batch_invariant", False) else ()
    with eager_shapes():
        for batch, length in EAGER_WARM_SHAPES:
            ids = torch.zeros(batch, length, dtype=torch.int64, device=device)
            positions = torch.arange(length, device=device).repeat(batch, 1)
            slots = torch.full((batch,), scratch_slot, dtype=torch.int64, device=device)
            first = min(cache.max_len, -(-length // CTX_ROUND) * CTX_ROUND)
            for ctx in (first, *(c + CTX_ROUND for c in extra if c + CTX_ROUND > first)):
                ctx = min(cache.max_len, ctx)
                if forward is None:
                    model(ids, positions, slots, cache, ctx)
                else:
                    forward(ids, positions, slots, ctx)
    torch.cuda.synchronize(device)
