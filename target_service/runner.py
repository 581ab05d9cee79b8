"""Target model execution on every TP rank: prefill, and the verify step as one graph replay.

A verify step is the (k+1)-position forward of every running request followed by the rejection kernel.
Both run from one CUDA graph per (batch bucket, width, context bucket), all captured at start-up, so a
step never pays for a capture or a Triton compile while serving (the kernels' launch constants depend on
the padded shape only, and every padded shape is warmed). The host packs a step's inputs into one pinned
buffer per dtype (one host-to-device copy each), replays, and reads back one small int32 tensor
[B, width + 2] (emitted tokens, accepted count, emitted count): one device-to-host copy per step.

Sampled requests with top-k / top-p, or with a sparse draft distribution q, need inputs whose shape
the graph does not fix: for those steps the rejection kernel runs again eagerly on the graph's logits.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np
import torch

from common.batch import pack
from common.cuda_graphs import buckets, capture, warm_eager_shapes
from common.distributed import Comm, add_comm_stats
from common.features import FeatureStore, parse_ints
from common.kernels import skinny
from common.kernels.fused import eager_shapes
from common.kernels.rejection import verify
from common.kernels.rejection_ref import verify_reference
from common.kv_cache import KVCache
from common.loader import load_service_model
from common.tp_executor import TPExecutor
from target_service.config import TargetConfig
from target_service.prefill import PrefillGraphs

log = logging.getLogger("specsplit.target")

INT_FIELDS = ("input_ids", "positions", "slots", "draft_ids", "num_draft", "seeds", "commit_len")
CTX_MIN = 256


@dataclass
class StepRow:
    """One request's row of a verify step (host values)."""

    last_token: int  # t_n, fed at position `start`
    drafts: list[int]  # d_1..d_k (k may be below the step's width - 1)
    start: int  # position of t_n = committed length - 1
    slot: int
    temperature: float
    seed: int
    top_k: int = 0
    top_p: float = 1.0
    topk_ids: list[int] | None = None  # sparse q: k * K ids (None: one-hot q at the drafted token)
    topk_probs: list[float] | None = None
    topk_width: int = 0


@dataclass
class StepResult:
    tokens: list[list[int]]  # emitted tokens per real row (accepted drafts + one more)
    accepted: list[int]
    gpu_seconds: float  # GPU time of the step (CUDA events; 0 on the CPU)
    # [Bp * width, V], row j of request b at b * width + j; a graph's static buffer: read it before the
    # next step (logprobs).
    logits: torch.Tensor | None = None
    # Seconds the host blocked until the step's GPU work was done: about gpu_seconds plus the time that
    # work queued behind other work on the GPU, such as a colocated draft's kernels (0 on the CPU).
    wait_seconds: float = 0.0
    # GPU time from the end of the previous step's GPU work (what `on_verified` queued included) to the
    # start of this step's (0 on the CPU, or for the first step): the GPU idle between the two.
    gap_seconds: float = 0.0


