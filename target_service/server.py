"""The target service's client-facing gRPC API (TP rank 0), served by grpc.aio.

Every RPC is a coroutine on the front's one event loop (common.aio_front), so open streams cost no
thread: one process holds thousands of queued and streaming requests. The scheduler thread hands each
request's outputs over through `put_all` into its `req.out` (a StreamOut: thread-safe, bounded backlog).
"""

from __future__ import annotations

import asyncio
import math
import secrets
from typing import Any

import grpc

from common.aio_front import StreamOut
from common.metrics import ServiceMetrics
from common.service import LOADING
from common.tokenizer import ChatTemplateError
from specsplit.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.detok import StreamDetokenizer
from target_service.logprobs import MAX_LOGPROBS
from target_service.scheduler import NotAccepting, QueueFull, Request, Scheduler

MAX_REQUEST_ID = 128
CHAT_ROLES = ("system", "user", "assistant", "tool")
INLINE_TEXT = 4096  # longer text prompts (and chat templates) are tokenized off the event loop


class InvalidRequest(Exception):
    """The message starts with the offending field's name."""


_NOTHING = object()


def _is_chunk(item: Any) -> bool:
    """A message that only carries tokens (no finish reason, no usage): mergeable with the next one."""
    if not isinstance(item, target_pb2.GenerateResponse):
        return False
    return not item.finish_reason and not item.HasField("usage")


