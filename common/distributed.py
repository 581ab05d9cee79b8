"""Tensor-parallel process groups and the one collective wrapper that every TP site goes through.

Every collective in the models and services is issued through `Comm`, which counts calls and bytes per
(op, site). The counts feed the Prometheus metrics and the communication figures in docs/core.md.

Byte convention (per process: each rank counts what it itself takes part in):
  - all_gather: the size of the gathered OUTPUT, i.e. world_size * input bytes. Local argmax at TP=2
    gathers a [rows, 2] fp32 tensor from each rank: 2 * 2 * 4 = 16 bytes per row.
  - all_reduce, broadcast: the size of the tensor.
  - broadcast_object: the size of the pickled payload (the 8-byte length header is not counted).
A world of one issues no collective and counts nothing.

Counting is two integer additions on a dict entry using tensor metadata only: it never reads a tensor,
so it never syncs the GPU and is safe inside CUDA-graph capture (where it counts once, at capture).

Sites: attn_out, mlp_out, embed, lm_head_argmax, logits_gather, markov_head, step_broadcast.
"""

from __future__ import annotations

import os
import pickle
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

# torch >= 2.12 renamed all_gather_into_tensor; the GPU machines run 2.11.
_all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# (op, site) -> [calls, bytes]; a plain dict of lists keeps each update to two integer adds.
_STATS: dict[tuple[str, str], list[int]] = {}


def count_comm(op: str, site: str, nbytes: int) -> None:
    entry = _STATS.get((op, site))
    if entry is None:
        _STATS[(op, site)] = [1, nbytes]
    else:
        entry[0] += 1
        entry[1] += nbytes


def comm_stats() -> dict[tuple[str, str], tuple[int, int]]:
    """(op, site) -> (calls, bytes) counted by THIS process since the last reset."""
    return {key: (calls, nbytes) for key, (calls, nbytes) in _STATS.items()}


def add_comm_stats(delta: dict[tuple[str, str], tuple[int, int]]) -> None:
    """Adds counts observed elsewhere, e.g. the collectives a replayed CUDA graph performed again."""
    for key, (calls, nbytes) in delta.items():
        entry = _STATS.setdefault(key, [0, 0])
        entry[0] += calls
        entry[1] += nbytes


def reset_comm_stats() -> None:
    _STATS.clear()


def _nbytes(t: Tensor) -> int:
    return t.numel() * t.element_size()


# SPECSPLIT_ALL_REDUCE=symm: small GPU all-reduces go through torch symmetric memory (one-shot: every rank
# reads its peers' buffers over NVLink in one kernel) instead of NCCL's ring. No multicast is used.
ALL_REDUCE = os.environ.get("SPECSPLIT_ALL_REDUCE", "nccl")


class OneShotAllReduce:
    """Sum of a small tensor across the group via symmetric memory, CUDA-graph capturable.

    Two symmetric buffers per dtype, used in turn: a rank refills a buffer only after every rank has
    entered the next all-reduce, i.e. finished reading it. Allocation and rendezvous are collective and
    happen at the first call per dtype, which every rank makes at the same point (an eager warm-up).
    """

    MAX_BYTES = 1 << 20

    def __init__(self, group: Any):
        self.group_name = group.group_name
        self.buffers: dict[torch.dtype, list[Tensor]] = {}
        self.turn = 0

    def __call__(self, t: Tensor) -> Tensor:
        from torch.distributed import _symmetric_memory as symm_mem

        if t.dtype not in self.buffers:
            numel = self.MAX_BYTES // t.element_size()
            bufs = [symm_mem.empty(numel, dtype=t.dtype, device=t.device) for _ in range(2)]
            for buf in bufs:
                symm_mem.rendezvous(buf, self.group_name)
            self.buffers[t.dtype] = bufs
        buf = self.buffers[t.dtype][self.turn][: t.numel()]
        self.turn ^= 1
        out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf, t.reshape(-1), "sum", self.group_name)
        return out.view(t.shape)


