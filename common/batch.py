"""Packing requests of different lengths into one padded forward."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class PackedBatch:
    input_ids: torch.Tensor  # [B, L] int64, rows padded with 0
    positions: torch.Tensor  # [B, L] int64, continuing past a row's real tokens
    slots: torch.Tensor  # [B] int64
    last_index: torch.Tensor  # [B] int64, index of each row's last real token
    ctx_len: int  # keys to attend over: max(start + L), rounded up


CTX_ROUND = 64


def pack(
    rows: list[list[int]],
    starts: list[int],
    slots: list[int],
    device: torch.device,
    max_len: int,
    width: int | None = None,
) -> PackedBatch:
    """rows[b] are appended to slot slots[b] at positions starts[b], starts[b]+1, ...

    Padding entries continue the positions, so their KV lands beyond the row's valid
    length where nothing reads it. `width` forces L (static shapes for verification).
    """
    width = width or max(len(r) for r in rows)
    ids = [r + [0] * (width - len(r)) for r in rows]
    positions = [[s + j for j in range(width)] for s in starts]
    ctx = max(s + width for s in starts)
    ctx = min(max_len, -(-ctx // CTX_ROUND) * CTX_ROUND)
    return PackedBatch(
        input_ids=torch.tensor(ids, dtype=torch.int64, device=device),
        positions=torch.tensor(positions, dtype=torch.int64, device=device),
        slots=torch.tensor(slots, dtype=torch.int64, device=device),
        last_index=torch.tensor([len(r) - 1 for r in rows], dtype=torch.int64, device=device),
        ctx_len=ctx,
    )
