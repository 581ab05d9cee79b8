"""Greedy draft rounds as CUDA graph replays, on every TP rank (`GreedyRounds`), and their results.

A round feeds each request's pending tokens (committed tokens whose KV the draft does not hold yet) in
one padded forward, then drafts k tokens one position at a time on the device. A chained round
(`launch_chained`) is fed from the target's verify output on the device, before its verdict reaches the
host (the draft in the target's process). The runner that owns the model and cache is
draft_service/runner.py; a feature draft's rounds subclass these (draft_service/feature_rounds.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from common.batch import pack
from common.cuda_graphs import StaticStep, buckets, capture, copy_from_host, to_device
from common.distributed import add_comm_stats
from common.kernels.fused import eager_shapes

log = logging.getLogger("specsplit.draft")

# The widths a catch-up runs at from CUDA graphs (its tokens padded up to one; longer ones take several
# replays of the widest). A catch-up is the first round after the target's plain steps (every token
# since) or a new request's prompt. Eagerly it costs 2-20 ms of host-bound launches (8-15 ms more the first
# time a shape comes up), which the target waits for whole each time its policy turns speculation back on.
CATCH_UP_WIDTHS = (4, 16, 64)
# Past this many tokens (a long prompt) one eager forward beats the replays.
EAGER_CATCH_UP = 512
# A round whose shape has no graph of its own replays a captured one that drafts more positions (the first
# k are the same tokens), or else runs eagerly (a few ms); only a shape asked for this many times is
# captured while serving. A capture stalls the step by 0.1-1 s: a policy trying k = 1..3 once each, or
# one long catch-up, would otherwise pay it on the critical path.
CAPTURE_AFTER = 16


class ChainedRound:
    """The result of `GreedyRounds.launch_chained`: per chained row, k drafted tokens, the two tokens the
    round was fed and the position of the first (read once, waiting for the GPU the first time)."""

    def __init__(self, out: torch.Tensor, events: tuple[torch.cuda.Event, torch.cuda.Event] | None, k: int):
        self._out, self._events, self.k = out, events, k  # k: tokens drafted per row
        self._rows: list[list[int]] | None = None
        self.gpu_seconds: float | None = None  # the round's GPU time, once read (CUDA only)
        self.timed = False  # its GPU time went to the draft's round metric
        self.index: dict[int, int] = {}  # request id -> its row (DraftState.chain)

    def tokens(self, request_id: int, n: int) -> list[int]:
        """The first n tokens drafted for a request of the round (waiting for the GPU the first time)."""
        return self.row(self.index[request_id])[: min(n, self.k)]

    def row(self, b: int) -> list[int]:
        if self._rows is None:
            if self._events is not None:
                self._events[1].synchronize()
                self.gpu_seconds = self._events[0].elapsed_time(self._events[1]) / 1e3
            self._rows = self._out.tolist()
        return self._rows[b]


@dataclass
class RoundOutput:
    tokens: list[list[int]]  # [B][k] target-vocab ids
    topk_ids: list[list[int]] | None = None  # [B][k*K] (sampled rows only, else empty)
    topk_probs: list[list[float]] | None = None
    seconds: list[list[int]] | None = None  # [B][k] the draft's second choice at each position (branches)


class GreedyRounds:
    """A whole greedy draft round as one CUDA graph replay: the catch-up forward over each request's
    pending tokens (1 or 2 after a verdict), then k one-token positions, each fed the previous position's
    token on the device. One graph per (batch bucket, catch-up width, k, context bucket); the round
    reads back one [B, k] tensor. Longer catch-ups (a new request, plain steps of the target) run their
    extra tokens first, from graphs of CATCH_UP_WIDTHS (`_catch_up`). Without graphs (the CPU) the same
    functions run eagerly.
    """

    def __init__(self, runner: Any, max_batch: int, max_rows: int, use_graphs: bool):
        self.runner = runner
        self.device = runner.device
        self.scratch_slot = max_batch
        self.batch_buckets = buckets(max_rows)
        self.ctx_buckets = buckets(runner.max_len, min(256, runner.max_len))
        self.widths = (1, 2)
        self.pair = torch.arange(2, device=self.device)  # a chained round's two positions, past its start
        self.use_graphs = use_graphs and self.device.type == "cuda"
        self.graphs: dict[tuple[int, int, int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.stand_ins: dict[tuple[int, int, int, int], list[tuple[int, int, int, int]]] = {}
        self.misses: dict[tuple[int, int, int, int], int] = {}
        self.eager_rounds = self.serving_captures = 0  # rounds with no graph: run eagerly, captured
        self.inputs: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        # Catch-ups are requests' own rows (never branch rows): batch buckets up to max_batch.
        self.catch_up = StaticStep(self._catch_up_forward, max_batch, runner.max_len, self.scratch_slot,
                                   self.device, self.use_graphs, copy_output=False)  # fmt: skip

    def eager_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, ctx: int):
        """The forward a catch-up runs (warmed for every eager shape at start-up)."""
        return self._catch_up_forward(ids, pos, slots, ctx)

    def _catch_up_forward(self, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor, ctx: int):
        """ids/pos [B, W], slots [B]: writes the KV of the tokens (the hidden states are not needed)."""
        return self.runner.model(ids, pos, slots, self.runner.cache, ctx)

    def _static(self, batch: int, width: int) -> dict[str, torch.Tensor]:
        """input_ids/positions [batch, width], slots/last_index/prefix_slots/prefix_len [batch] (branch rows:
        positions < prefix_len come from prefix_slots; the row's own slot only where 0), all views of
        "flat" in that order, which `run` fills with one copy."""
        key = (batch, width)
        if key not in self.inputs:
            m = batch * width
            flat = torch.zeros(2 * m + 4 * batch, dtype=torch.int64, device=self.device)
            ids, pos, rest = flat[:m].view(batch, width), flat[m : 2 * m].view(batch, width), flat[2 * m :]
            slots, last_index, prefix_slots, prefix_len = rest.view(4, batch)
            pos.copy_(torch.arange(width, device=self.device).repeat(batch, 1))
            slots.fill_(self.scratch_slot)
            prefix_slots.fill_(self.scratch_slot)
            self.inputs[key] = {"flat": flat, "input_ids": ids, "positions": pos, "slots": slots,
                                "last_index": last_index, "prefix_slots": prefix_slots,
                                "prefix_len": prefix_len}  # fmt: skip
        return self.inputs[key]

    def round(self, x: dict[str, torch.Tensor], k: int, ctx: int) -> torch.Tensor:
        """input_ids/positions [B, W], slots/last_index/prefix_slots/prefix_len [B] -> k drafted target-vocab
        ids [B, k], followed by the k second choices ([B, 2k]) when branches are on."""
        r = self.runner
        model = r.model
        prefix = (x["prefix_slots"], x["prefix_len"]) if r.top2 else None
        hidden = model(x["input_ids"], x["positions"], x["slots"], r.cache, ctx, prefix)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        hidden = hidden[rows, x["last_index"]]
        prev = x["input_ids"][rows, x["last_index"]]
        pos = x["positions"][rows, x["last_index"]]
        drafted, seconds = [], []
        for j in range(k):
            best, second = r.pick_greedy(hidden, prev)
            token = model.map_to_target(best)
            drafted.append(token)
            if second is not None:
                seconds.append(model.map_to_target(second))
            if j == k - 1:
                break
            pos = pos + 1
            hidden = model(token[:, None], pos[:, None], x["slots"], r.cache, ctx, prefix)[:, 0]
            prev = token
        return torch.stack(drafted + seconds, dim=1)

    def _capture(self, batch: int, width: int, k: int, ctx: int):
        static = self._static(batch, width)
        return capture(lambda: self.round(static, k, ctx), self.device, self.pool)

    @torch.inference_mode()
    def warm_up(self, ks, widths, capture_graphs: bool) -> int:
        """One eager round on the scratch slot (kernels warm, every collective site counted once, so its
        metric series exist); on the GPU, captures every (batch bucket, width, k, context bucket)."""
        self.round(self._static(1, 1), 1, self.ctx_buckets[0])
        if not (self.use_graphs and capture_graphs):
            return 0
        self.catch_up.warm_up(list(CATCH_UP_WIDTHS))
        for ctx in self.ctx_buckets:
            for batch in self.batch_buckets:
                for width in widths:
                    for k in ks:
                        self.graphs[batch, width, k, ctx] = self._capture(batch, width, k, ctx)
        torch.cuda.synchronize(self.device)
        return len(self.graphs) + len(self.catch_up.graphs)

    def write_kv(self, rows: list[list[int]], slots: list[int]) -> None:
        """The KV of every token of rows[b] (all of them: none is left for a round) at positions 0.."""
        # `_catch_up` leaves each row's last token to the round: a padding token takes that place.
        self._catch_up([[*row, 0] for row in rows], [0] * len(rows), slots)

    def _catch_up(self, rows: list[list[int]], starts: list[int], slots: list[int]) -> None:
        """Writes the KV of every row's pending tokens but the last (which the round feeds). Chunks of
        the widest CATCH_UP_WIDTHS, the last one padded to the narrowest that holds the longest rest.
        Padding continues a row's positions (clamped to the cache), so its KV lands past the row's
        tokens, where nothing reads it before the row's own tokens overwrite it."""
        r = self.runner
        early = [(row[:-1], s, slot) for row, s, slot in zip(rows, starts, slots) if len(row) > 1]
        if max(len(e[0]) for e in early) > EAGER_CATCH_UP:
            batch = pack([e[0] for e in early], [e[1] for e in early], [e[2] for e in early], self.device,
                         r.max_len)  # fmt: skip
            with eager_shapes():
                self._catch_up_forward(batch.input_ids, batch.positions, batch.slots, batch.ctx_len)
            return
        # Every chunk's inputs in one host array and one copy: built per chunk from Python lists they
        # cost more host time than the chunks' GPU time (B=64, 241 tokens: 13.8 ms for 7.0 ms of kernels).
        lens = np.array([len(e[0]) for e in early])
        first = np.array([e[1] for e in early])
        slot_ids = np.array([e[2] for e in early])
        widths, rest = [], int(lens.max())
        while rest > 0:
            widths.append(next((w for w in CATCH_UP_WIDTHS if w >= rest), CATCH_UP_WIDTHS[-1]))
            rest -= widths[-1]
        tokens = np.zeros((len(early), sum(widths)), dtype=np.int64)
        for i, (toks, _, _) in enumerate(early):
            tokens[i, : len(toks)] = toks
        parts, chunks, done = [], [], 0
        for width in widths:
            live = np.nonzero(lens > done)[0]
            positions = np.minimum(first[live, None] + done + np.arange(width), r.max_len - 1)
            parts += [tokens[live, done : done + width].ravel(), positions.ravel(), slot_ids[live]]
            chunks.append((len(live), width, min(r.max_len, int(first[live].max()) + done + width)))
            done += width
        flat = to_device(torch.from_numpy(np.concatenate(parts)), self.device)
        at = 0
        for n, width, ctx in chunks:
            m = n * width
            ids, pos = flat[at : at + m].view(n, width), flat[at + m : at + 2 * m].view(n, width)
            self.catch_up(ids, pos, flat[at + 2 * m : at + 2 * m + n], ctx)
            at += 2 * m + n

    @torch.inference_mode()
    def run(
        self,
        rows: list[list[int]],
        starts: list[int],
        slots: list[int],
        k: int,
        prefix_slots: list[int] | None = None,
        prefix_len: list[int] | None = None,
    ) -> tuple[list[list[int]], list[list[int]] | None]:
        """rows[b]: pending target-vocab ids appended at starts[b]; returns k greedy draft tokens per row
        (and their second choices with branches on). Branch rows have prefix_len > 0 and width 1."""
        r = self.runner
        starts = list(starts)
        prefix_slots = list(prefix_slots) if prefix_slots else list(slots)
        prefix_len = list(prefix_len) if prefix_len else [0] * len(rows)
        if any(len(row) > self.widths[-1] for row in rows):  # long catch-ups: all but the last token
            self._catch_up(rows, starts, slots)
            starts = [s + len(row) - 1 for row, s in zip(rows, starts)]
            rows = [row[-1:] for row in rows]
        n = len(rows)
        width = max(len(row) for row in rows)
        padded = next(b for b in self.batch_buckets if b >= n) if n <= self.batch_buckets[-1] else n
        ctx_needed = max(s + width for s in starts) + k
        ctx = next((c for c in self.ctx_buckets if c >= ctx_needed), self.ctx_buckets[-1])
        static = self._static(padded, width)
        ids = [row + [0] * (width - len(row)) for row in rows] + [[0] * width] * (padded - n)
        pos = [[s + j for j in range(width)] for s in starts] + [list(range(width))] * (padded - n)
        pad = padded - n
        host = torch.tensor(
            [x for row in ids for x in row] + [x for row in pos for x in row]
            + list(slots) + [self.scratch_slot] * pad
            + [len(row) - 1 for row in rows] + [0] * pad
            + prefix_slots + [self.scratch_slot] * pad + prefix_len + [0] * pad,
            dtype=torch.int64,
        )  # fmt: skip
        copy_from_host(static["flat"], host)
        out = self._replay(static, padded, width, k, ctx, ctx_needed)[:n].tolist()
        if not r.top2:
            return out, None
        return [row[:k] for row in out], [row[k:] for row in out]

    def _replay(
        self, static: dict[str, torch.Tensor], padded: int, width: int, k: int, ctx: int, needed: int
    ) -> torch.Tensor:
        """The round on `static`'s inputs (`needed`: the context its k positions reach) -> [padded, k] (or
        [padded, 2k] with branches) on the device, not synchronised: its graph's replay, a graph that
        drafts more positions (sliced), an eager round, or (CAPTURE_AFTER misses on) a new graph."""
        if not self.use_graphs:
            return self.round(static, k, ctx)
        key = (padded, width, k, ctx)
        found = key if key in self.graphs else self._stand_in(key, needed)
        if found is None:
            self.misses[key] = self.misses.get(key, 0) + 1
            if self.misses[key] < CAPTURE_AFTER:
                self.eager_rounds += 1
                with eager_shapes():
                    return self.round(static, k, ctx)
            self.serving_captures += 1
            log.warning("capturing a draft round graph while serving: batch %d, width %d, k %d, "
                        "context %d", *key)  # fmt: skip
            self.graphs[key] = self._capture(padded, width, k, ctx)
            self.stand_ins.clear()
            found = key
        graph, result, per_replay = self.graphs[found]
        graph.replay()
        add_comm_stats(per_replay)
        wider = found[2]
        if wider == k:
            return result
        if self.runner.top2:  # drafted, then second choices
            return torch.cat([result[:, :k], result[:, wider : wider + k]], dim=1)
        return result[:, :k]

    def _stand_in(self, key: tuple[int, int, int, int], needed: int) -> tuple[int, int, int, int] | None:
        """The captured graph that serves `key` (`stand_in`; its candidates memoised per key)."""
        if key not in self.stand_ins:
            self.stand_ins[key] = wider_graphs(self.graphs, key)
        return stand_in(self.stand_ins[key], key[2], needed, self.runner.max_len)

    @torch.inference_mode()
    def launch_chained(
        self,
        packed: torch.Tensor,
        width: int,
        index: list[int],
        bases: list[int],
        extras: list[int],
        slots: list[int],
        k: int,
    ) -> ChainedRound:
        """The next greedy round of some requests, fed from the target's verify output on the device and
        launched before that output reaches the host (--draft-local: the round runs while the target
        commits the step). No host synchronisation here.

        packed [P, width + 2] int32 or int64 (the target's verify output: row i's emitted tokens, -1 past
        them, then its accepted count, then the emitted count); for chained row b: index[b] its row in
        `packed`, bases[b] its committed length before the verdict (its drafts sit at positions
        bases[b]..), extras[b] how many of its drafted tokens' KV the draft's slot holds past the committed
        ones, slots[b] its slot. After
        a accepted drafts the slot's KV is valid up to m = min(a, extra) positions past the base, so the
        round's pending tokens are the emitted ones from m: the bonus token alone (a <= extra) or the
        last accepted draft and the bonus token (a = extra + 1: width 2, last_index 1)."""
        n = len(index)
        events = self._start_timing()
        padded = next(b for b in self.batch_buckets if b >= n)
        max_len = self.runner.max_len
        ctx_needed = max(bases) + width + k + 1
        ctx = next((c for c in self.ctx_buckets if c >= ctx_needed), self.ctx_buckets[-1])
        static = self._static(padded, 2)
        info = torch.tensor([index, bases, extras, slots], dtype=torch.int64)
        idx, base, extra, slot = to_device(info, self.device)
        rows = packed[idx]  # [n, width + 2]
        accepted = rows[:, width]
        m = torch.minimum(accepted, extra)
        first = rows.gather(1, m[:, None])
        second = rows.gather(1, (m + 1).clamp(max=width - 1)[:, None])
        second = torch.where((accepted > m)[:, None], second, 0)  # padding (past the emitted ones: -1)
        start = base + m
        static["input_ids"][:n] = torch.cat([first, second], dim=1)
        static["input_ids"][n:] = 0
        static["positions"][:n] = (start[:, None] + self.pair).clamp(max=max_len - 1)
        static["positions"][n:] = self.pair
        static["last_index"][:n] = accepted - m
        static["last_index"][n:] = 0
        for name in ("slots", "prefix_slots"):
            static[name][:n] = slot
            static[name][n:] = self.scratch_slot
        static["prefix_len"].zero_()
        result = self._replay(static, padded, 2, k, ctx, ctx_needed)[:n, :k]
        # What the round was fed goes back with its tokens: the verdict that reaches the draft later must
        # say the same (DraftState.apply_verdict checks it before it uses the round).
        out = torch.cat([result, static["input_ids"][:n], start[:, None]], dim=1)
        return self._chained_result(out, events, k)

    def _start_timing(self) -> tuple[torch.cuda.Event, torch.cuda.Event] | None:
        """A chained round's GPU timing: its start recorded now (None on the CPU)."""
        if self.device.type != "cuda":
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record(torch.cuda.current_stream(self.device))
        return events

    def _chained_result(self, out: torch.Tensor, events, k: int) -> ChainedRound:
        """out [n, ...] on the device -> a ChainedRound reading it once from pinned memory (no sync here)."""
        if events is None:
            return ChainedRound(out, None, k)
        host = torch.empty(out.shape, dtype=out.dtype, pin_memory=True)
        host.copy_(out, non_blocking=True)
        events[1].record(torch.cuda.current_stream(self.device))
        return ChainedRound(host, events, k)


def wider_graphs(graphs, key: tuple[int, int, int, int]) -> list[tuple[int, int, int, int]]:
    """The `graphs` keys (batch, width, k, ctx) of the same batch and width as `key` drafting more than its
    k positions, fewest positions first, then the smallest context."""
    batch, width, k, _ = key
    return sorted(
        (g for g in graphs if g[0] == batch and g[1] == width and g[2] > k), key=lambda g: (g[2], g[3])
    )


def stand_in(candidates, k: int, needed: int, max_len: int) -> tuple[int, int, int, int] | None:
    """The first of `candidates` (wider_graphs) whose context holds its k2 - k extra positions past
    `needed` within max_len (its KV writes stay inside the cache), or None. Its first k drafted tokens are
    the round's: each position depends only on the positions before it."""
    return next((g for g in candidates if needed + g[2] - k <= min(g[3], max_len)), None)