class StepBuffers:
    """A step's inputs for one (batch bucket, width): named int64 views and an fp32 view of one buffer.

    The graph reads the device buffer; `load` fills the pinned host mirror and issues one copy, so a
    step costs one host-to-device copy whatever its size (each copy is a driver call on the step's
    critical path: in a GPU profile two of them were ~10 % of the scheduler thread's samples).
    """

    def __init__(self, batch: int, width: int, scratch_slot: int, device: torch.device):
        self.batch, self.width = batch, width
        sizes = {
            "input_ids": batch * width,
            "positions": batch * width,
            "slots": batch,
            "draft_ids": batch * (width - 1),
            "num_draft": batch,
            "seeds": batch,
            "commit_len": batch,
        }
        self.offsets: dict[str, tuple[int, int]] = {}
        off = 0
        for name in INT_FIELDS:
            self.offsets[name] = (off, sizes[name])
            off += sizes[name]
        pin = device.type == "cuda"
        # int64 fields, then the fp32 temperatures, in one byte buffer (the fp32 tail padded to 8 bytes).
        nbytes = 8 * off + 8 * ((batch + 1) // 2)
        self.buffer = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.host_buffer = torch.zeros(nbytes, dtype=torch.uint8, pin_memory=pin) if pin else self.buffer
        self.ints, self.floats = self._split(self.buffer, off, batch)
        self.host_ints, self.host_floats = self._split(self.host_buffer, off, batch)
        self.scratch_slot = scratch_slot
        # numpy views of the host mirror, and the all-padding content of its int fields: `load` copies
        # the template and writes the real rows, with no array built per step (at B=1 the arrays built
        # per step were most of the load's time).
        self._host = self.host_ints.numpy()
        self._fields = {name: self._host[o : o + n] for name, (o, n) in self.offsets.items()}
        self._ids = self._fields["input_ids"].reshape(batch, width)
        self._pos = self._fields["positions"].reshape(batch, width)
        self._drafts = self._fields["draft_ids"].reshape(batch, width - 1)
        self._temps = self.host_floats.numpy()
        template = np.zeros(off, dtype=np.int64)
        o, n = self.offsets["positions"]
        template[o : o + n] = np.tile(np.arange(width, dtype=np.int64), batch)
        o, n = self.offsets["slots"]
        template[o : o + n] = scratch_slot
        o, n = self.offsets["draft_ids"]
        template[o : o + n] = -1
        self._template = template

    @staticmethod
    def _split(buffer: torch.Tensor, num_ints: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        ints = buffer[: 8 * num_ints].view(torch.int64)
        floats = buffer[8 * num_ints : 8 * num_ints + 4 * batch].view(torch.float32)
        return ints, floats

    def view(self, name: str) -> torch.Tensor:
        off, n = self.offsets[name]
        t = self.ints[off : off + n]
        if name in ("input_ids", "positions"):
            return t.view(self.batch, self.width)
        if name == "draft_ids":
            return t.view(self.batch, self.width - 1)
        return t

    def verify_args(self) -> tuple[torch.Tensor, ...]:
        """The rejection kernel's per-request inputs, in `verify`'s order after the logits."""
        return (self.view("draft_ids"), self.view("num_draft").to(torch.int32), self.floats,
                self.view("seeds"), self.view("commit_len"))  # fmt: skip

    def load(self, tokens: list[list[int]], starts: list[int], slots_in: list[int], seeds_in: list[int],
             temperatures: list[float]) -> None:  # fmt: skip
        """Row b feeds tokens[b] = [t_n, d_1..d_k] at positions starts[b].. into slot slots_in[b]. Pads to
        the bucket: padding rows feed token 0 into the scratch slot and draft nothing."""
        self._host[:] = self._template
        self._temps[:] = 0.0
        ids, drafts, num_draft = self._ids, self._drafts, self._fields["num_draft"]
        n, m = len(tokens), len(tokens[0])
        if n > 1 and all(len(row) == m for row in tokens):  # the common step: three array writes
            rect = np.array(tokens, dtype=np.int64)
            ids[:n, :m] = rect
            drafts[:n, : m - 1] = rect[:, 1:]
            num_draft[:n] = m - 1
        else:  # one row, or rows of different lengths (a k = 0 request beside speculating ones)
            for i, row in enumerate(tokens):
                ids[i, : len(row)] = row
                drafts[i, : len(row) - 1] = row[1:]
                num_draft[i] = len(row) - 1
        first = np.asarray(starts, dtype=np.int64)
        self._pos[:n] += first[:, None]
        self._fields["slots"][:n] = slots_in
        self._fields["seeds"][:n] = seeds_in
        self._fields["commit_len"][:n] = first + 1
        self._temps[:n] = temperatures
        if self.host_buffer is not self.buffer:
            self.buffer.copy_(self.host_buffer, non_blocking=True)


class TargetRunner:
    def __init__(self, comm: Comm, config: TargetConfig):
        self.config = config
        self.comm = comm
        self.device, self.model = load_service_model(config, comm)
        self.model.batch_invariant = config.batch_invariant  # before any graph is captured
        mc = self.model.config
        self.max_context = min(config.max_context_length, mc.max_position_embeddings)
        # Padding of a verify row may run k+1 positions past the longest allowed sequence.
        self.max_len = self.max_context + config.max_speculative_tokens + 2
        # One slot per request plus a scratch slot for the padded rows of static-shape steps.
        self.scratch_slot = config.max_batch_size
        self.cache = KVCache.for_model(self.model, config.max_batch_size + 1, self.max_len)
        # A feature draft's features: written by every forward (the graphs too), rank 0 hands them over.
        layers = parse_ints(config.draft_feature_layers, "--draft-feature-layers")
        if layers and comm.rank == 0:
            if max(layers) >= mc.num_hidden_layers:
                raise ValueError(f"--draft-feature-layers: {max(layers)} is not a layer of the target "
                                 f"(0..{mc.num_hidden_layers - 1})")  # fmt: skip
            p = self.model.model.embed_tokens.weight
            self.model.feature_store = FeatureStore(
                layers, mc.hidden_size, self.cache.num_slots, self.max_len, p.dtype, p.device
            )
        self.feature_store = self.model.feature_store  # what the draft session reads (rank 0)
        self.batch_buckets = buckets(config.max_batch_size)
        self.ctx_buckets = buckets(self.max_len, min(CTX_MIN, self.max_len))
        self.use_graphs = config.cuda_graphs and self.device.type == "cuda"
        on_gpu = self.device.type == "cuda" or _interpreting()
        backend = config.verify_backend
        if backend == "auto":
            backend = "triton" if on_gpu else "torch"
        self.verify_backend = backend
        self.verify_fn = verify if backend == "triton" else verify_reference
        # The rejection kernel joins the graph when it is the Triton one (the torch reference syncs).
        self.verify_in_graph = backend == "triton"
        self.buffers: dict[tuple[int, int], StepBuffers] = {}
        self.graphs: dict[tuple[int, int, int], tuple[Any, torch.Tensor, torch.Tensor | None, dict]] = {}
        self.pool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.captures_at_serving = 0
        self.serving = False
        self.out_host = (
            torch.zeros(self.batch_buckets[-1] * (config.max_speculative_tokens + 3), dtype=torch.int32,
                        pin_memory=True)
            if self.device.type == "cuda"
            else None
        )  # fmt: skip
        self.events = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self.device.type == "cuda"
            else None
        )
        # The end of each step's GPU work, two in turn: the gap to the next step's start is measured once
        # that step is done.
        self.step_ends = (
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            if self.device.type == "cuda"
            else None
        )
        self.steps_ended = 0
        # The stream the steps run on, looked up once: `Event.record()` without one finds the current
        # stream through torch.cuda.is_available() and an environment read, 13 % of the scheduler
        # thread's GIL samples at B=1 in a GPU profile.
        self.stream = torch.cuda.current_stream(self.device) if self.events is not None else None
        self.executor = TPExecutor(comm, {"prefill": self.prefill, "verify_step": self.verify_step})
        # Plain decoding (width 1) up to the default k: every width the scheduler produces by default.
        self.widths = list(range(1, config.num_speculative_tokens + 2))
        self.num_graphs = self.warm_up(self.widths)
        warm_eager_shapes(self.model, self.cache, self.scratch_slot)  # prefills of any length
        self.prefill_graphs = PrefillGraphs(
            lambda ids, pos, slots, ctx: self.model(ids, pos, slots, self.cache, ctx),
            partial(StepBuffers, scratch_slot=self.scratch_slot, device=self.device),
            self.max_len, config.prefill_graph_tokens, self.device, self.use_graphs, self.pool,
        )  # fmt: skip
        t0 = time.perf_counter()
        if self.use_graphs and (n := self.prefill_graphs.capture_all()) and comm.rank == 0:
            log.info("captured %d prefill graphs in %.1fs", n, time.perf_counter() - t0)
        # Timed on every rank: the graphs hold collectives, so all ranks must replay them together.
        self.step_costs = self.time_steps(self.widths)
        self.serving = True

    # -- graphs ------------------------------------------------------------------------------------------
    def _buffers(self, batch: int, width: int) -> StepBuffers:
        key = (batch, width)
        if key not in self.buffers:
            self.buffers[key] = StepBuffers(batch, width, self.scratch_slot, self.device)
        return self.buffers[key]

    def _forward(
        self, buf: StepBuffers, ctx: int, with_verify: bool = True
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Forward + logits (+ the rejection kernel): logits [B * W, V] (in the model's dtype where that
        is exact: every consumer reads them as fp32), packed [B, W + 2] int32."""
        hidden = self.model(buf.view("input_ids"), buf.view("positions"), buf.view("slots"), self.cache, ctx)
        logits = self.model.compute_logits(hidden.reshape(-1, hidden.shape[-1]), upcast=False)
        if not (self.verify_in_graph and with_verify):
            return logits, None
        return logits, _packed(verify(logits, *buf.verify_args()))

    def _capture(self, batch: int, width: int, ctx: int):
        buf = self._buffers(batch, width)
        graph, (logits, packed), per_replay = capture(lambda: self._forward(buf, ctx), self.device, self.pool)
        return graph, logits, packed, per_replay

    @torch.inference_mode()
    def warm_up(self, widths: list[int]) -> int:
        """One eager step on the scratch slot (kernels warm, every collective site counted once, so its
        metric series exist); on the GPU, captures every (batch bucket, width, context bucket)."""
        buf = self._buffers(1, 1)
        self._forward(buf, self.ctx_buckets[0])
        if not self.use_graphs:
            return 0
        t0 = time.perf_counter()
        for ctx in self.ctx_buckets:
            for batch in self.batch_buckets:
                for width in widths:
                    self.graphs[batch, width, ctx] = self._capture(batch, width, ctx)
        torch.cuda.synchronize(self.device)
        if self.comm.rank == 0:
            kernels = skinny.describe(next(self.model.parameters()))
            if self.model.batch_invariant:
                kernels = "--batch-invariant: one fixed-tile GEMM for every row count, fixed attention shapes"
            seconds = time.perf_counter() - t0
            log.info("captured %d verify graphs in %.1fs (%s)", len(self.graphs), seconds, kernels)
        return len(self.graphs)

    @torch.inference_mode()
    def time_steps(self, widths: list[int], repeats: int = 3) -> dict[tuple[int, int], float]:
        """Seconds of one verify step per (batch bucket, width), for the speculation policy's first
        decisions (real steps refine them). Timed like a real step: pack, copy, replay, read back, on
        the scratch slot at the smallest context bucket. On the CPU only batch 1, once."""
        costs = {}
        if not self.use_graphs:  # eager CPU steps are slow
            repeats = 1
        for batch in self.batch_buckets:
            if not self.use_graphs and batch > 1:
                break
            for width in widths:
                args = ([[0] * width] * batch, [0] * batch, [self.scratch_slot] * batch, [0] * batch,
                        [0.0] * batch, width)  # fmt: skip
                self._local_step(*args)
                t0 = time.perf_counter()
                for _ in range(repeats):
                    self._local_step(*args)
                costs[batch, width] = (time.perf_counter() - t0) / repeats
        return costs

    def _local_step(self, *args) -> list[list[int]]:
        _, packed, _ = self.verify_step(*args)
        return packed.tolist() if packed is not None else []

    # -- handlers (every rank) ---------------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, rows: list[list[int]], slots: list[int]) -> None:
        """Writes the KV of prompt tokens (all but the last, which the first verify step feeds): from a
        captured graph where one holds the rows (target_service/prefill.py), else eagerly."""
        if self.prefill_graphs.use_graphs and self.prefill_graphs(rows, slots):
            return
        batch = pack(rows, [0] * len(rows), slots, self.device, self.max_len)
        with eager_shapes():  # any prompt length: never a kernel compile while serving
            self.model(batch.input_ids, batch.positions, batch.slots, self.cache, batch.ctx_len)

    @torch.inference_mode()
    def verify_step(
        self,
        tokens: list[list[int]],
        starts: list[int],
        slots: list[int],
        seeds: list[int],
        temperatures: list[float],
        width: int,
        eager_verify: int = 0,  # an int, not a bool: the TP step message packs ints
    ) -> tuple[torch.Tensor, torch.Tensor | None, int]:
        """Runs the step's forward (and in-graph rejection kernel), padded to the buckets. Plain lists, so
        the TP executor sends them as one packed message. Row b: tokens[b] = [t_n, d_1..d_k] at positions
        starts[b]...

        Returns (logits [Bp * width, V], packed [Bp, width + 2] or None, Bp)."""
        padded = _bucket(self.batch_buckets, len(tokens))
        ctx_needed = max(starts) + width
        ctx = _bucket(self.ctx_buckets, ctx_needed)
        buf = self._buffers(padded, width)
        buf.load(tokens, starts, slots, seeds, temperatures)
        if not self.use_graphs:
            if self.events is not None:
                self.events[0].record(self.stream)
            # Eager steps skip the in-step kernel when rank 0 will run the eager one anyway.
            logits, packed = self._forward(buf, ctx, with_verify=not eager_verify)
            return logits, packed, padded
        key = (padded, width, ctx)
        if key not in self.graphs:  # a width past the default k: counted, logged, captured once
            self.captures_at_serving += 1
            log.warning("capturing a verify graph while serving: batch %d, width %d, context %d", *key)
            self.graphs[key] = self._capture(padded, width, ctx)
        graph, logits, packed, per_replay = self.graphs[key]
        if self.events is not None:
            # GPU time starts at the replay: host delays before it (packing, the GIL) are host time.
            self.events[0].record(self.stream)
        graph.replay()
        add_comm_stats(per_replay)
        return logits, packed, padded

    # -- rank 0 ------------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(
        self,
        rows: list[StepRow],
        width: int,
        on_launched: Callable[[], None] | None = None,
        on_verified: Callable[[torch.Tensor], None] | None = None,
    ) -> StepResult:
        """One verify step for `rows` (rank 0): emitted tokens and accepted counts per row. `on_launched`
        runs once the step's GPU work is queued, before the host waits for it; without CUDA graphs (the
        CPU) before the forward, which computes as it is called and lets other threads run meanwhile.
        `on_verified(packed)` gets the step's output on the device ([P, width + 2]: each row's emitted
        tokens, accepted count, emitted count) once its copy to the host is queued, before the host waits
        for it: GPU work queued there (the in-process draft's next round) runs while the host commits."""
        eager = any(r.top_k or r.top_p < 1.0 or r.topk_ids for r in rows)
        before = on_launched is not None and not self.use_graphs
        if before:
            on_launched()
        logits, packed, padded = self.executor.run(
            "verify_step",
            tokens=[[r.last_token, *r.drafts] for r in rows],
            starts=[r.start for r in rows],
            slots=[r.slot for r in rows],
            seeds=[r.seed for r in rows],
            temperatures=[float(r.temperature) for r in rows],
            width=width,
            eager_verify=int(eager),
        )
        if eager or packed is None:
            packed = self._verify_eager(rows, logits, padded, width)
        if on_launched is not None and not before:
            on_launched()
        n = len(rows)
        if self.out_host is not None:
            host = self.out_host[: padded * (width + 2)].view(padded, width + 2)
            host.copy_(packed, non_blocking=True)
            self.events[1].record(self.stream)
            if on_verified is not None:
                on_verified(packed)
            ended = self.steps_ended
            self.step_ends[ended % 2].record(self.stream)
            self.steps_ended += 1
            t0 = time.perf_counter()
            self.events[1].synchronize()
            wait = time.perf_counter() - t0
            gpu = self.events[0].elapsed_time(self.events[1]) / 1e3
            # The previous step's end came before this step's start on the stream: both are done.
            gap = self.step_ends[(ended - 1) % 2].elapsed_time(self.events[0]) / 1e3 if ended else 0.0
            out = host[:n].tolist()
        else:
            gpu = wait = gap = 0.0
            out = packed[:n].tolist()
            if on_verified is not None:
                on_verified(packed)
        tokens = [row[: row[-1]] for row in out]
        accepted = [row[-2] for row in out]
        return StepResult(tokens, accepted, gpu, logits, wait, gap)

    def _verify_eager(self, rows: list[StepRow], logits: torch.Tensor, padded: int, width: int):
        buf = self._buffers(padded, width)
        dev = self.device
        kwargs: dict[str, torch.Tensor] = {}
        if any(r.top_k for r in rows):
            kwargs["top_k"] = _padded([r.top_k for r in rows], padded, 0, torch.int32, dev)
        if any(r.top_p < 1.0 for r in rows):
            kwargs["top_p"] = _padded([r.top_p for r in rows], padded, 1.0, torch.float32, dev)
        widths = {r.topk_width for r in rows if r.topk_ids}
        if widths:
            # One sparse-q call for the whole batch: a greedy draft's q is one-hot, i.e. its token with
            # probability 1 in a top-K list of zeros.
            kq = max(widths)
            ids = np.zeros((padded, width - 1, kq), dtype=np.int64)
            probs = np.zeros((padded, width - 1, kq), dtype=np.float32)
            for i, r in enumerate(rows):
                k = len(r.drafts)
                if r.topk_ids:
                    w = r.topk_width
                    ids[i, :k, :w] = np.asarray(r.topk_ids[: k * w]).reshape(k, w)
                    probs[i, :k, :w] = np.asarray(r.topk_probs[: k * w]).reshape(k, w)
                else:
                    ids[i, :k, 0] = r.drafts
                    probs[i, :k, 0] = 1.0
            kwargs["draft_topk_ids"] = torch.from_numpy(ids).to(dev)
            kwargs["draft_topk_probs"] = torch.from_numpy(probs).to(dev)
        return _packed(self.verify_fn(logits, *buf.verify_args(), **kwargs))


def _packed(res) -> torch.Tensor:
    """A VerifyResult as one int32 [B, width + 2] tensor (tokens, accepted, emitted): one read-back."""
    return torch.cat(
        [res.output_tokens.int(), res.num_accepted.int()[:, None], res.num_emitted.int()[:, None]], 1
    )


def _bucket(values: list[int], n: int) -> int:
    for v in values:
        if v >= n:
            return v
    raise ValueError(f"{n} is past the largest bucket {values[-1]}")


def _padded(values: list, size: int, fill, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.tensor(values + [fill] * (size - len(values)), dtype=dtype, device=device)


def _interpreting() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET") == "1"


def tp_worker(comm: Comm, config: TargetConfig) -> TPExecutor:
    """Entry of TP ranks > 0 (a module-level function so that spawn can pickle it)."""
    return TargetRunner(comm, config).executor
