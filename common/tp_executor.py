"""Running one service's model on a tensor-parallel group.

Rank 0 owns the gRPC server and the scheduler. For every step it broadcasts a
small command (name + host-side inputs) to the other ranks, then all ranks run
the same handler, so every collective inside the model lines up. Ranks come
either from `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR in the environment) or
from the service spawning its own worker processes.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
import socket
import threading
from collections.abc import Callable
from typing import Any

import torch

from common.distributed import Comm, init_tp

log = logging.getLogger(__name__)

# NVLink multicast can take a shared host's GPUs down; keep it off in every rank we start.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

Handler = Callable[..., Any]
SHUTDOWN = "__shutdown__"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    if device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local_rank)
    return torch.device(device)


class TPExecutor:
    """Rank 0 calls `run(name, **inputs)`; other ranks sit in `serve_forever()`."""

    def __init__(self, comm: Comm, handlers: dict[str, Handler]):
        self.comm = comm
        self.handlers = handlers

    def run(self, name: str, **inputs: Any) -> Any:
        if self.comm.world_size > 1:
            self.comm.broadcast_object((name, inputs), src=0, site="step_broadcast")
        return self.handlers[name](**inputs)

    def shutdown(self) -> None:
        if self.comm.world_size > 1:
            self.comm.broadcast_object((SHUTDOWN, {}), src=0, site="step_broadcast")

    def serve_forever(self) -> None:
        while True:
            name, inputs = self.comm.broadcast_object(None, src=0, site="step_broadcast")
            if name == SHUTDOWN:
                return
            self.handlers[name](**inputs)


# A worker entry builds the same handlers as rank 0 (model shard, KV cache) and serves.
WorkerEntry = Callable[[Comm, Any], TPExecutor]


def _leave_signals_to_rank0() -> None:
    """SIGTERM/SIGINT reach every rank (torchrun forwards them, Ctrl-C hits the process group). Rank 0
    drains and then broadcasts the shutdown; a rank that died first would break its last collectives."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _worker_main(
    rank: int,
    world_size: int,
    init_method: str,
    backend: str | None,
    device: str,
    entry: WorkerEntry,
    entry_arg: Any,
) -> None:
    os.environ.update(NO_MULTICAST_ENV)
    _leave_signals_to_rank0()
    logging.basicConfig(level=logging.WARNING)
    comm = init_tp(
        world_size, rank, backend=backend, init_method=init_method, device=rank_device(device, rank)
    )
    executor = entry(comm, entry_arg)
    executor.serve_forever()


def _exit_if_a_worker_dies(procs: list[mp.Process]) -> None:
    """A dead rank would leave rank 0 blocked in a collective forever: fail fast and loud instead."""
    while True:
        for p in procs:
            p.join(timeout=0.5)
            if p.exitcode is not None:
                log.error("TP worker %s exited with code %s; stopping", p.name, p.exitcode)
                os._exit(3)


def launch_tp(
    world_size: int, device: str, entry: WorkerEntry, entry_arg: Any, backend: str | None = None
) -> tuple[Comm, list[mp.Process]]:
    """Join (torchrun) or create (spawn) the TP group. Returns rank 0's Comm.

    Under torchrun every rank calls this; ranks > 0 never return (they serve and exit).
    """
    os.environ.update(NO_MULTICAST_ENV)
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        if world != world_size:
            raise ValueError(f"--tp-size {world_size} but torchrun started WORLD_SIZE={world}")
        comm = init_tp(world, rank, backend=backend, init_method="env://", device=rank_device(device, rank))
        if rank != 0:
            _leave_signals_to_rank0()
            entry(comm, entry_arg).serve_forever()
            raise SystemExit(0)
        return comm, []
    if world_size == 1:
        return init_tp(1, 0, device=rank_device(device, 0)), []
    init_method = f"tcp://127.0.0.1:{_free_port()}"
    ctx = mp.get_context("spawn")
    procs = []
    for rank in range(1, world_size):
        p = ctx.Process(
            target=_worker_main,
            name=f"tp-rank-{rank}",
            daemon=True,
            args=(rank, world_size, init_method, backend, device, entry, entry_arg),
        )
        p.start()
        procs.append(p)
    watchdog = threading.Thread(target=_exit_if_a_worker_dies, args=(procs,), name="tp-watchdog", daemon=True)
    watchdog.start()
    comm = init_tp(world_size, 0, backend=backend, init_method=init_method, device=rank_device(device, 0))
    log.info("tp group ready: %d ranks (%s)", world_size, init_method)
    return comm, procs
