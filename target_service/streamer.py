"""The target's streamer thread: a step's new tokens to the clients' streams, off the step's critical path.

The scheduler hands each step's tokens over once the next step's forward is launched; this thread
detokenizes them, matches stop strings (a match marks the request, the scheduler finishes it at its next
step), holds what `--stream-interval` and `--stream-messages-per-step` hold back, and crosses to the
event loop once per hand-over (`common.aio_front.put_all`): the writes to the clients run there.
"""

from __future__ import annotations

import logging
import queue
import threading
import time

from common.aio_front import StreamOut, put_all
from common.metrics import ServiceMetrics
from specsplit.v1 import target_pb2
from target_service.request import FINISH, Request

log = logging.getLogger("specsplit.target")


class Streamer:
    """Detokenization, stop strings and client writes, on their own thread in step order.

    Every item for a request passes through one queue, so its chunks and its final message keep their
    order. A step's outputs arrive as one item and leave as one hand-off to the event loop (put_all),
    not one per request. A stop string found here ends the request: it is marked, and the scheduler
    finishes it at its next step (tokens verified meanwhile are never streamed).
    """

    def __init__(self, metrics: ServiceMetrics, on_done, interval: int = 1, per_step: int = 0):
        self.metrics = metrics
        self.on_done = on_done
        # A request's tokens leave once `interval` are ready (its first at once): at B=64 one write per
        # request per step costs the event loop more CPU than the rest of the step's host work.
        self.interval = interval
        # At most `per_step` messages per step (0: no limit), the requests that waited longest first; the
        # others keep their tokens for a later step (plain B=64 on the 1.5B preset: 4.6 ms of host time per
        # step with a message per request, 2.4 with one per four). Streams stay token by token up to
        # `per_step` requests, where --stream-interval chunks every stream at every batch size.
        self.per_step = per_step
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name="streamer", daemon=True)
        self._outbox: list[tuple[StreamOut, object]] = []

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.q.put(None)
        self.thread.join(timeout=30)

    def tokens(self, items: list[tuple[Request, list[int]]], now: float) -> None:
        """One step's new tokens, (request, ids) per request that has any."""
        if items:
            self.q.put(("tokens", items, now))

    def finish(self, req: Request, reason: int, usage: target_pb2.Usage, error: str) -> None:
        self.q.put(("finish", (req, reason, usage, error), time.perf_counter()))

    def _run(self) -> None:
        while True:
            item = self.q.get()
            done: list[Request] = []
            while item is not None:  # everything queued so far, then one hand-off to the loop
                self._handle(item, done)
                try:
                    item = self.q.get_nowait()
                except queue.Empty:
                    break
            put_all(self._outbox)
            self._outbox = []
            for req in done:
                self.on_done(req)
            if item is None:
                return

    def _handle(self, item: tuple, done: list[Request]) -> None:
        kind, payload, now = item
        if kind == "tokens":
            due = []
            for req, new in payload:
                try:
                    if self._push(req, new):
                        due.append(req)
                except Exception:  # a client-side failure must not stop the other streams
                    log.exception("streaming request %s failed", req.request_id)
            streamed = 0
            for req in self._within_limit(due):
                try:
                    streamed += self._send_held(req, now)
                except Exception:
                    log.exception("streaming request %s failed", req.request_id)
            self.metrics.generated_tokens.inc(streamed)
            return
        req = payload[0]
        try:
            self._finish(*payload, now)
        except Exception:
            log.exception("streaming request %s failed", req.request_id)
        done.append(req)

    def _push(self, req: Request, new: list[int]) -> bool:
        """Detokenizes `new` into the request's held tokens; returns whether they are due to be sent."""
        if req.cancelled == "stop_string":
            return False
        delta = req.detok.push(new)
        req.held_ids += delta.token_ids
        req.held_text += delta.text
        if delta.stopped:
            req.cancelled = "stop_string"
        # Interval 1 sends whatever the detokenizer released, text without ids too (as before the flag).
        due = self.interval == 1 or not req.first_token or len(req.held_ids) >= self.interval or delta.stopped
        return due and bool(req.held_ids or req.held_text)

    def _within_limit(self, due: list[Request]) -> list[Request]:
        """The due requests this step sends to (--stream-messages-per-step): a first token (time to first
        token) and a stop string's end (never flushed later) always; then those whose last message is the
        oldest."""
        if not self.per_step or len(due) <= self.per_step:
            return due
        must = [r for r in due if not r.first_token or r.cancelled == "stop_string"]
        rest = [r for r in due if r.first_token and r.cancelled != "stop_string"]
        rest.sort(key=lambda r: r.last_chunk)
        return must + rest[: max(0, self.per_step - len(must))]

    def _send_held(self, req: Request, now: float) -> int:
        """Sends the request's held tokens and text; returns how many tokens that was."""
        sent = len(req.held_ids)
        self._send(req, req.held_ids, req.held_text, now)
        req.held_ids, req.held_text = [], ""
        return sent

    def _finish(self, req: Request, reason: int, usage: target_pb2.Usage, error: str, now: float) -> None:
        if req.cancelled == "stop_string" and not error:
            reason = FINISH.FINISH_REASON_STOP_STRING
        elif not error and reason != FINISH.FINISH_REASON_ABORTED:
            rest = req.detok.flush()
            ids, text = req.held_ids + rest.token_ids, req.held_text + rest.text
            if ids or text:
                self._send(req, ids, text, now)
                self.metrics.generated_tokens.inc(len(ids))
        name = FINISH.Name(reason).removeprefix("FINISH_REASON_").lower()
        self.metrics.finished(name).inc()
        if reason != FINISH.FINISH_REASON_ABORTED or req.first_token:
            self.metrics.e2e_latency.observe(now - req.arrival)
        if req.first_token:
            self.metrics.observe_tpot(now - req.first_token, req.streamed)
        if error:
            self._outbox.append((req.out, RuntimeError(error)))
        elif req.cancelled != "client":
            usage.output_tokens = req.streamed
            last = target_pb2.GenerateResponse(request_id=req.request_id, finish_reason=reason, usage=usage)
            self._outbox.append((req.out, last))
        self._outbox.append((req.out, None))

    def _send(self, req: Request, ids: list[int], text: str, now: float) -> None:
        if not req.first_token:
            req.first_token = now
            self.metrics.ttft.observe(now - req.arrival)
        else:
            self.metrics.inter_token_latency.observe(now - req.last_chunk)
        req.last_chunk = now
        req.streamed += len(ids)
        logprobs, req.pending_logprobs[: len(ids)] = req.pending_logprobs[: len(ids)], []
        msg = target_pb2.GenerateResponse(request_id=req.request_id, token_ids=ids, text=text,
                                          logprobs=logprobs)  # fmt: skip
        self._outbox.append((req.out, msg))
