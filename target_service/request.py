"""A request as the target's scheduler sees it, and the pure stop check of its new tokens."""

from __future__ import annotations

import enum
import queue
import time
import types
from dataclasses import dataclass, field

from specsplit.v1 import sampling_pb2, target_pb2
from target_service.detok import StreamDetokenizer

# FinishReason's values as plain attributes (and its Name): the protobuf enum wrapper resolves each
# attribute through __getattr__, microseconds per lookup on every request of every step.
FINISH = types.SimpleNamespace(**dict(target_pb2.FinishReason.items()), Name=target_pb2.FinishReason.Name)


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class DraftSync:
    """What the draft service knows of this request (per draft stream epoch)."""

    draft_id: int = 0
    synced: int = -1  # committed length the draft knows; -1: the draft has not seen the request
    last_accepted: int = 0


@dataclass
class SpecStats:
    """Speculation counters of one request, and its running per-token acceptance for the policy."""

    drafted: int = 0
    accepted: int = 0
    steps: int = 0
    # Per-token acceptance as successes / trials with decay: each accepted draft token is a success,
    # the first rejected one a failure (later positions are not observed).
    successes: float = 0.0
    trials: float = 0.0

    def observe(self, drafted: int, accepted: int, decay: float = 0.98) -> None:
        self.steps += 1
        self.drafted += drafted
        self.accepted += accepted
        if drafted:
            self.successes = decay * self.successes + accepted
            self.trials = decay * self.trials + accepted + (1 if accepted < drafted else 0)

    def observe_all(self, drafted: list[int], accepted: list[int], decay: float = 0.98) -> None:
        """observe() of each (drafted, accepted) in turn: a step's verdicts in one call."""
        observe = self.observe
        for d, a in zip(drafted, accepted):
            observe(d, a, decay)

    def alpha(self, prior: float) -> float:
        """Per-token acceptance estimate, pulled towards `prior` while few tokens were seen."""
        return (self.successes + 2.0 * prior) / (self.trials + 2.0)


@dataclass
class Request:
    request_id: str
    prompt: list[int]
    max_new_tokens: int
    temperature: float
    top_k: int
    top_p: float
    seed: int
    k: int  # the most draft tokens per step this request accepts (the policy may ask fewer)
    stop_ids: frozenset[int]
    detok: StreamDetokenizer
    pinned_k: bool = False  # sampled with a client's seed: always k drafts, so the output is reproducible
    status: Status = Status.WAITING
    tokens: list[int] = field(default_factory=list)  # committed: prompt + output
    output: list[int] = field(default_factory=list)
    out: queue.Queue = field(default_factory=queue.Queue)  # GenerateResponse, an Exception, then None
    slot: int = -1
    arrival: float = field(default_factory=time.perf_counter)
    admitted: float = 0.0
    first_token: float = 0.0
    last_chunk: float = 0.0
    cancelled: str = ""  # "", "client", "abort" or "stop_string" (found by the streamer)
    streamed: int = 0  # output tokens sent to the client (the usage count)
    # Released by the detokenizer, not sent yet (--stream-interval): ids and their text.
    held_ids: list[int] = field(default_factory=list)
    held_text: str = ""
    draft: DraftSync = field(default_factory=DraftSync)
    spec: SpecStats = field(default_factory=SpecStats)
    logprobs: int | None = None  # alternatives to return per token; None: no logprobs
    # Logprobs of verified tokens not streamed yet, in token order (appended by the step, taken by
    # the streamer with the chunk's tokens).
    pending_logprobs: list[target_pb2.TokenLogprob] = field(default_factory=list)

    def usage(self, speculation_note: str = "") -> target_pb2.Usage:
        return target_pb2.Usage(
            prompt_tokens=len(self.prompt),
            output_tokens=len(self.output),
            drafted_tokens=self.spec.drafted,
            accepted_tokens=self.spec.accepted,
            steps=self.spec.steps,
            speculation_note=speculation_note,
        )

    @property
    def sampling(self) -> sampling_pb2.SamplingParams:
        return sampling_pb2.SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, seed=self.seed
        )


def check_stop(
    out_tokens: list[int], stop_ids: frozenset[int], eos_ids: frozenset[int], room: int
) -> tuple[list[int], int]:
    """New output tokens up to the first stop, and the finish reason (UNSPECIFIED: keep going).

    `room` is how many more tokens max_new_tokens allows. A stop token is not part of the output.
    """
    if len(out_tokens) < room and stop_ids.isdisjoint(out_tokens):  # the common case, in C
        return list(out_tokens), FINISH.FINISH_REASON_UNSPECIFIED
    new: list[int] = []
    for tok in out_tokens:
        if tok in stop_ids:
            return new, FINISH.FINISH_REASON_EOS if tok in eos_ids else FINISH.FINISH_REASON_STOP_TOKEN
        new.append(tok)
        if len(new) >= room:
            return new, FINISH.FINISH_REASON_LENGTH
    return new, FINISH.FINISH_REASON_UNSPECIFIED
