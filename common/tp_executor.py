"""Running one service's model on a tensor-parallel group.

Rank 0 owns the gRPC server and the scheduler. For every step it broadcasts a
small command (handler + host-side inputs, packed into one int64 tensor) to the
other ranks, then all ranks run the same handler, so every collective inside the
model lines up. Ranks come
either from `torchrun` (RANK / WORLD_SIZE / MASTER_ADDR in the environment) or
from the service spawning its own worker processes.
"""

from __future__ import annotations

import inspect
import logging
import multiprocessing as mp
import multiprocessing.connection
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from common.distributed import Comm, count_comm, init_tp
from common.lifecycle import freeze_startup_heap

log = logging.getLogger(__name__)

# NVLink multicast can take a shared host's GPUs down; keep it off in every rank we start.
NO_MULTICAST_ENV = {
    "NCCL_NVLS_ENABLE": "0",
    "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
    "NVSHMEM_DISABLE_NVLS": "1",
}

Handler = Callable[..., Any]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_device(device: str, rank: int) -> torch.device:
    if device.startswith("cuda"):
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        return torch.device("cuda", local_rank)
    return torch.device(device)


def tp_gpu_uuids(device: str, tp_size: int) -> list[str]:
    """UUIDs of the GPUs of this host's ranks of the TP group whose rank 0 is this process; [] on CPU.

    Rank r runs on cuda:r of the visible devices (`rank_device`: the ranks the service spawns, or
    torchrun's local ranks); ranks on other hosts (torchrun, LOCAL_WORLD_SIZE < tp_size) are left out. A
    UUID names the physical GPU whatever CUDA_VISIBLE_DEVICES calls it, so two services' lists compare: a
    target sends its own on each Speculate stream's first message, and a draft that finds one of its own
    among them drafts no rounds ahead for that stream (on a shared GPU they only delay the verify)."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return []
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))
    count = min(tp_size, local, torch.cuda.device_count())
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]


# A step command travels as one fixed-size int64 message: a header and the packed inputs. Only inputs
# past the capacity (a long prefill) need a second broadcast, and only values the codec cannot pack
# (rare control calls) fall back to a pickled object.
_HEADER = 3  # kind, handler index, payload length
_CAPACITY = 1024
_KIND_SHUTDOWN, _KIND_PACKED, _KIND_PICKLED = 0, 1, 2
_INT, _FLOAT, _INTS, _FLOATS, _ROWS = range(5)  # value tags of the codec


def encode_inputs(values: list[Any]) -> np.ndarray | None:
    """Packs ints, floats, lists of either and lists of int lists into int64; None if any value is else.

    Floats travel as the bits of their float64, so they come back exactly.
    """
    out: list[int] = []
    floats: list[tuple[int, list[float]]] = []  # (offset, values) filled in after the int pass
    for v in values:
        if type(v) is int:
            out += (_INT, v)
        elif type(v) is float:
            floats.append((len(out) + 1, [v]))
            out += (_FLOAT, 0)
        elif type(v) is list and all(type(x) is int for x in v):
            out += (_INTS, len(v), *v)
        elif type(v) is list and all(type(x) is float for x in v):
            floats.append((len(out) + 2, v))
            out += (_FLOATS, len(v), *([0] * len(v)))
        elif type(v) is list and all(type(r) is list and all(type(x) is int for x in r) for r in v):
            out += (_ROWS, len(v), *(len(r) for r in v))
            for r in v:
                out += r
        else:
            return None
    arr = np.array(out, dtype=np.int64)
    for offset, vals in floats:
        arr[offset : offset + len(vals)] = np.array(vals, dtype=np.float64).view(np.int64)
    return arr


def decode_inputs(arr: np.ndarray, count: int) -> list[Any]:
    """The inverse of `encode_inputs` for `count` values."""
    values: list[Any] = []
    i = 0
    for _ in range(count):
        tag = int(arr[i])
        if tag == _INT:
            values.append(int(arr[i + 1]))
            i += 2
        elif tag == _FLOAT:
            values.append(float(arr[i + 1 : i + 2].view(np.float64)[0]))
            i += 2
        elif tag in (_INTS, _FLOATS):
            n = int(arr[i + 1])
            chunk = arr[i + 2 : i + 2 + n]
            values.append((chunk.view(np.float64) if tag == _FLOATS else chunk).tolist())
            i += 2 + n
        elif tag == _ROWS:
            n = int(arr[i + 1])
            lens = arr[i + 2 : i + 2 + n].tolist()
            i += 2 + n
            rows = []
            for length in lens:
                rows.append(arr[i : i + length].tolist())
                i += length
            values.append(rows)
        else:
            raise ValueError(f"step message: unknown value tag {tag} at {i}")
    return values


class TPExecutor:
    """Rank 0 calls `run(name, **inputs)`; other ranks sit in `serve_forever()`.

    Per step rank 0 broadcasts one [_HEADER + _CAPACITY] int64 message on a CPU (gloo) control group:
    no pickling, no length round trip, no GPU work. Idle ranks wait for it in a blocking socket read,
    not in an NCCL kernel: a waiting NCCL broadcast spins on its GPU, and where several services share
    GPUs (a draft and a target TP group on the same two GPUs, or several targets) each idle rank's
    spinning kernel took GPU time slices from the busy ones (a TP=2 step cost ~11 ms instead of ~2.5).
    The model's own collectives stay on NCCL, inside the CUDA graphs.
    """

    def __init__(self, comm: Comm, handlers: dict[str, Handler]):
        self.comm = comm
        self.handlers = handlers
        self.names = list(handlers)
        # Handler parameters in signature order: the packed message carries values only.
        self.params = {n: list(inspect.signature(h).parameters) for n, h in handlers.items()}
        self._message = torch.zeros(_HEADER + _CAPACITY, dtype=torch.int64)
        self.control = None
        # Steps may come from several threads (the draft's streams); the shutdown must not interleave
        # with a step's broadcasts, and no step may follow it (the workers are gone).
        self._lock = threading.Lock()
        self._stopped = False
        if comm.world_size > 1:  # collective: every rank builds its executor in the same order
            cuda = comm.device.type == "cuda"
            self.control = torch.distributed.new_group(backend="gloo") if cuda else comm.group

    def run(self, name: str, **inputs: Any) -> Any:
        if self.comm.world_size == 1:
            return self.handlers[name](**inputs)
        with self._lock:
            if self._stopped:
                raise RuntimeError(f"{name}: the TP group has shut down")
            params = self.params[name]
            payload = encode_inputs([inputs[p] for p in params]) if set(inputs) == set(params) else None
            if payload is None:
                self._send(_KIND_PICKLED, self.names.index(name))
                self.comm.broadcast_object(inputs, src=0, site="step_broadcast")
            else:
                self._send(_KIND_PACKED, self.names.index(name), payload)
            return self.handlers[name](**inputs)

    def shutdown(self) -> None:
        """Tells the workers to exit, after the step in flight (if any); later `run` calls raise."""
        if self.comm.world_size > 1:
            with self._lock:
                if not self._stopped:
                    self._stopped = True
                    self._send(_KIND_SHUTDOWN, 0)

    def _broadcast(self, t: torch.Tensor) -> None:
        count_comm("broadcast", "step_broadcast", t.numel() * t.element_size())
        torch.distributed.broadcast(t, src=0, group=self.control)

    def _send(self, kind: int, handler: int, payload: np.ndarray | None = None) -> None:
        n = 0 if payload is None else len(payload)
        head = min(n, _CAPACITY)
        host = self._message.numpy()
        host[:_HEADER] = (kind, handler, n)
        if head:
            host[_HEADER : _HEADER + head] = payload[:head]
        self._broadcast(self._message)
        if n > _CAPACITY:  # the rest of a long prefill
            self._broadcast(torch.from_numpy(np.ascontiguousarray(payload[_CAPACITY:])))

    def _receive(self) -> tuple[int, int, np.ndarray]:
        self._broadcast(self._message)
        host = self._message.numpy()
        kind, handler, n = (int(x) for x in host[:_HEADER])
        payload = host[_HEADER : _HEADER + min(n, _CAPACITY)]  # a view: decode_inputs copies out (tolist)
        if n > _CAPACITY:
            rest = torch.empty(n - _CAPACITY, dtype=torch.int64)
            self._broadcast(rest)
            payload = np.concatenate([payload, rest.numpy()])
        return kind, handler, payload

    def serve_forever(self) -> None:
        freeze_startup_heap()  # this rank's model is loaded: as rank 0 does when it starts serving
        while True:
            kind, handler, payload = self._receive()
            if kind == _KIND_SHUTDOWN:
                return
            name = self.names[handler]
            if kind == _KIND_PICKLED:
                inputs = self.comm.broadcast_object(None, src=0, site="step_broadcast")
            else:
                params = self.params[name]
                inputs = dict(zip(params, decode_inputs(payload, len(params))))
            self.handlers[name](**inputs)


# A worker entry builds the same handlers as rank 0 (model shard, KV cache) and serves.
WorkerEntry = Callable[[Comm, Any], TPExecutor]


def _leave_signals_to_rank0() -> None:
    """SIGTERM/SIGINT reach every rank (torchrun forwards them, Ctrl-C hits the process group). Rank 0
    drains and then broadcasts the shutdown; a rank that died first would break its last collectives."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def _exit_after_shutdown() -> None:
    """A worker's end once rank 0 has sent the shutdown: exit 0 without the interpreter's teardown. Torn
    down at interpreter exit, the gloo group's threads now and then abort the process (`terminate called
    without an active exception`, exit code -6) after a clean stop; the worker holds nothing to save."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


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
    _exit_after_shutdown()


class TPWorkers:
    """The worker processes rank 0 spawned, and the watchdog that ends rank 0 if one of them dies.

    A dead rank would leave rank 0 blocked in a collective forever, so until `stop` a worker's exit (any
    code) ends the service at once with exit code 3 and a log line naming the rank. `stop` (after the
    drain) tells the watchdog that the workers' exit is expected, sends them the shutdown and returns
    non-zero if any of them fails to exit cleanly.
    """

    EXIT_CODE = 3

    def __init__(self, procs: list[mp.Process]):
        self.procs = procs
        self._stopping = threading.Event()
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        if procs:
            self._watchdog.start()

    def _watch(self) -> None:
        # Waits on the sentinels (no reaping): only `stop` joins the processes, after this thread ended.
        sentinels = {p.sentinel: p for p in self.procs}
        while not self._stopping.is_set():
            for sentinel in mp.connection.wait(list(sentinels), timeout=0.5):
                if self._stopping.is_set():
                    return
                p = sentinels[sentinel]
                p.join(timeout=5)  # the sentinel closes as the process exits, its status comes just after
                log.error("TP worker %s exited with code %s; stopping the service", p.name, p.exitcode)
                logging.shutdown()
                os._exit(self.EXIT_CODE)

    def stop(self, executor: TPExecutor, timeout: float = 10.0) -> int:
        """Shuts the workers down; 0 if every one exited with 0 within `timeout`, else EXIT_CODE."""
        self._stopping.set()
        if self._watchdog.is_alive():
            self._watchdog.join()
        executor.shutdown()
        failed = []
        for p in self.procs:
            p.join(timeout=timeout)
            if p.exitcode != 0:
                failed.append(f"{p.name} ({'still running' if p.exitcode is None else p.exitcode})")
        if failed:
            log.error("TP workers did not stop cleanly: %s", ", ".join(failed))
            return self.EXIT_CODE
        return 0


def torchrun_rank() -> int:
    """This process's rank when torchrun started it (RANK/WORLD_SIZE set), else 0."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return 0


def launch_tp(
    world_size: int, device: str, entry: WorkerEntry, entry_arg: Any, backend: str | None = None
) -> tuple[Comm, TPWorkers]:
    """Join (torchrun) or create (spawn) the TP group. Returns rank 0's Comm and the spawned workers (none
    under torchrun, whose agent watches the ranks itself).

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
            _exit_after_shutdown()
        return comm, TPWorkers([])
    if world_size == 1:
        return init_tp(1, 0, device=rank_device(device, 0)), TPWorkers([])
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
    workers = TPWorkers(procs)
    comm = init_tp(world_size, 0, backend=backend, init_method=init_method, device=rank_device(device, 0))
    log.info("tp group ready: %d ranks (%s)", world_size, init_method)
    return comm, workers
