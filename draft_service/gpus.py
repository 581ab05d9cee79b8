"""The GPUs a service's TP group runs on, named by UUID. A target sends its own on the first message of a
Speculate stream (`SpeculateRequest.target_gpus`); a draft that finds one of its own among them drafts no
rounds ahead for that stream (draft_service/server.py): on a shared GPU they only delay the verify."""

from __future__ import annotations

import os

import torch


def tp_gpu_uuids(device: str, tp_size: int) -> list[str]:
    """UUIDs of the GPUs of this host's ranks of the TP group whose rank 0 is this process; [] on CPU.

    Rank r runs on cuda:r of the visible devices (common.tp_executor.rank_device: the ranks the service
    spawns, or torchrun's local ranks); ranks on other hosts (torchrun, LOCAL_WORLD_SIZE < tp_size) are left
    out. A UUID names the physical GPU whatever CUDA_VISIBLE_DEVICES calls it, so two services' lists
    compare."""
    if not device.startswith("cuda") or not torch.cuda.is_available():
        return []
    local = int(os.environ.get("LOCAL_WORLD_SIZE", tp_size))
    count = min(tp_size, local, torch.cuda.device_count())
    return [str(torch.cuda.get_device_properties(i).uuid) for i in range(count)]
