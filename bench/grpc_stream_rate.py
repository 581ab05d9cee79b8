"""How many streamed messages per second one grpc.aio server pushes to concurrent streams: the cost of the
target's per-token GenerateResponse writes, without a model. A server-streaming method yields `--messages`
40-byte messages per call; `--streams` concurrent calls from a second process read them.

    python bench/grpc_stream_rate.py --streams 1 16 64 --messages 400

Reported per run: messages per second, wall us per message, and the server process's CPU us per message
(its utime + stime from /proc): the server's own cost, apart from the reading client's. At B=64 every
step writes 64 messages (one per request), so that CPU time x 64 is the event loop's share of a step's
host time (GIL held), competing with the scheduler.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import grpc

SERVICE, METHOD = "bench.Stream", "Gen"


async def serve(port: int, messages: int) -> None:
    async def gen(request, context):
        for _ in range(messages):
            yield b"x" * 40

    method = grpc.unary_stream_rpc_method_handler(gen)
    handler = grpc.method_handlers_generic_handler(SERVICE, {METHOD: method})
    server = grpc.aio.server()
    server.add_generic_rpc_handlers((handler,))
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def cpu_seconds(pid: int) -> float:
    fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime


async def read(port: int, streams: int, server_pid: int) -> dict:
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.unary_stream(f"/{SERVICE}/{METHOD}")

        async def one() -> int:
            return sum([1 async for _ in call(b"")])

        await asyncio.gather(*[one() for _ in range(4)])  # warm-up: connection, threads
        cpu0, t0 = cpu_seconds(server_pid), time.perf_counter()
        counts = await asyncio.gather(*[one() for _ in range(streams)])
        seconds, cpu = time.perf_counter() - t0, cpu_seconds(server_pid) - cpu0
    n = sum(counts)
    return {"streams": streams, "messages": n, "msg_per_s": n / seconds, "us_per_msg": 1e6 * seconds / n,
            "server_cpu_us_per_msg": 1e6 * cpu / n}  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--streams", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--messages", type=int, default=2000)
    ap.add_argument("--port", type=int, default=50997)
    ap.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        asyncio.run(serve(args.port, args.messages))
        return 0
    server = subprocess.Popen([sys.executable, __file__, "--serve", "--port", str(args.port),
                               "--messages", str(args.messages)])  # fmt: skip
    try:
        time.sleep(1.5)
        for streams in args.streams:
            print(json.dumps(asyncio.run(read(args.port, streams, server.pid))), flush=True)
    finally:
        server.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
