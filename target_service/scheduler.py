"""Continuous batching for the target: admit, prefill, speculate, verify, stream.

One loop on TP rank 0. Each step:
1. drop cancelled requests, admit waiting ones (prefill all prompt tokens but the last);
2. ask the draft for k tokens per request (one message for the whole batch), or use
   k = 0 when the draft is away, slow or the request opted out;
3. one verify forward over [t_n, d_1..d_k] for every running request;
4. the rejection kernel decides; new tokens are streamed at once and become the
   verdicts sent with the next step's draft message.
"""

from __future__ import annotations

import collections
import itertools
import logging
import os
import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from common.kernels.rejection import VerifyResult, verify
from common.kernels.rejection_ref import verify_reference
from common.kv_cache import SlotTable
from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2, sampling_pb2, target_pb2
from target_service.config import TargetConfig
from target_service.detok import StreamDetokenizer
from target_service.draft_link import DraftLink
from target_service.runner import TargetRunner

log = logging.getLogger("specsplit.target")

FINISH = target_pb2.FinishReason


def checked_proposal(
    p: draft_pb2.Proposal | None, k: int, vocab_size: int
) -> tuple[list[int], tuple[list[int], list[float], int] | None]:
    """A proposal's first k tokens and its sparse q, or nothing when it is malformed.

    A draft is a separate service: a proposal whose top-K lists do not match its tokens, or whose
    probabilities are not a distribution, is dropped (the request decodes plainly this step) instead
    of failing the batch or biasing the output.
    """
    if p is None or not p.token_ids or k == 0:
        return [], None
    tokens = list(p.token_ids[:k])
    if max(tokens) >= vocab_size:  # would index past the embedding table
        log.warning("dropping a draft proposal for request %d: token outside the vocabulary", p.request_id)
        return [], None
    if not p.top_k:
        return tokens, None
    width = p.top_k
    ids, probs = list(p.topk_ids), list(p.topk_probs)
    if len(ids) != len(probs) or len(ids) < len(tokens) * width or max(ids) >= vocab_size:
        log.warning(
            "dropping a malformed draft proposal for request %d: top-K lists do not match", p.request_id
        )
        return [], None
    for i, tok in enumerate(tokens):
        row, row_ids = probs[i * width : (i + 1) * width], ids[i * width : (i + 1) * width]
        if tok not in row_ids or not all(0.0 <= x <= 1.0 for x in row) or abs(sum(row) - 1.0) > 1e-3:
            log.warning("dropping a malformed draft proposal for request %d: q is not a distribution "
                        "containing the drafted token", p.request_id)  # fmt: skip
            return [], None
    return tokens, (ids[: len(tokens) * width], probs[: len(tokens) * width], width)


class QueueFull(Exception):
    pass


class NotAccepting(Exception):
    pass


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    k: int
    stop_ids: frozenset[int]
    detok: StreamDetokenizer
    draft_id: int = 0
    tokens: list[int] = field(default_factory=list)  # committed: prompt + output
    output: list[int] = field(default_factory=list)
    out: queue.Queue = field(default_factory=queue.Queue)  # GenerateResponse, then None
    slot: int = -1
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    first_token: float = 0.0
    last_chunk: float = 0.0
    cancelled: str = ""  # "", "client" or "abort"
    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    draft_synced: int = -1  # committed length the draft knows; -1: the draft has not seen it
    last_accepted: int = 0

    @property
    def sampling(self) -> sampling_pb2.SamplingParams:
        return sampling_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed
        )


