"""The target's side of the draft connection: one long-lived Speculate stream (DraftLink; a draft in the
target's own process, target_service/draft_local.py, is the same StreamLink without gRPC).

This is the target's one seam to the draft: the rest of target_service sees a StreamLink, and a draft in
this process through the `InProcessDraft` protocol below; only draft_local.py imports draft_service.

A background thread keeps the stream up and reconnects with exponential backoff.
Each new stream starts a new `epoch`: the draft lost all state, so the scheduler
re-sends every running request. `send` queues one step's message; `receive` waits for
the answer with the same step number; answers to older steps are dropped, so a stale
proposal is never applied.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import grpc

from common.grpc_util import CHANNEL_OPTIONS
from common.metrics import ServiceMetrics
from specsplit.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger("specsplit.target")

_STREAM_END = object()

# Given each branches message met while waiting for an answer; True: the caller needs no answer.
OnBranches = Callable[[draft_pb2.SpeculateResponse], bool]


class ChainedRound(Protocol):
    """A draft round launched from the verify's output on the device, for the next step (a draft in this
    process; draft_service.runner.ChainedRound)."""

    index: dict[int, int]  # draft id -> its row of the round

    def tokens(self, request_id: int, n: int) -> list[int]:
        """The first n tokens drafted for a request of the round (waiting for the GPU the first time)."""
        ...


class InProcessDraft(Protocol):
    """A StreamLink to a draft in the target's own process (target_service/draft_local.py's LocalDraft):
    it can launch the draft's next round from the verify output on the device (`chain`) and hold back
    the ask that round answers (`send(hold=True)`)."""

    in_process: bool  # True: it shares the scheduler's GIL
    queues_held: bool  # True: several messages may be held at once (handled in order at the next chain)
    epoch: int

    def send(self, msg: draft_pb2.SpeculateRequest, epoch: int, hold: bool = False) -> bool: ...

    def chain(self, rows: list[tuple[int, int, list[int]]], packed: Any, width: int, epoch: int) -> None:
        """The next round of `rows` ((row in `packed`, draft id, verified drafts)) from `packed`."""
        ...

    def take_chained(self, epoch: int) -> ChainedRound | None:
        """The round chained to the latest verify, once (None: none, or of an older stream)."""
        ...


class StreamLink:
    """One draft as the draft session sees it: `connected`, `epoch`, `send` (queue a step's message, never
    wait) and `receive` (the answer to a step). Each new stream starts a new epoch with fresh queues both
    ways; what carries the messages is the subclass's: gRPC (DraftLink) or a draft in this process
    (target_service/draft_local.py)."""

    def __init__(self, metrics: ServiceMetrics, target_vocab_size: int, target_gpus: Sequence[str] = ()):
        """`target_gpus`: the UUIDs of the GPUs of the target's TP group (common.tp_executor.tp_gpu_uuids),
        sent with target_vocab_size on each stream's first message."""
        self.metrics = metrics
        self.target_vocab_size = target_vocab_size
        self.target_gpus = list(target_gpus)
        self.yield_after_send = True
        self.epoch = 0
        self._connected = threading.Event()
        self._closed = threading.Event()
        self._send_q: queue.SimpleQueue | None = None
        self._recv_q: queue.SimpleQueue = queue.SimpleQueue()  # C queues: lighter hand-offs
        self._first_message = True
        self.info: draft_pb2.GetDraftInfoResponse | None = None

    @property
    def connected(self) -> bool:
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        return self._connected.wait(timeout)

    def close(self) -> None:
        self._closed.set()
        if self._send_q is not None:
            self._send_q.put(None)

    def _open_stream(self) -> queue.SimpleQueue:
        """A new stream's queues and epoch; returns the queue its sender reads (None ends it)."""
        send_q: queue.SimpleQueue = queue.SimpleQueue()
        self._recv_q = queue.SimpleQueue()
        self._send_q = send_q
        self._first_message = True
        self.epoch += 1
        self._connected.set()
        self.metrics.draft_connected.set(1)
        return send_q

    def _stream_ended(self) -> None:
        """The stream is gone: a waiting `receive` returns at once, and its sender stops."""
        self._connected.clear()
        self.metrics.draft_connected.set(0)
        self._recv_q.put(_STREAM_END)
        if self._send_q is not None:
            self._send_q.put(None)
            self._send_q = None

    def _count_sent(self, msg: draft_pb2.SpeculateRequest) -> None:
        """Counts a message as it is sent (gRPC's byte counters)."""

    def _prepare(self, msg: draft_pb2.SpeculateRequest, epoch: int) -> bool:
        """A message about to go on this epoch's stream: the first one's fields set, counted. False when
        not connected (or another epoch's)."""
        if not self.connected or epoch != self.epoch:
            return False
        if self._first_message:
            msg.target_vocab_size = self.target_vocab_size
            msg.target_gpus[:] = self.target_gpus
            self._first_message = False
        self._count_sent(msg)
        return True

    def send(self, msg: draft_pb2.SpeculateRequest, epoch: int) -> bool:
        """Queue one step's message on the stream without waiting; False when not connected."""
        send_q = self._send_q
        if send_q is None or not self._prepare(msg, epoch):
            return False
        send_q.put(msg)
        if self.yield_after_send:
            # The thread that carries the message (gRPC's request-iterator thread, or the in-process
            # draft's) needs the GIL for it. Without this the caller (the scheduler, streaming the step's
            # tokens next) and the streamer and event-loop threads it wakes can keep the GIL for up to a
            # switch interval each first.
            time.sleep(0)
        return True

    def receive(
        self, step: int, epoch: int, deadline: float, on_branches: OnBranches | None = None
    ) -> draft_pb2.SpeculateResponse | None:
        """The answer to `step`, or None (stream ended, epoch changed, deadline passed, or `on_branches`,
        given each branches message met on the way, returned True: the caller needs no answer). Answers to
        older steps (late ones, or to messages sent without waiting) are dropped, never applied."""
        recv_q = self._recv_q
        while epoch == self.epoch:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                return None
            try:
                response = recv_q.get(timeout=remaining)
            except queue.Empty:
                return None
            if response is _STREAM_END:
                return None
            if response.branches:
                if on_branches is not None and on_branches(response):
                    return None
                continue
            if response.step == step:
                return response
        return None


