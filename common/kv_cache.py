"""Static KV cache: one contiguous [max_len] strip per slot, per layer.

Shapes never change after construction and the forward only indexes it with device tensors (slots,
positions) plus a host-known `ctx_len`, so a decode / verify step can be captured in a CUDA graph per
(batch bucket, ctx_len bucket). All length bookkeeping lives on the host in `SlotTable`: rolling a
request back is `lengths[slot] = n`; the stale entries past n are masked by position and overwritten.
"""

from __future__ import annotations

import torch
from torch import Tensor


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_slots: int,
        max_len: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        """`num_kv_heads` is the LOCAL (per TP rank) head count."""
        self.num_slots = num_slots
        self.max_len = max_len
        shape = (num_slots, max_len, num_kv_heads, head_dim)
        self.k: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v: list[Tensor] = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def for_model(cls, model, num_slots: int, max_len: int) -> KVCache:
        cfg = model.config
        p = model.model.embed_tokens.weight
        local_kv_heads = cfg.num_key_value_heads // model.comm.world_size
        return cls(cfg.num_hidden_layers, num_slots, max_len, local_kv_heads, cfg.head_dim, p.dtype, p.device)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class SlotTable:
    """Host-side slot allocation and per-slot valid KV length. Never reads device memory."""

    def __init__(self, num_slots: int):
        self.num_slots = num_slots
        self.lengths: list[int] = [0] * num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))  # pop() hands out slot 0 first
        self._used: set[int] = set()

    def alloc(self) -> int:
        if not self._free:
            raise RuntimeError(f"KV cache full: all {self.num_slots} slots are in use")
        slot = self._free.pop()
        self._used.add(slot)
        self.lengths[slot] = 0
        return slot

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not allocated")
        self._used.remove(slot)
        self.lengths[slot] = 0
        self._free.append(slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)