class Scheduler:
    def __init__(
        self,
        runner: TargetRunner,
        config: TargetConfig,
        metrics: ServiceMetrics,
        link: DraftLink | None,
        eos_ids: frozenset[int],
    ):
        self.runner = runner
        self.config = config
        self.metrics = metrics
        self.link = link
        self.eos_ids = eos_ids
        self.slots = SlotTable(config.max_batch_size)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.by_id: dict[str, Request] = {}
        self.lock = threading.Condition()
        self.accepting = True
        self.stopped = threading.Event()
        self.step_no = 0
        self.link_epoch = 0
        self.draft_releases: list[int] = []
        self._draft_ids = itertools.count(1)
        self.verify_fn = self._pick_verify_backend()
        self.phase_seconds = dict.fromkeys(("draft", "forward", "verify", "commit"), 0.0)
        # Labelled series exist from the start, so rate() sees their first increase.
        for pos in range(config.max_speculative_tokens):
            metrics.accepted_at_position(pos)
        for reason in ("length", "eos", "stop_token", "stop_string", "aborted"):
            metrics.finished(reason)
        self.thread = threading.Thread(target=self._loop, name="scheduler", daemon=True)

    def _pick_verify_backend(self):
        backend = self.config.verify_backend
        if backend == "auto":
            on_gpu = self.runner.device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
            backend = "triton" if on_gpu else "torch"
        self.verify_backend = backend
        return verify if backend == "triton" else verify_reference

    # -- called from gRPC threads ------------------------------------------------
    def submit(self, req: Request) -> None:
        with self.lock:
            if not self.accepting:
                raise NotAccepting("the server is draining")
            if req.request_id in self.by_id:
                raise ValueError(f"request_id: {req.request_id!r} is already running")
            if len(self.waiting) >= self.config.max_queued_requests:
                raise QueueFull(f"queue full: {len(self.waiting)} requests waiting")
            req.draft_id = next(self._draft_ids)
            req.tokens = list(req.prompt)
            self.by_id[req.request_id] = req
            self.waiting.append(req)
            self.metrics.waiting.set(len(self.waiting))
            self.lock.notify()

    def cancel(self, request_id: str, reason: str) -> bool:
        with self.lock:
            req = self.by_id.get(request_id)
            if req is None:
                return False
            req.cancelled = req.cancelled or reason
            self.lock.notify()
            return True

    def stop_accepting(self) -> None:
        with self.lock:
            self.accepting = False

    def num_active(self) -> int:
        with self.lock:
            return len(self.waiting) + len(self.running)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.stopped.set()
        with self.lock:
            self.lock.notify()
        self.thread.join(timeout=30)

    # -- the loop ----------------------------------------------------------------
    def _loop(self) -> None:
        while not self.stopped.is_set():
            with self.lock:
                while not (self.waiting or self.running or self.draft_releases or self.stopped.is_set()):
                    self.lock.wait(timeout=0.5)
            try:
                self._drop_cancelled()
                self._admit()
                if self.running:
                    self._step()
                elif self.draft_releases:
                    self._release_on_draft()
            except Exception:  # keep serving; fail the requests of this step loudly
                log.exception("step failed; failing the running requests")
                for req in list(self.running):
                    self._finish(req, FINISH.FINISH_REASON_ABORTED, error="internal error in the step")
        with self.lock:
            for req in list(self.waiting) + list(self.running):
                self._finish(req, FINISH.FINISH_REASON_ABORTED, error="server stopped")

    def _drop_cancelled(self) -> None:
        with self.lock:
            gone = [r for r in itertools.chain(self.waiting, self.running) if r.cancelled]
        for req in gone:
            self._finish(req, FINISH.FINISH_REASON_ABORTED)

    def _admit(self) -> None:
        admitted = []
        with self.lock:
            while (
                self.waiting
                and len(self.running) + len(admitted) < self.config.max_batch_size
                and self.slots.num_free > 0
            ):
                req = self.waiting.popleft()
                req.slot = self.slots.alloc()
                req.admitted = time.perf_counter()
                admitted.append(req)
            self.metrics.waiting.set(len(self.waiting))
        if not admitted:
            return
        for req in admitted:
            self.metrics.queue_time.observe(req.admitted - req.arrival)
        needs_prefill = [r for r in admitted if len(r.prompt) > 1]
        if needs_prefill:
            self.runner.executor.run(
                "prefill", rows=[r.prompt[:-1] for r in needs_prefill], slots=[r.slot for r in needs_prefill]
            )
        for req in admitted:
            self.slots.lengths[req.slot] = len(req.prompt) - 1
        with self.lock:
            self.running.extend(admitted)
        self._update_gauges()

    def _update_gauges(self) -> None:
        self.metrics.running.set(len(self.running))
        self.metrics.batch_size.set(len(self.running))
        self.metrics.kv_slots_used.set(self.slots.num_used)

    # -- draft exchange ----------------------------------------------------------
    def _draft_message(
        self, batch: list[Request], want: list[Request], epoch: int
    ) -> draft_pb2.SpeculateRequest:
        if epoch != self.link_epoch:  # a new stream: the draft knows nothing
            self.link_epoch = epoch
            self.draft_releases.clear()
            for req in batch:
                req.draft_synced = -1
        msg = draft_pb2.SpeculateRequest(step=self.step_no, releases=self.draft_releases)
        self.draft_releases = []
        for req in batch:
            if req.draft_synced < 0:
                msg.starts.append(
                    draft_pb2.DraftRequestStart(
                        request_id=req.draft_id,
                        token_ids=req.tokens,
                        sampling=req.sampling,
                        num_speculative_tokens=req.k,
                    )
                )
            elif req.draft_synced < len(req.tokens):
                msg.verdicts.append(
                    draft_pb2.Verdict(
                        request_id=req.draft_id,
                        start=req.draft_synced,
                        token_ids=req.tokens[req.draft_synced :],
                        accepted=req.last_accepted,
                    )
                )
            req.draft_synced = len(req.tokens)
        msg.propose.extend(r.draft_id for r in want)
        return msg

    def _proposals(self, batch: list[Request]) -> dict[int, draft_pb2.Proposal]:
        """k tokens per request from the draft, or {} (plain decoding this step)."""
        link = self.link
        if link is None or not link.connected:
            if link is not None and any(r.k > 0 for r in batch):
                self.metrics.fallback_steps.inc()
            return {}
        max_ctx = self.runner.max_context
        want = [r for r in batch if r.k > 0 and len(r.tokens) + r.k < max_ctx]
        epoch = link.epoch
        msg = self._draft_message(batch, want, epoch)
        if not want and not (msg.starts or msg.verdicts or msg.releases):
            return {}
        response = link.exchange(msg, epoch, self.config.draft_timeout)
        if response is None:
            if want:
                self.metrics.fallback_steps.inc()
            if link.epoch == epoch and link.connected:
                log.warning("draft answered step %d too late; verified it with k = 0", self.step_no)
            return {}
        if response.unknown_request_ids:
            unknown = set(response.unknown_request_ids)
            for req in batch:
                if req.draft_id in unknown:
                    req.draft_synced = -1  # re-sent as a start next step
        return {p.request_id: p for p in response.proposals}

    def _release_on_draft(self) -> None:
        """Nothing is running: tell the draft to free the finished requests now, not at the next step."""
        if self.link is None or not self.link.connected:
            self.draft_releases.clear()
            return
        self.step_no += 1
        epoch = self.link.epoch
        msg = self._draft_message([], [], epoch)
        if msg.releases:
            self.link.exchange(msg, epoch, self.config.draft_timeout)

    # -- one step ----------------------------------------------------------------
    def _step(self) -> None:
        self.step_no += 1
        batch = list(self.running)
        t_start = time.perf_counter()
        proposals = self._proposals(batch)
        drafts: list[list[int]] = []
        sparse: list[tuple[list[int], list[float], int] | None] = []
        vocab = self.runner.model.config.vocab_size
        for req in batch:
            tokens, q = checked_proposal(proposals.get(req.draft_id), req.k, vocab)
            drafts.append(tokens)
            sparse.append(q)
        width = max(len(d) for d in drafts) + 1
        t0 = time.perf_counter()
        logits = self.runner.executor.run(
            "verify_forward",
            rows=[[r.tokens[-1], *d] for r, d in zip(batch, drafts)],
            starts=[len(r.tokens) - 1 for r in batch],
            slots=[r.slot for r in batch],
            width=width,
        )
        t_forward = time.perf_counter()
        results = self._verify(batch, drafts, sparse, logits, width)
        now = time.perf_counter()
        self.metrics.verify_step.observe(now - t0)
        for b, req in enumerate(batch):
            out_tokens, accepted = results[b]
            self._commit(req, drafts[b], out_tokens, accepted, now)
        self._profile(t_start, t0, t_forward, now, time.perf_counter())

    def _profile(self, *marks: float) -> None:
        """Mean time per step phase, logged at DEBUG every 256 steps (where a step's time goes)."""
        for i, phase in enumerate(("draft", "forward", "verify", "commit")):
            self.phase_seconds[phase] += marks[i + 1] - marks[i]
        if self.step_no % 256 == 0 and log.isEnabledFor(logging.DEBUG):
            log.debug(
                "mean ms per step over %d steps: %s",
                256,
                ", ".join(f"{k} {v / 256 * 1e3:.2f}" for k, v in self.phase_seconds.items()),
            )
            self.phase_seconds = dict.fromkeys(self.phase_seconds, 0.0)

    def _verify(self, batch, drafts, sparse, logits: torch.Tensor, width: int):
        """Runs the rejection kernel per q-kind group (one-hot vs sparse top-K); [(tokens, accepted)]."""
        device = logits.device
        logits = logits.view(len(batch), width, -1)
        groups: dict[int, list[int]] = {}
        for b, sp in enumerate(sparse):
            groups.setdefault(sp[2] if sp is not None else 0, []).append(b)
        results: list[tuple[list[int], int]] = [([], 0)] * len(batch)
        max_k = width - 1
        for top_k, idx in groups.items():
            reqs = [batch[b] for b in idx]
            # One host tensor per input, padded in Python: no per-row tensors on the step's path.
            draft_ids = torch.tensor([drafts[b] + [-1] * (max_k - len(drafts[b])) for b in idx],
                                     dtype=torch.int64).view(len(idx), max_k)  # fmt: skip
            kwargs = {}
            if top_k:
                pad = [0] * (max_k * top_k)
                ids = [(sparse[b][0] + pad)[: max_k * top_k] for b in idx]
                probs = [(sparse[b][1] + pad)[: max_k * top_k] for b in idx]
                shape = (len(idx), max_k, top_k)
                kwargs = {
                    "draft_topk_ids": torch.tensor(ids, dtype=torch.int64, device=device).view(shape),
                    "draft_topk_probs": torch.tensor(probs, dtype=torch.float32, device=device).view(shape),
                }
            group_logits = logits[idx] if len(idx) != len(batch) else logits
            res: VerifyResult = self.verify_fn(
                group_logits.reshape(len(idx) * width, -1),
                draft_ids.to(device),
                torch.tensor([len(drafts[b]) for b in idx], dtype=torch.int32, device=device),
                torch.tensor([r.temperature for r in reqs], dtype=torch.float32, device=device),
                torch.tensor([r.seed for r in reqs], dtype=torch.int64, device=device),
                torch.tensor([len(r.tokens) for r in reqs], dtype=torch.int64, device=device),
                top_k=torch.tensor([r.top_k for r in reqs], dtype=torch.int32, device=device)
                if any(r.top_k for r in reqs)
                else None,
                top_p=torch.tensor([r.top_p for r in reqs], dtype=torch.float32, device=device)
                if any(r.top_p < 1.0 for r in reqs)
                else None,
                **kwargs,
            )
            # One device-to-host copy (and sync) for all three outputs.
            packed = torch.cat([res.output_tokens, res.num_accepted[:, None], res.num_emitted[:, None]], 1)
            for b, (*out, accepted, emitted) in zip(idx, packed.tolist()):
                results[b] = (out[:emitted], accepted)
        return results

    def _commit(
        self, req: Request, drafted: list[int], out_tokens: list[int], accepted: int, now: float
    ) -> None:
        req.steps += 1
        req.drafted += len(drafted)
        req.accepted += accepted
        req.last_accepted = accepted
        if drafted:
            self.metrics.drafts.inc()
            self.metrics.draft_tokens.inc(len(drafted))
            self.metrics.accepted_tokens.inc(accepted)
            for pos in range(accepted):
                self.metrics.accepted_at_position(pos).inc()
        finish = FINISH.FINISH_REASON_UNSPECIFIED
        new: list[int] = []
        for tok in out_tokens:
            if tok in req.stop_ids:
                finish = FINISH.FINISH_REASON_EOS if tok in self.eos_ids else FINISH.FINISH_REASON_STOP_TOKEN
                break
            new.append(tok)
            if len(req.output) + len(new) >= req.max_new_tokens:
                finish = FINISH.FINISH_REASON_LENGTH
                break
        req.tokens.extend(out_tokens)  # the KV must match what the draft was told
        req.output.extend(new)
        self.slots.lengths[req.slot] = len(req.tokens) - 1
        delta = req.detok.push(new)
        if delta.stopped:
            finish = FINISH.FINISH_REASON_STOP_STRING
        if delta.token_ids or delta.text:
            self._send_chunk(req, delta.token_ids, delta.text, now)
        self.metrics.generated_tokens.inc(len(new))
        if finish != FINISH.FINISH_REASON_UNSPECIFIED:
            if finish != FINISH.FINISH_REASON_STOP_STRING:
                rest = req.detok.flush()
                if rest.token_ids or rest.text:
                    self._send_chunk(req, rest.token_ids, rest.text, now)
            self._finish(req, finish)

    def _send_chunk(self, req: Request, ids: list[int], text: str, now: float) -> None:
        if not req.first_token:
            req.first_token = now
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - req.last_chunk)
        req.last_chunk = now
        req.out.put(target_pb2.GenerateResponse(request_id=req.request_id, token_ids=ids, text=text))

    def _usage(self, req: Request) -> target_pb2.Usage:
        return target_pb2.Usage(
            prompt_tokens=len(req.prompt),
            output_tokens=len(req.output),
            drafted_tokens=req.drafted,
            accepted_tokens=req.accepted,
            steps=req.steps,
        )

    def _finish(self, req: Request, reason: int, error: str = "") -> None:
        with self.lock:
            if req in self.running:
                self.running.remove(req)
            elif req in self.waiting:
                self.waiting.remove(req)
            self.by_id.pop(req.request_id, None)
            if req.slot >= 0:
                self.slots.free(req.slot)
                req.slot = -1
            if req.draft_synced >= 0:
                self.draft_releases.append(req.draft_id)
            self.metrics.waiting.set(len(self.waiting))
        now = time.perf_counter()
        name = FINISH.Name(reason).removeprefix("FINISH_REASON_").lower()
        self.metrics.finished(name).inc()
        if reason != FINISH.FINISH_REASON_ABORTED or req.first_token:
            self.metrics.e2e_latency.observe(now - req.arrival)
        if req.first_token:
            self.metrics.observe_tpot(now - req.first_token, len(req.output))
        if error:
            req.out.put(RuntimeError(error))
        elif req.cancelled != "client":
            req.out.put(
                target_pb2.GenerateResponse(
                    request_id=req.request_id, finish_reason=reason, usage=self._usage(req)
                )
            )
        req.out.put(None)
        self._update_gauges()