class Comm:
    """A TP group. All methods are collective: every rank of the group must call them in the same order."""

    def __init__(
        self, rank: int = 0, world_size: int = 1, group: Any = None, device: torch.device | None = None
    ):
        self.rank = rank
        self.world_size = world_size
        self.group = group
        self.device = torch.device("cpu") if device is None else torch.device(device)
        self._one_shot: OneShotAllReduce | None = None

    def all_reduce(self, t: Tensor, site: str) -> Tensor:
        if self.world_size == 1:
            return t
        count_comm("all_reduce", site, _nbytes(t))
        if t.is_cuda and ALL_REDUCE == "symm" and _nbytes(t) <= OneShotAllReduce.MAX_BYTES:
            if self._one_shot is None:
                self._one_shot = OneShotAllReduce(self.group)
            return self._one_shot(t)
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def all_gather(self, t: Tensor, site: str) -> Tensor:
        """Concatenates every rank's `t` along dim 0, in rank order: [world * rows, ...]."""
        if self.world_size == 1:
            return t
        t = t.contiguous()
        out = t.new_empty((self.world_size * t.shape[0], *t.shape[1:]))
        count_comm("all_gather", site, _nbytes(out))
        _all_gather_single(out, t, group=self.group)
        return out

    def broadcast(self, t: Tensor, src: int, site: str) -> Tensor:
        if self.world_size == 1:
            return t
        count_comm("broadcast", site, _nbytes(t))
        dist.broadcast(t, src=src, group=self.group)
        return t

    def broadcast_object(self, obj: Any, src: int, site: str) -> Any:
        """Broadcasts a picklable object (a step command). Costs a host sync: use it between forwards."""
        if self.world_size == 1:
            return obj
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        if self.rank == src:
            payload = torch.frombuffer(bytearray(pickle.dumps(obj)), dtype=torch.uint8).to(self.device)
            size[0] = payload.numel()
        dist.broadcast(size, src=src, group=self.group)
        nbytes = int(size.item())
        if self.rank != src:
            payload = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        dist.broadcast(payload, src=src, group=self.group)
        count_comm("broadcast", site, nbytes)
        if self.rank == src:
            return obj
        return pickle.loads(payload.cpu().numpy().tobytes())

    def barrier(self) -> None:
        if self.world_size > 1:
            dist.barrier(group=self.group)

    def __repr__(self) -> str:
        return f"Comm(rank={self.rank}, world_size={self.world_size}, device={self.device})"


def init_tp(
    world_size: int,
    rank: int,
    backend: str | None = None,
    init_method: str | None = None,
    device: torch.device | None = None,
) -> Comm:
    """Joins the TP group: nccl when `device` is CUDA, gloo otherwise. A world of one needs no process group.

    `init_method` defaults to env:// (MASTER_ADDR / MASTER_PORT), as torchrun sets them.
    """
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"init_tp: rank={rank} must be in [0, world_size={world_size})")
    device = torch.device("cpu") if device is None else torch.device(device)
    if world_size == 1:
        return Comm(0, 1, None, device)
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group(
            backend, init_method=init_method or "env://", world_size=world_size, rank=rank
        )
    return Comm(rank, world_size, dist.group.WORLD, device)


def _local_world_entry(rank: int, world_size: int, init_method: str, out_dir: str, fn, args) -> None:
    import os

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    comm = init_tp(world_size, rank, init_method=init_method)
    try:
        torch.save(fn(comm, *args), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def run_local_world(world_size: int, fn, *args) -> list:
    """Runs fn(comm, *args) on `world_size` spawned CPU processes joined in a gloo TP group; returns each
    rank's result (saved with torch.save). `fn` must be a module-level function: it is pickled by name.
    For tests and benchmarks; services start their ranks themselves."""
    import tempfile

    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        mp.spawn(
            _local_world_entry, args=(world_size, init_method, tmp, fn, args), nprocs=world_size, join=True
        )
        return [torch.load(f"{tmp}/rank{r}.pt", weights_only=False) for r in range(world_size)]
