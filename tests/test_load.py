"""Under load: many streams on one target, soak with draft restarts, SIGTERM under load, bad clients.

CPU, tiny models, loopback, bounded. The CI versions are short; the long versions run with
    SPECSPLIT_SOAK_SECONDS=600 SPECSPLIT_DRAFT_KILL_EVERY=20 pytest tests/test_load.py
(results in docs/reliability.md).
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import grpc
import grpc.aio
import pytest
from load_util import closed_loop, greedy_request, proc_stats, references, stream, thread_names
from service_util import prompts, start_draft, start_target, wait_for

from specsplit.v1 import target_pb2, target_pb2_grpc

pytestmark = pytest.mark.slow

SOAK_SECONDS = float(os.environ.get("SPECSPLIT_SOAK_SECONDS", "30"))
KILL_EVERY = float(os.environ.get("SPECSPLIT_DRAFT_KILL_EVERY", "12"))
LENGTH = target_pb2.FINISH_REASON_LENGTH
# The torch rejection reference: these tests load the serving loop, not the kernel (the Triton
# interpreter is far too slow at batch 256 on CPU; tests/test_rejection_* compare the two).
FAST = ("--verify-backend", "torch")


def test_holds_256_streams_and_1000_queued(demo_models, tmp_path):
    """One process: 256 streams running + 1000 queued, a few threads, RESOURCE_EXHAUSTED beyond."""
    target = start_target(
        demo_models.target,
        tmp_path,
        None,
        "--max-batch-size",
        "256",
        *FAST,
        "--max-queued-requests",
        "1000",
        "--max-context-length",
        "64",
    ).wait_ready()
    base = proc_stats(target.popen.pid)
    ps = prompts(1256, seed=3)
    ps = [p[:8] for p in ps]

    async def run() -> None:
        chans = [grpc.aio.insecure_channel(target.address) for _ in range(8)]
        stubs = [target_pb2_grpc.TargetServiceStub(c) for c in chans]
        long = [asyncio.create_task(stream(stubs[i % 8], greedy_request(ps[i], 50))) for i in range(256)]
        await asyncio.to_thread(wait_for, lambda: target.metric("specsplit_running_requests") == 256, 120,
                                "256 running")  # fmt: skip
        short = [
            asyncio.create_task(stream(stubs[i % 8], greedy_request(ps[i], 2))) for i in range(256, 1256)
        ]
        await asyncio.to_thread(wait_for, lambda: target.metric("specsplit_waiting_requests") == 1000, 120,
                                "1000 queued")  # fmt: skip
        peak = proc_stats(target.popen.pid)
        over = await asyncio.gather(*(stream(stubs[0], greedy_request(ps[0], 2)) for _ in range(5)))
        assert [r.error for r in over] == [grpc.StatusCode.RESOURCE_EXHAUSTED] * 5, over
        assert all("queue full" in r.details for r in over)
        # No thread per stream: 1256 open streams add at most a handful of threads.
        assert peak.threads - base.threads < 16, (base, peak)
        for t in long:
            t.cancel()
        results = await asyncio.gather(*short)
        assert all(r.error is None and r.finish_reason == LENGTH and len(r.ids) == 2 for r in results)
        for c in chans:
            await c.close()

    try:
        asyncio.run(run())
        wait_for(lambda: target.metric("specsplit_kv_slots_used") == 0, 30, "KV slots back to 0")
        assert target.metric("specsplit_waiting_requests") == 0
        assert target.metric("specsplit_running_requests") == 0
        assert target.metric("specsplit_request_errors_total", code="resource_exhausted") == 5
        with pytest.raises(KeyError):  # a renamed metric fails loudly instead of reading 0
            target.metric("specsplit_request_errors_renamed_total")
    finally:
        assert target.stop() == 0


@pytest.mark.timeout(SOAK_SECONDS + 240)
def test_soak_64_streams_with_draft_restarts(demo_models, tmp_path):
    """64 greedy streams the whole run; the draft is SIGKILLed and restarted every KILL_EVERY seconds.
    Zero client errors, output == plain for every request, fallback and reconnects counted, KV slots
    sampled during the run and back to 0 after, no leaked threads/fds, RSS growth after warm-up <= 5%."""
    draft = start_draft(demo_models.markov_draft, tmp_path).wait_ready()
    target = start_target(
        demo_models.target,
        tmp_path,
        draft,
        "--max-batch-size",
        "64",
        *FAST,
        "--max-context-length",
        "128",
        "--draft-backoff-max",
        "0.5",
    ).wait_ready()
    ps = [p[:12] for p in prompts(16, seed=7)]
    n_new = 24
    kills = 0
    try:
        refs = asyncio.run(references(target.address, ps, n_new))
        # The service's plain decoding against an independent reference: the model run in-process.
        from common.distributed import init_tp
        from common.loader import load_model
        from common.models.generate import greedy_generate

        assert refs == greedy_generate(load_model(demo_models.target, init_tp(1, 0)), ps, n_new)
        # Warm-up (allocator, caches), then the baseline.
        warm = asyncio.run(closed_loop(target.address, ps, refs, 64, n_new, time.monotonic() + 8))
        assert warm.done > 0 and not warm.errors and not warm.mismatches
        wait_for(lambda: target.metric("specsplit_kv_slots_used") == 0, 30, "idle after warm-up")
        base = proc_stats(target.popen.pid)
        base_names = thread_names(target.popen.pid)
        slots_seen: list[float] = []

        async def chaos(deadline: float) -> None:
            nonlocal draft, kills
            next_kill = time.monotonic() + KILL_EVERY / 2
            while time.monotonic() < deadline - 5:
                await asyncio.sleep(0.5)
                slots_seen.append(await asyncio.to_thread(target.metric, "specsplit_kv_slots_used"))
                if time.monotonic() >= next_kill:
                    draft.popen.kill()
                    draft.popen.wait()
                    kills += 1
                    logs = tmp_path / f"draft-{kills}"  # a fresh log: wait_ready looks for READY in it
                    logs.mkdir()
                    fresh = start_draft(demo_models.markov_draft, logs, port=draft.port)
                    draft = await asyncio.to_thread(fresh.wait_ready)
                    next_kill = time.monotonic() + KILL_EVERY

        async def soak():
            deadline = time.monotonic() + SOAK_SECONDS
            stats, _ = await asyncio.gather(
                closed_loop(target.address, ps, refs, 64, n_new, deadline), chaos(deadline)
            )
            return stats

        stats = asyncio.run(soak())
        assert not stats.errors, stats.errors
        assert not stats.mismatches, stats.mismatches[:3]
        assert stats.done >= 64 and set(stats.finish) == {LENGTH}
        assert stats.drafted > 0 and stats.accepted > 0, "speculation ran"
        assert kills >= 1
        assert max(slots_seen) > 0, "KV slots were sampled while requests ran"
        assert max(slots_seen) <= 64
        assert target.metric("specsplit_spec_fallback_steps_total") > 0, (
            "steps fell back while the draft was down"
        )
        # The last restart can finish just before the soak ends: wait for the link to reach it.
        wait_for(
            lambda: target.metric("specsplit_draft_reconnects_total") >= kills,
            30,
            "the target reconnected to every restarted draft",
        )
        wait_for(lambda: target.metric("specsplit_draft_connected") == 1, 30, "reconnected to the draft")
        wait_for(lambda: target.metric("specsplit_kv_slots_used") == 0, 30, "KV slots back to 0")
        assert target.metric("specsplit_running_requests") == 0
        assert target.metric("specsplit_waiting_requests") == 0
        # No thread leaks: a thread of the last dropped connection may take a moment to exit (seen under
        # a busy CI: 20 threads against 19 right after the reconnect, and once still above the base after
        # 15 s), a leaked one never does.
        pid = target.popen.pid
        try:
            wait_for(lambda: proc_stats(pid).threads <= base.threads, 45, "threads back to the base")
        except AssertionError as exc:
            extra = thread_names(pid) - base_names
            raise AssertionError(f"{exc}; threads beyond the base, by name: {dict(extra)}") from None
        after = proc_stats(target.popen.pid)
        assert after.fds <= base.fds + 2, (base, after)  # a reconnect may hold a new socket pair
        assert after.rss_kb <= base.rss_kb * 1.05, (base, after)
        print(f"soak: {stats.done} requests, {kills} draft kills, base {base}, after {after}")
    finally:
        target.stop()
        draft.stop()


def test_sigterm_under_load(demo_models, tmp_path):
    """SIGTERM with 64 streams open: every admitted request completes, new ones get UNAVAILABLE,
    exit 0 within the drain timeout."""
    draft = start_draft(demo_models.draft, tmp_path).wait_ready()
    target = start_target(
        demo_models.target,
        tmp_path,
        draft,
        "--max-batch-size",
        "32",
        *FAST,
        "--max-context-length",
        "128",
        "--drain-timeout",
        "90",
    ).wait_ready()
    ps = [p[:12] for p in prompts(64, seed=11)]
    try:
        refs = asyncio.run(references(target.address, ps, 24))

        async def run() -> None:
            async with grpc.aio.insecure_channel(target.address) as channel:
                stub = target_pb2_grpc.TargetServiceStub(channel)
                tasks = [asyncio.create_task(stream(stub, greedy_request(p, 24))) for p in ps]
                await asyncio.to_thread(wait_for, lambda: target.metric("specsplit_running_requests") == 32,
                                        60, "a full batch")  # fmt: skip
                t_term = time.monotonic()
                target.signal(signal.SIGTERM)
                await asyncio.sleep(0.5)
                late = await stream(stub, greedy_request(ps[0], 4))
                assert late.error == grpc.StatusCode.UNAVAILABLE, late
                results = await asyncio.gather(*tasks)
                for i, r in enumerate(results):
                    assert r.error is None, (i, r.error, r.details)
                    assert r.ids == refs[i] and r.finish_reason == LENGTH
                code = await asyncio.to_thread(target.popen.wait, 90)
                assert code == 0 and time.monotonic() - t_term < 90

        asyncio.run(run())
    finally:
        target.stop()
        draft.stop()


def test_clients_that_vanish_or_stop_reading(demo_models, tmp_path):
    """Clients cancel at random points or stop reading: the batch keeps going (a well-behaved client
    finishes with the plain output), a stuck stream is cancelled with RESOURCE_EXHAUSTED after
    --max-stream-backlog unread responses, and every KV slot comes back."""
    target = start_target(
        demo_models.target,
        tmp_path,
        None,
        "--max-batch-size",
        "16",
        *FAST,
        "--max-context-length",
        "512",
        "--max-stream-backlog",
        "16",
    ).wait_ready()
    ps = [p[:8] for p in prompts(24, seed=5)]
    rng = random.Random(0)
    # A tiny receive window and no BDP growth: the server's writes block after a few messages.
    stuck_options = [("grpc.http2.lookahead_bytes", 1024), ("grpc.http2.bdp_probe", 0)]
    try:
        good_ref = asyncio.run(references(target.address, ps[:1], 60))[0]

        async def run() -> None:
            async with (
                grpc.aio.insecure_channel(target.address) as ch,
                grpc.aio.insecure_channel(target.address, options=stuck_options) as stuck_ch,
            ):
                stub, stuck_stub = (
                    target_pb2_grpc.TargetServiceStub(ch),
                    target_pb2_grpc.TargetServiceStub(stuck_ch),
                )

                async def vanish(p: list[int]) -> None:
                    call = stub.Generate(greedy_request(p, 200))
                    for _ in range(rng.randrange(0, 6)):
                        await call.read()
                    call.cancel()

                stuck = [stuck_stub.Generate(greedy_request(p, 400)) for p in ps[1:5]]
                for call in stuck:
                    await call.read()  # started; now never read again
                await asyncio.gather(*(vanish(p) for p in ps[5:]))
                good = await stream(stub, greedy_request(ps[0], 60))
                assert good.error is None and good.ids == good_ref, "the batch kept serving"
                await asyncio.to_thread(wait_for, lambda: target.metric("specsplit_kv_slots_used") == 0, 60,
                                        "stuck and vanished requests freed")  # fmt: skip
                for call in stuck:
                    with pytest.raises(grpc.aio.AioRpcError) as err:
                        while await call.read() is not grpc.aio.EOF:
                            pass
                    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                    assert "stream:" in (err.value.details() or "")

        asyncio.run(run())
        assert target.metric("specsplit_request_errors_total", code="resource_exhausted") == 4
        assert target.metric("specsplit_requests_finished_total", reason="aborted") >= 4
    finally:
        assert target.stop() == 0
