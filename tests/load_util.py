"""Load helpers for the soak, chaos and scale tests: a closed-loop asyncio load, process accounting.

Every loop is bounded (a deadline or a request count) and runs on loopback against real services.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from dataclasses import dataclass, field

import grpc
import grpc.aio

from specsplit.v1 import sampling_pb2, target_pb2, target_pb2_grpc


@dataclass
class ProcStats:
    rss_kb: int
    threads: int
    fds: int


def proc_stats(pid: int) -> ProcStats:
    """Resident memory, thread count and open file descriptors of a live process (Linux /proc)."""
    fields = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key] = value.split()
    return ProcStats(int(fields["VmRSS"][0]), int(fields["Threads"][0]), len(os.listdir(f"/proc/{pid}/fd")))


def thread_names(pid: int) -> Counter:
    """How many threads of a live process carry each name (Linux /proc: gRPC, Python and torch threads
    name themselves), to say which ones a leak check found."""
    names: Counter = Counter()
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                names[f.read().strip()] += 1
        except FileNotFoundError:  # exited meanwhile
            pass
    return names


def greedy_request(ids: list[int], max_new_tokens: int, k: int | None = None) -> target_pb2.GenerateRequest:
    req = target_pb2.GenerateRequest(
        token_ids=target_pb2.TokenIds(ids=ids),
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        sampling=sampling_pb2.SamplingParams(temperature=0.0),
    )
    if k is not None:
        req.num_speculative_tokens = k
    return req


@dataclass
class StreamResult:
    ids: list[int] = field(default_factory=list)
    finish_reason: int = 0
    usage: target_pb2.Usage | None = None
    error: grpc.StatusCode | None = None
    details: str = ""


async def stream(
    stub: target_pb2_grpc.TargetServiceStub, req: target_pb2.GenerateRequest, timeout: float = 300
) -> StreamResult:
    out = StreamResult()
    try:
        async for msg in stub.Generate(req, timeout=timeout):
            out.ids += msg.token_ids
            if msg.finish_reason:
                out.finish_reason, out.usage = msg.finish_reason, msg.usage
    except grpc.aio.AioRpcError as err:
        out.error, out.details = err.code(), err.details() or ""
    return out


@dataclass
class LoadStats:
    done: int = 0
    errors: Counter = field(default_factory=Counter)
    finish: Counter = field(default_factory=Counter)
    mismatches: list[str] = field(default_factory=list)
    drafted: int = 0
    accepted: int = 0


async def closed_loop(
    address: str,
    prompts: list[list[int]],
    refs: list[list[int]],
    concurrency: int,
    max_new_tokens: int,
    deadline: float,
    channels: int = 4,
) -> LoadStats:
    """`concurrency` workers send greedy requests back to back until `deadline` (time.monotonic());
    every output is compared with the plain reference of its prompt."""
    stats = LoadStats()
    chans = [grpc.aio.insecure_channel(address) for _ in range(channels)]
    stubs = [target_pb2_grpc.TargetServiceStub(c) for c in chans]

    async def worker(w: int) -> None:
        n = w
        while time.monotonic() < deadline:
            i = n % len(prompts)
            n += concurrency
            r = await stream(stubs[w % channels], greedy_request(prompts[i], max_new_tokens))
            if r.error is not None:
                stats.errors[f"{r.error.name}: {r.details}"] += 1
                continue
            stats.done += 1
            stats.finish[r.finish_reason] += 1
            assert r.usage is not None
            stats.drafted += r.usage.drafted_tokens
            stats.accepted += r.usage.accepted_tokens
            if r.ids != refs[i]:
                stats.mismatches.append(f"prompt {i}: {r.ids} != plain {refs[i]}")

    try:
        await asyncio.gather(*(worker(w) for w in range(concurrency)))
    finally:
        for c in chans:
            await c.close()
    return stats


async def references(address: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Plain decoding (k = 0) of each prompt: the reference speculative outputs must equal."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = target_pb2_grpc.TargetServiceStub(channel)
        results = await asyncio.gather(
            *(stream(stub, greedy_request(p, max_new_tokens, k=0)) for p in prompts)
        )
    for r in results:
        assert r.error is None and r.finish_reason == target_pb2.FINISH_REASON_LENGTH, r
    return [r.ids for r in results]