class DraftLink(StreamLink):
    """A draft service over one long-lived gRPC Speculate stream, reconnected with exponential backoff."""

    def __init__(
        self,
        address: str,
        metrics: ServiceMetrics,
        target_vocab_size: int,
        credentials: Callable[[], grpc.ChannelCredentials] | None = None,
        token: str | None = None,
        server_name: str | None = None,
        backoff_max: float = 10.0,
        *,
        target_gpus: Sequence[str] = (),
    ):
        super().__init__(metrics, target_vocab_size, target_gpus)
        self.address = address
        self.credentials = credentials
        self.metadata = (("authorization", f"Bearer {token}"),) if token else ()
        self.options = list(CHANNEL_OPTIONS)
        if server_name:
            self.options.append(("grpc.ssl_target_name_override", server_name))
        self.backoff_max = backoff_max
        self._call: grpc.Call | None = None
        self._thread = threading.Thread(target=self._run, name="draft-link", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        super().close()
        if self._call is not None:
            self._call.cancel()

    def _count_sent(self, msg: draft_pb2.SpeculateRequest) -> None:
        self.metrics.count_grpc_message("sent", "speculate_request", msg.ByteSize())

    def _channel(self) -> grpc.Channel:
        if self.credentials is not None:  # the current files: a renewed certificate from the next channel on
            return grpc.secure_channel(self.address, self.credentials(), options=self.options)
        return grpc.insecure_channel(self.address, options=self.options)

    def _run(self) -> None:
        backoff = 0.1
        was_connected = False
        last_error = ""
        while not self._closed.is_set():
            channel = self._channel()
            try:
                grpc.channel_ready_future(channel).result(timeout=max(backoff, 1.0))
                stub = draft_pb2_grpc.DraftServiceStub(channel)
                self.info = stub.GetDraftInfo(
                    draft_pb2.GetDraftInfoRequest(), metadata=self.metadata, timeout=10
                )
                send_q = self._open_stream()
                self._call = stub.Speculate(iter(send_q.get, None), metadata=self.metadata)
                call = self._call
                if was_connected:
                    self.metrics.draft_reconnects.inc()
                was_connected = True
                log.info(
                    "draft connected: %s (%s, tp=%d, epoch %d)",
                    self.address,
                    self.info.method,
                    self.info.tp_size,
                    self.epoch,
                )
                backoff = 0.1
                for response in call:
                    self.metrics.count_grpc_message("received", "speculate_response", response.ByteSize())
                    self._recv_q.put(response)
                raise grpc.RpcError("stream ended")
            except (grpc.RpcError, grpc.FutureTimeoutError) as exc:
                if isinstance(exc, grpc.Call):
                    detail = f"{exc.code().name}: {exc.details()}"
                else:
                    detail = str(exc) or "not reachable"
                if self._connected.is_set():
                    log.warning("draft lost: %s (%s); plain decoding until it is back", self.address, detail)
                elif detail != last_error:
                    log.warning("draft %s unavailable (%s); retrying with backoff", self.address, detail)
                last_error = detail
                self._stream_ended()
                channel.close()
                if self._closed.wait(backoff):
                    return
                backoff = min(backoff * 2, self.backoff_max)
