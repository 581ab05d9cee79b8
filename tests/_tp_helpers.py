"""Runs a scenario function on every rank of a real multi-process gloo TP group (CPU)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from common.distributed import init_tp


def _entry(rank: int, world_size: int, init_method: str, out_dir: str, scenario, args) -> None:
    torch.set_num_threads(1)  # N ranks share 2 cores
    comm = init_tp(world_size, rank, init_method=init_method)
    try:
        torch.save(scenario(comm, *args), Path(out_dir) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def run_tp(world_size: int, scenario, *args) -> list:
    """Spawns `world_size` processes running scenario(comm, *args); returns each rank's result.

    `scenario` must be a module-level function (it is pickled by name). A failing rank raises here
    with its traceback.
    """
    with tempfile.TemporaryDirectory() as tmp:
        init_method = f"file://{tmp}/rendezvous"
        mp.spawn(_entry, args=(world_size, init_method, tmp, scenario, args), nprocs=world_size, join=True)
        return [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=False) for r in range(world_size)]
