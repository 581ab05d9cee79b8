"""Helpers for tests that run the real services as subprocesses over loopback gRPC."""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from specsplit.launch import ServiceProcess, start_service
from specsplit.v1 import sampling_pb2, target_pb2, target_pb2_grpc


@dataclass
class Result:
    ids: list[int]
    text: str
    finish_reason: int
    usage: target_pb2.Usage


def prompts(n: int, vocab: int = 512, seed: int = 0) -> list[list[int]]:
    """n prompts of varied length (1 to 40 tokens)."""
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(rng.choice([1, 2, 3, 5, 8, 13, 21, 40]))] for _ in range(n)]


def request(
    ids: list[int],
    max_new_tokens: int = 24,
    k: int | None = None,
    temperature: float = 0.0,
    seed: int | None = None,
    **kw,
) -> target_pb2.GenerateRequest:
    req = target_pb2.GenerateRequest(
        token_ids=target_pb2.TokenIds(ids=ids),
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        sampling=sampling_pb2.SamplingParams(temperature=temperature),
        **kw,
    )
    if seed is not None:
        req.sampling.seed = seed
    if k is not None:
        req.num_speculative_tokens = k
    return req


def generate(
    stub: target_pb2_grpc.TargetServiceStub, req: target_pb2.GenerateRequest, timeout: float = 300
) -> Result:
    ids: list[int] = []
    text = []
    last = None
    for msg in stub.Generate(req, timeout=timeout):
        ids += msg.token_ids
        text.append(msg.text)
        last = msg
    assert last is not None and last.finish_reason != 0, "stream ended without a final message"
    return Result(ids, "".join(text), last.finish_reason, last.usage)


def generate_many(address: str, reqs: list[target_pb2.GenerateRequest], concurrency: int) -> list[Result]:
    with grpc.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        with ThreadPoolExecutor(concurrency) as pool:
            return list(pool.map(lambda r: generate(stub, r), reqs))


def stub_for(service: ServiceProcess) -> tuple[grpc.Channel, target_pb2_grpc.TargetServiceStub]:
    channel = grpc.insecure_channel(service.address)
    return channel, target_pb2_grpc.TargetServiceStub(channel)


def start_draft(model: Path, log_dir: Path, *extra: str, port: int | None = None) -> ServiceProcess:
    return start_service("draft_service", ["--model", str(model), *extra], log_dir / "draft.log", port=port)


def start_target(
    model: Path, log_dir: Path, draft: ServiceProcess | str | None, *extra: str, name: str = "target"
) -> ServiceProcess:
    args = ["--model", str(model), *extra]
    if draft is not None:
        args += ["--draft-address", draft if isinstance(draft, str) else draft.address]
        if "--speculation-policy" not in extra:
            # Tests of speculation assert that drafts were made: with the adaptive policy (the default)
            # a CPU step where k = 4 costs about what its tokens are worth may rightly choose k = 0.
            # The adaptive policy is tested where it is named (test_serving_loop, test_policy*).
            args += ["--speculation-policy", "fixed"]
    return start_service("target_service", args, log_dir / f"{name}.log")


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.05)


@contextmanager
def running(*services: ServiceProcess) -> Iterator[tuple[ServiceProcess, ...]]:
    """Stops the services (last started first) when the block ends, whatever happened in it."""
    try:
        yield services
    finally:
        for service in reversed(services):
            service.stop()


def speculative_equals_plain(address: str, ps: list[list[int]], concurrency: int, k: int | None = None,
                             **kw) -> tuple[list[Result], list[Result]]:  # fmt: skip
    """Greedy generations with speculation (k, default: the server's) and without (k=0): asserts the
    token sequences are identical; returns (speculative, plain)."""
    plain = generate_many(address, [request(p, k=0, **kw) for p in ps], concurrency)
    spec = generate_many(address, [request(p, k=k, **kw) for p in ps], concurrency)
    assert_same_tokens(spec, plain)
    return spec, plain


def assert_same_tokens(spec: list[Result], plain: list[Result]) -> None:
    for i, (a, b) in enumerate(zip(spec, plain)):
        assert a.ids == b.ids, f"prompt {i}: speculative {a.ids} != plain {b.ids}"


class Load:
    """Greedy streams, one thread each, started at once: each collects its tokens and the status it ended
    with (OK, or the RPC error's code)."""

    def __init__(self, stub: target_pb2_grpc.TargetServiceStub, ps: list[list[int]], new_tokens: int):
        self.new_tokens = new_tokens
        self.tokens: list[list[int]] = [[] for _ in ps]
        self.status: list[grpc.StatusCode | None] = [None] * len(ps)
        self.first = [threading.Event() for _ in ps]
        self.threads = [threading.Thread(target=self._run, args=(stub, i, p)) for i, p in enumerate(ps)]
        for t in self.threads:
            t.start()

    def _run(self, stub: target_pb2_grpc.TargetServiceStub, i: int, ids: list[int]) -> None:
        try:
            for msg in stub.Generate(request(ids, max_new_tokens=self.new_tokens), timeout=120):
                self.tokens[i] += msg.token_ids
                self.first[i].set()
            self.status[i] = grpc.StatusCode.OK
        except grpc.RpcError as exc:
            self.status[i] = exc.code()
        finally:
            self.first[i].set()

    def started(self) -> bool:
        return all(e.is_set() for e in self.first)

    def join(self) -> None:
        for t in self.threads:
            t.join(timeout=120)
