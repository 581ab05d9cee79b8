"""The draft model in the target's own process (`--draft-local`): one GPU, no gRPC between the two.

Two services on one GPU pay a gRPC round trip per speculative step on top of the draft's round (B=1: 2.31
ms from ask to answer for a 1.41 ms round; the rest is serialisation and thread hand-offs in both
processes), and their kernels take turns between two CUDA contexts. Here the draft service's own stream
logic (draft_service/stream.py: the same protocol, state, graphs and metrics) runs in the target's
process: on the scheduler's thread, called with each message (`inline`, the default), or, for a draft
that drafts ahead on this GPU (--draft-ahead-shared-gpu), on a thread of its own fed from a queue.
A draft on GPUs of its own (its round then overlaps the target's verify), a TP target, or a draft shared
by several targets need the draft service.
"""

from __future__ import annotations

import logging
import shlex
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from prometheus_client import CollectorRegistry

from common.config import ModelConfig
from common.distributed import init_tp
from common.features import FeatureStore
from common.kv_cache import SlotTable
from common.metrics import ServiceMetrics, start_metrics_server
from common.service import model_label, service_metrics
from common.settings import parse_config
from common.tp_executor import rank_device, tp_gpu_uuids
from draft_service.config import DraftConfig
from draft_service.rounds import ChainedRound
from draft_service.runner import DraftRunner
from draft_service.server import DraftServicer
from draft_service.state import DraftState
from draft_service.stream import DraftStream
from specsplit.v1 import draft_pb2
from target_service.config import TargetConfig
from target_service.draft_link import StreamLink

log = logging.getLogger("specsplit.target")

# A held ask (see LocalDraft.send) is handled after at most this long even if the target never says so.
HOLD_SECONDS = 0.05
# A chained round waits at most this long for the draft's thread to apply the verdicts sent before it.
HANDLED_SECONDS = 1.0


def local_draft_config(target: TargetConfig) -> DraftConfig:
    """The draft's config from --draft-local's flags (serve-draft's); device and dtype default to the
    target's. No SPECSPLIT_* variables: those are the target's. A bad flag exits naming --draft-local."""
    argv = ["--device", target.device, "--dtype", target.dtype, *shlex.split(target.draft_local)]
    return parse_config(DraftConfig, argv, "--draft-local", env=False)


def draft_feature_layers(model: str) -> str:
    """A feature draft's feature_layers as --draft-feature-layers takes them ("" for any other draft)."""
    path = Path(model)
    if not (path / "config.json").is_file():
        return ""
    layers = ModelConfig.from_pretrained(path).feature_layers
    return ",".join(map(str, layers or ()))