class _Rejected(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class TargetServicer(target_pb2_grpc.TargetServiceServicer):
    def __init__(
        self,
        config: TargetConfig,
        scheduler: Scheduler,
        metrics: ServiceMetrics,
        tokenizer,
        model_info: target_pb2.GetModelInfoResponse,
    ):
        self.config = config
        self.scheduler = scheduler
        self.metrics = metrics
        self.tokenizer = tokenizer
        self.model_info = model_info
        self.vocab_size = model_info.vocab_size
        self.ready = False

    # -- validation --------------------------------------------------------------
    def _prompt(self, request: target_pb2.GenerateRequest) -> list[int]:
        which = request.WhichOneof("prompt")
        if which is None:
            raise InvalidRequest("prompt: give text, token_ids or messages")
        if which == "text":
            if not request.text:
                raise InvalidRequest("text: empty prompt")
            ids = list(self.tokenizer.encode(request.text))
        elif which == "messages":
            ids = self._chat_prompt(request.messages.messages)
        else:
            ids = list(request.token_ids.ids)
            bad = [t for t in ids if t >= self.vocab_size]
            if bad:
                raise InvalidRequest(
                    f"token_ids: id {bad[0]} is outside the vocabulary (size {self.vocab_size})"
                )
        if not ids:
            raise InvalidRequest(f"{which}: empty prompt")
        return ids

    def _chat_prompt(self, messages) -> list[int]:
        """The model's chat template over `messages`, with the assistant-turn opener."""
        if not messages:
            raise InvalidRequest("messages: empty conversation")
        for i, m in enumerate(messages):
            if not m.role:
                raise InvalidRequest(f"messages[{i}].role: required")
            if m.role not in CHAT_ROLES:
                raise InvalidRequest(f"messages[{i}].role: {m.role!r} is not one of {', '.join(CHAT_ROLES)}")
        try:
            return list(
                self.tokenizer.apply_chat_template([{"role": m.role, "content": m.content} for m in messages])
            )
        except ChatTemplateError as exc:
            raise InvalidRequest(str(exc)) from exc

    def build_request(self, request: target_pb2.GenerateRequest) -> Request:
        cfg = self.config
        if len(request.request_id) > MAX_REQUEST_ID:
            raise InvalidRequest(f"request_id: longer than {MAX_REQUEST_ID} characters")
        prompt = self._prompt(request)
        s = request.sampling
        if not math.isfinite(s.temperature) or s.temperature < 0:
            raise InvalidRequest(f"sampling.temperature: must be a finite number >= 0, got {s.temperature}")
        if s.top_k < 0 or s.top_k > self.vocab_size:
            raise InvalidRequest(f"sampling.top_k: must be in [0, {self.vocab_size}], got {s.top_k}")
        top_p = s.top_p if s.HasField("top_p") else 1.0
        if not (0.0 < top_p <= 1.0):
            raise InvalidRequest(f"sampling.top_p: must be in (0, 1], got {top_p}")
        if request.max_new_tokens <= 0:
            raise InvalidRequest(f"max_new_tokens: must be > 0, got {request.max_new_tokens}")
        max_ctx = self.scheduler.runner.max_context
        if len(prompt) + request.max_new_tokens > max_ctx:
            raise InvalidRequest(
                f"max_new_tokens: prompt ({len(prompt)} tokens) + max_new_tokens "
                f"({request.max_new_tokens}) exceeds the context length {max_ctx}"
            )
        k = (
            request.num_speculative_tokens
            if request.HasField("num_speculative_tokens")
            else cfg.num_speculative_tokens
        )
        if not 0 <= k <= cfg.max_speculative_tokens:
            raise InvalidRequest(
                f"num_speculative_tokens: must be in [0, {cfg.max_speculative_tokens}], got {k}"
            )
        bad_stop = [t for t in request.stop_token_ids if t >= self.vocab_size]
        if bad_stop:
            raise InvalidRequest(f"stop_token_ids: id {bad_stop[0]} is outside the vocabulary")
        stops = list(request.stop_strings)
        if len(stops) > cfg.max_stop_strings:
            raise InvalidRequest(f"stop_strings: at most {cfg.max_stop_strings}, got {len(stops)}")
        for stop in stops:
            if not stop:
                raise InvalidRequest("stop_strings: empty string")
            if len(stop) > cfg.max_stop_string_length:
                raise InvalidRequest(f"stop_strings: longer than {cfg.max_stop_string_length} characters")
            if "\ufffd" in stop:
                raise InvalidRequest("stop_strings: contains U+FFFD (not valid text)")
        if stops and self.tokenizer is None:
            raise InvalidRequest("stop_strings: the target has no tokenizer")
        logprobs = request.logprobs if request.HasField("logprobs") else None
        if logprobs is not None and not 0 <= logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs: must be in [0, {MAX_LOGPROBS}], got {logprobs}")
        stop_ids = set(request.stop_token_ids)
        if not request.ignore_eos:
            stop_ids |= self.scheduler.eos_ids
        return Request(
            request_id=request.request_id or secrets.token_hex(8),
            prompt=prompt,
            max_new_tokens=request.max_new_tokens,
            temperature=s.temperature,
            top_k=s.top_k,
            top_p=top_p,
            seed=s.seed if s.HasField("seed") else secrets.randbits(63),
            k=k if self.scheduler.link is not None else 0,
            pinned_k=s.temperature > 0 and s.HasField("seed"),
            stop_ids=frozenset(stop_ids),
            detok=StreamDetokenizer(self.tokenizer, stops),
            logprobs=logprobs,
        )

    async def _abort(self, context: grpc.aio.ServicerContext, code: grpc.StatusCode, message: str) -> None:
        self.metrics.request_error(code.name.lower()).inc()
        await context.abort(code, message)

    def _admit(self, request: target_pb2.GenerateRequest, out: StreamOut) -> Request:
        """Validates and queues (in a worker thread: tokenizing a long prompt must not stall the loop).
        Raises (code, message) as a _Rejected."""
        try:
            req = self.build_request(request)
            req.out, out.request_id = out, req.request_id
            self.scheduler.submit(req)
        except InvalidRequest as exc:
            raise _Rejected(grpc.StatusCode.INVALID_ARGUMENT, str(exc)) from None
        except ValueError as exc:  # duplicate live request id
            raise _Rejected(grpc.StatusCode.ALREADY_EXISTS, str(exc)) from None
        except QueueFull as exc:
            raise _Rejected(grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)) from None
        except NotAccepting as exc:
            raise _Rejected(grpc.StatusCode.UNAVAILABLE, str(exc)) from None
        return req

    # -- RPCs --------------------------------------------------------------------
    async def Generate(self, request: target_pb2.GenerateRequest, context: grpc.aio.ServicerContext) -> None:
        self.metrics.count_grpc_message("received", "generate_request", request.ByteSize())
        if not self.ready:
            await self._abort(context, grpc.StatusCode.UNAVAILABLE, LOADING)
        task = asyncio.current_task()
        assert task is not None

        def on_overflow() -> None:  # on the loop: the client stopped reading
            self.scheduler.cancel(out.request_id, "client")  # set before the request was queued
            task.cancel()

        out = StreamOut(asyncio.get_running_loop(), self.config.max_stream_backlog, on_overflow)
        try:
            which = request.WhichOneof("prompt")
            if which == "messages" or (which == "text" and len(request.text) > INLINE_TEXT):
                req = await asyncio.to_thread(self._admit, request, out)
            else:
                req = self._admit(request, out)
        except _Rejected as exc:
            await self._abort(context, exc.code, exc.message)
        self.metrics.prompt_tokens.inc(len(req.prompt))
        done = False
        held: Any = _NOTHING  # an item taken while coalescing that was not a chunk
        try:
            while True:
                item = await out.get() if held is _NOTHING else held
                held = _NOTHING
                # Chunks that queued up while this stream waited go out as one message: when the loop
                # lags behind the steps, each stream costs one write, not one per step.
                while _is_chunk(item) and out.pending():
                    nxt = out.get_nowait()
                    if not _is_chunk(nxt):
                        held = nxt
                        break
                    item.token_ids.extend(nxt.token_ids)
                    item.text += nxt.text
                    item.logprobs.extend(nxt.logprobs)
                if item is None:
                    done = True
                    return
                if isinstance(item, Exception):  # stopped at the drain timeout: UNAVAILABLE, retry elsewhere
                    done = True
                    stopped = self.scheduler.stopped.is_set()
                    code = grpc.StatusCode.UNAVAILABLE if stopped else grpc.StatusCode.INTERNAL
                    await self._abort(context, code, str(item))
                self.metrics.count_grpc_message("sent", "generate_response", item.ByteSize())
                await context.write(item)
        except asyncio.CancelledError:
            if not out.overflowed:
                raise  # the client cancelled or its deadline passed
            # Our own cancel: the client stopped reading. Say so (it sees this if it reads again).
            self.metrics.request_error("resource_exhausted").inc()
            context.set_code(grpc.StatusCode.RESOURCE_EXHAUSTED)
            context.set_details(
                f"stream: the client left more than {self.config.max_stream_backlog} responses unread; "
                "the request was cancelled"
            )
        finally:
            if not done:  # a client cancel, deadline, or a failed write: free the slot at the next step
                self.scheduler.cancel(req.request_id, "client")

    async def Abort(
        self, request: target_pb2.AbortRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.AbortResponse:
        if not request.request_id:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "request_id: required")
        return target_pb2.AbortResponse(found=self.scheduler.cancel(request.request_id, "abort"))

    async def GetModelInfo(
        self, request: target_pb2.GetModelInfoRequest, context: grpc.aio.ServicerContext
    ) -> target_pb2.GetModelInfoResponse:
        info = target_pb2.GetModelInfoResponse()
        info.CopyFrom(self.model_info)
        link = self.scheduler.link
        info.draft_connected = bool(link and link.connected)
        info.not_drafting_reason = self.scheduler.not_drafting
        if link is not None and link.info is not None:
            info.draft_model = link.info.model
            info.draft_tp_size = link.info.tp_size
            info.draft_method = link.info.method
        return info
