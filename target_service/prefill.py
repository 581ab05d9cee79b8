"""Prompt prefills replayed from CUDA graphs, for prompts that arrive a few at a time.

An eager prefill of a short prompt is bound by its kernel launches, not by its tokens: hundreds of
launches from Python for any length. Under speculation requests finish at different steps, so new
prompts arrive one or two per step and each pays those launches alone, on the step's critical path.
A prefill whose rows fit a captured shape (batch bucket x length bucket, at most `max_tokens` padded
tokens) replays that shape's graph instead:
  - each row is padded with token 0 past its length; the positions continue (0..L-1), so the padding's
    KV and features land beyond the row's valid length, where the row's next forward writes before
    anything reads them (a query at position p reads keys at positions <= p only);
  - padding rows feed the scratch slot, which no request owns.
Each shape's inputs are a StepBuffers (target_service/runner.py) of its own: one host-to-device copy per
prefill, like a verify step's.
Larger prefills (a burst of arrivals, a long prompt) run eagerly: their compute hides the launches.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from common.batch import CTX_ROUND
from common.cuda_graphs import buckets, capture
from common.distributed import add_comm_stats
from common.kernels.fused import eager_shapes

BATCHES = (1, 2, 4, 8)  # rows of a graphed prefill: arrivals per step are few
MIN_LENGTH = 16


class PrefillGraphs:
    """forward(input_ids [B, L], positions [B, L], slots [B], ctx_len) over every (batch, length) shape
    with batch * length <= max_tokens, replayed from CUDA graphs when `use_graphs` (else the same padded
    shapes run eagerly: the padding is then tested on the CPU too). new_buffers(batch, width): a StepBuffers
    for that shape."""

    def __init__(
        self,
        forward: Callable[[Tensor, Tensor, Tensor, int], object],
        new_buffers: Callable[[int, int], Any],
        max_len: int,
        max_tokens: int,
        device: torch.device,
        use_graphs: bool,
        pool=None,
    ):
        self.forward, self.new_buffers, self.max_len, self.device = forward, new_buffers, max_len, device
        self.use_graphs, self.pool = use_graphs and device.type == "cuda", pool
        self.lengths = [n for n in buckets(max_len, MIN_LENGTH) if n <= min(max_len, max_tokens)]
        self.shapes = {(b, n) for b in BATCHES for n in self.lengths if b * n <= max_tokens}
        self.graphs: dict[tuple[int, int], tuple] = {}
        self.inputs: dict[tuple[int, int], Any] = {}  # StepBuffers (runner.py imports this module)
        self.replays = 0  # prefills served from a graph (or, without graphs, from a padded shape)

    def shape_for(self, rows: list[list[int]]) -> tuple[int, int] | None:
        """The smallest captured (batch, length) that holds `rows`; None: run them eagerly."""
        if not rows or not self.lengths:
            return None
        b = BATCHES[bisect.bisect_left(BATCHES, len(rows))] if len(rows) <= BATCHES[-1] else None
        longest = max(len(r) for r in rows)
        i = bisect.bisect_left(self.lengths, longest)
        if b is None or i == len(self.lengths):
            return None
        shape = (b, self.lengths[i])
        return shape if shape in self.shapes else None

    def _ctx(self, length: int) -> int:
        return min(self.max_len, -(-length // CTX_ROUND) * CTX_ROUND)

    def buffers(self, shape: tuple[int, int]) -> Any:
        if shape not in self.inputs:
            self.inputs[shape] = self.new_buffers(*shape)
        return self.inputs[shape]

    def _run_forward(self, shape: tuple[int, int]) -> None:
        buf = self.buffers(shape)
        with eager_shapes():  # the kernel variants of an eager prefill: compiled at start-up
            self.forward(buf.view("input_ids"), buf.view("positions"), buf.view("slots"), self._ctx(shape[1]))

    @torch.inference_mode()
    def capture_all(self) -> int:
        """Captures every shape (on the GPU; on every TP rank: the forwards hold collectives)."""
        if not self.use_graphs:
            return 0
        for shape in sorted(self.shapes):
            if shape not in self.graphs:
                self.buffers(shape)  # outside the graph's memory pool
                self.graphs[shape] = capture(lambda s=shape: self._run_forward(s), self.device, self.pool)
        torch.cuda.synchronize(self.device)
        return len(self.graphs)

    @torch.inference_mode()
    def __call__(self, rows: list[list[int]], slots: list[int]) -> bool:
        """Prefills rows[b] into slots[b] at positions 0.. from a captured shape; False: none holds them
        (the caller prefills eagerly)."""
        shape = self.shape_for(rows)
        if shape is None:
            return False
        n = len(rows)
        self.buffers(shape).load(rows, [0] * n, slots, [0] * n, [0.0] * n)
        if shape in self.graphs:
            graph, _, per_replay = self.graphs[shape]
            graph.replay()
            add_comm_stats(per_replay)
        else:
            self._run_forward(shape)
        self.replays += 1
        return True