class LocalDraft(StreamLink):
    """The draft service's stream logic in this process: a StreamLink and an InProcessDraft
    (target_service/draft_link.py), the target's one module that imports draft_service."""

    in_process = True  # the scheduler streams no tokens while it waits for this draft's round

    def __init__(
        self,
        config: DraftConfig,
        metrics: ServiceMetrics,
        target_vocab_size: int,
        target_gpus: Sequence[str],
        features: FeatureStore | None = None,
    ):
        """Loads the draft and captures its graphs (before the target serves: a capture must not overlap
        the target's kernels); `metrics` are the target's, the draft's own go to their own registry."""
        super().__init__(metrics, target_vocab_size, target_gpus)
        if config.tp_size != 1:
            raise ValueError("--draft-local: the draft runs on the target's GPU, --tp-size must be 1")
        registry = CollectorRegistry()  # this process's default registry holds the target's series
        self.draft_metrics = service_metrics("draft", config, registry, method=config.method)
        try:
            runner = DraftRunner(init_tp(1, 0, device=rank_device(config.device, 0)), config, features)
        except (ValueError, FileNotFoundError) as exc:
            raise ValueError(f"--draft-local: cannot load the draft model: {exc}") from exc
        mc = runner.model.config
        max_target_id = runner.max_target_id()
        if max_target_id >= target_vocab_size:
            raise ValueError(f"--draft-local: the draft's vocabulary ({max_target_id + 1}) is larger than "
                             f"the target's ({target_vocab_size})")  # fmt: skip
        state = DraftState(runner, SlotTable(config.max_batch_size))
        self.draft = DraftServicer(config, state, self.draft_metrics, model_label(config), mc.vocab_size, 1,
                                   mc.markov_rank > 0, tp_gpu_uuids(config.device, 1))  # fmt: skip
        self.draft.max_target_id = max_target_id
        if runner.feature_layers:  # a feature draft reads the target's features where they are
            if features is None:
                raise ValueError("--draft-local: a feature draft needs the target's features "
                                 "(--draft-feature-layers)")  # fmt: skip
            self.draft.target_features = features
        self.info = self.draft.GetDraftInfo(draft_pb2.GetDraftInfoRequest(), None)
        self.metrics_port = -1
        try:
            if config.metrics_port >= 0:
                self.metrics_port = start_metrics_server(config.metrics_port, registry=registry)
        except OSError as exc:  # e.g. a draft service on this host already serves 9401
            raise ValueError(f"--draft-local: --metrics-port {config.metrics_port}: {exc}") from exc
        self.draft_metrics.ready.set(1)
        self.runner = runner
        self._stream: DraftStream | None = None  # the stream the draft's thread serves now
        self.chaining = True  # off after a chained round failed to launch
        self.chained: ChainedRound | None = None  # the latest chained round, until the next ask takes it
        self.chained_epoch = 0
        # Steps of the messages sent and of those the draft's thread has handled, and the one ask held
        # back (`send`): the target drafts from a chained round without waiting for the answer
        # (DraftSession), and the draft applies that ask's verdicts once the next verify is launched, not
        # while the scheduler launches it (both threads would want the GIL then).
        self._handled = threading.Condition()
        self._handled_step = self._sent_step = 0
        self._held_step = -1
        self._held = threading.Event()
        self._held.set()
        self._thread = threading.Thread(target=self._run, name="draft-local", daemon=True)
        # Inline (no draft-ahead on this GPU, the default): the stream logic runs on the caller's thread
        # (the scheduler's). Each hand-off between two threads waits for the GIL, up to a switch interval,
        # and the chained round waited for the draft's thread to apply the verdicts first: at B=1 those
        # waits left the GPU idle for about as long as the step's own work. A held ask's verdicts are
        # applied at the next chain, send or receive (once the next verify is queued, as on the thread).
        self.inline = not config.draft_ahead_shared_gpu
        # Held messages (inline), handled in order at the next chain, send or receive: the ask a chained
        # round answers, and new requests' starts (DraftSession.ask with warm=True).
        self._pending: list[draft_pb2.SpeculateRequest] = []
        self.queues_held = self.inline  # several messages may be held back at once
        self._reopen_at = 0.0  # inline: after a failed stream, when the next one opens
        self._backoff = 0.1
        log.info("draft in this process: %s (%s, %s, %d CUDA graphs), metrics port %d", self.info.model,
                 self.info.method, config.device, runner.graphs, self.metrics_port)  # fmt: skip

    def start(self) -> None:
        if self.inline:
            self.yield_after_send = False  # no other thread carries the message
            self._open_inline()
        else:
            self._thread.start()

    # -- inline: the stream on the caller's thread ---------------------------------------------------------
    def _open_inline(self) -> None:
        if self.epoch:  # a new stream after a failed one: counted as a gRPC link counts a reconnect
            self.metrics.draft_reconnects.inc()
        self._open_stream()
        self._stream = DraftStream(self.draft, "in-process")
        self._pending = []

    def _handle(self, msg: draft_pb2.SpeculateRequest, answer: bool) -> None:
        """One message through the stream now; its answer (if wanted) waits in the receive queue. A
        failure ends the stream as on the thread: plain decoding, a new stream after a backoff."""
        stream = self._stream
        if stream is None:
            return
        try:
            for response in stream.handle(msg, time.perf_counter(), answer=answer):
                if answer:
                    self._recv_q.put(response)
            self._handled_step = msg.step
            self._backoff = 0.1
        except Exception:  # the target must survive its draft
            log.exception("the in-process draft failed; plain decoding, a new stream in %.1f s",
                          self._backoff)  # fmt: skip
            self._stream = None
            self._pending = []
            stream.close()
            self._stream_ended()
            self._reopen_at = time.perf_counter() + self._backoff
            self._backoff = min(self._backoff * 2, 10.0)

    def _handle_pending(self) -> None:
        held, self._pending = self._pending, []
        for msg in held:
            self._handle(msg, answer=False)

    def _reopen(self) -> None:
        """Inline: a failed stream's successor opens at the first look past its backoff."""
        if self._stream is None and not self._closed.is_set() and time.perf_counter() >= self._reopen_at:
            self._open_inline()

    @property
    def connected(self) -> bool:
        if self.inline:
            self._reopen()
        return self._connected.is_set()

    def wait_connected(self, timeout: float) -> bool:
        if not self.inline:
            return super().wait_connected(timeout)
        deadline = time.perf_counter() + timeout
        while not self.connected and time.perf_counter() < deadline:
            time.sleep(min(0.01, max(0.0, self._reopen_at - time.perf_counter())))
        return self.connected

    def _send_inline(self, msg: draft_pb2.SpeculateRequest, epoch: int, hold: bool) -> bool:
        if not hold:
            self._handle_pending()
        if not self._prepare(msg, epoch):
            return False
        self._sent_step = msg.step
        if hold:
            self._pending.append(msg)
        else:
            self._handle(msg, answer=True)
        return True

    def send(self, msg: draft_pb2.SpeculateRequest, epoch: int, hold: bool = False) -> bool:
        """Queues one step's message. `hold`: its answer is not wanted (the target drafts from the chained
        round, `take_chained`), and the draft's thread handles it once the target next calls
        `chain`, `send` or `receive` (or after HOLD_SECONDS)."""
        if self.inline:
            return self._send_inline(msg, epoch, hold)
        self.release()
        if hold:
            self._held.clear()
            self._held_step = msg.step
        sent = super().send(msg, epoch)
        if sent:
            self._sent_step = msg.step
        elif hold:
            self.release()
        return sent

    def receive(self, step, epoch, deadline, on_branches=None):
        self.release()
        return super().receive(step, epoch, deadline, on_branches)

    def release(self) -> None:
        """The held ask may be handled now."""
        if self.inline:
            self._handle_pending()
        self._held.set()

    def take_chained(self, epoch: int) -> ChainedRound | None:
        """The round chained to the latest verify, once (None: none, or of an older stream)."""
        launched, self.chained = self.chained, None
        return launched if launched is not None and self.chained_epoch == epoch == self.epoch else None

    def chain(self, rows: list[tuple[int, int, list[int]]], packed, width: int, epoch: int) -> None:
        """Launches the next draft round of `rows` ((row in `packed`, draft id, verified drafts)) from the
        verify output `packed` on the device, before the verdict is sent (DraftState.chain). Called on the
        scheduler's thread once the verify is queued; the draft's thread takes the round with the
        verdict. A failure here costs the chained round only: the verdict then drafts as before."""
        self.release()
        self.chained = None
        stream = self._stream
        # A stream that drafts ahead (--draft-ahead-shared-gpu) has its next rounds from there.
        if stream is None or stream.ahead or epoch != self.epoch or not self.connected or not self.chaining:
            return
        # The round starts from the state the verdicts sent so far leave (a held ask's among them): the
        # draft's thread applies them while the GPU verifies.
        sent = self._sent_step
        if self.inline:
            self._handle_pending()
        with self._handled:
            caught_up = self._handled.wait_for(
                lambda: self._handled_step >= sent or epoch != self.epoch or not self.connected,
                HANDLED_SECONDS,
            )
        if not caught_up or epoch != self.epoch or not self.connected or self._stream is not stream:
            return
        try:
            with self.draft.engine_lock:
                launched = self.draft.state.chain(stream.reqs, rows, packed, width)
        except Exception:  # a bug: no more chained rounds, the draft's own rounds run (output unchanged)
            log.exception("a chained draft round failed to launch; no more chained rounds")
            self.chaining = False
            return
        if launched is not None:
            self.chained, self.chained_epoch = launched, epoch
            self.draft_metrics.draft_chained_rows.inc(len(launched.index))

    def close(self) -> None:
        super().close()
        if self.inline and self._stream is not None:
            self._handle_pending()
            self._stream.close()
            self._stream = None
        self.release()
        self.draft_metrics.ready.set(0)
        if self._thread.is_alive():
            self._thread.join(timeout=10)
        self.runner.executor.shutdown()

    def _run(self) -> None:
        """One stream at a time, fed from the send queue. A failure (a message the draft refuses, or its
        round raising) ends the stream as a lost connection would: the target decodes plainly, and the
        next stream (a new epoch: the target re-sends its requests) starts after a backoff."""
        backoff = 0.1
        while not self._closed.is_set():
            if self.epoch:  # a new stream after a failed one: counted as a gRPC link counts a reconnect
                self.metrics.draft_reconnects.inc()
            send_q = self._open_stream()
            stream = self._stream = DraftStream(self.draft, "in-process")
            try:
                for msg in iter(send_q.get, None):
                    held = msg.step == self._held_step
                    if held:
                        self._held.wait(HOLD_SECONDS)
                    for response in stream.handle(msg, time.perf_counter(), answer=not held):
                        if not held:  # a held ask's answer is not wanted
                            self._recv_q.put(response)
                    with self._handled:
                        self._handled_step = msg.step
                        self._handled.notify_all()
                    backoff = 0.1
                return  # closed
            except Exception:  # the target must survive its draft
                log.exception("the in-process draft failed; plain decoding, a new stream in %.1f s", backoff)
                self._stream_ended()
            finally:
                self._stream = None
                stream.close()
                with self._handled:  # a chained round waiting on this stream gives up
                    self._handled.notify_all()
            if self._closed.wait(backoff):
                return
            backoff = min(backoff * 2, 10.0)
