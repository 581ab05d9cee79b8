"""Target features for feature drafts: what the target hands its draft for every token it computes.

A feature draft (common/models/feature_draft.py) reads, for position p, the target's residual streams
entering a few of its layers at position p - 1, side by side: F = len(layers) * hidden values. The target
writes them in every forward (prefill, plain step, verify) into a `FeatureStore` indexed like its KV
cache, [slot, position]; positions of rejected drafts are overwritten by later forwards as their KV is.
A draft service keeps a store of its own, filled over the Speculate stream with bf16 bytes (`to_wire` /
`from_wire`, one row per committed token); in the target's process the draft reads the target's store.
Nothing is sent for plain steps: the next ask carries every row the draft lacks (lazy catch-up).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from common.cuda_graphs import copy_from_host
from common.kernels import fused

# The Speculate protocol version whose starts and verdicts carry features (protos/specsplit/v1/draft.proto).
FEATURE_PROTOCOL = 2
WIRE_DTYPE = torch.bfloat16  # features cross the wire in bf16 whatever the models' dtype


class FeatureStore:
    """[num_slots, max_len, F] features of `layers` (the target's layer indices whose input stream they
    are), in `dtype` on `device`."""

    def __init__(self, layers, hidden_size: int, num_slots: int, max_len: int, dtype, device):
        self.layers = tuple(layers)
        self.size = len(self.layers) * hidden_size
        self.data = torch.zeros(num_slots, max_len, self.size, dtype=dtype, device=device)

    def write_stream(
        self, slots: Tensor, positions: Tensor, j: int, x: Tensor, residual: Tensor | None
    ) -> None:
        """The stream entering layers[j], x + residual ([B, L, H] each; x alone without a residual), into
        its columns of rows (slot, position): one kernel on the GPU, called as the forward reaches the
        layer (Transformer.forward)."""
        write = fused.feature_write if fused.on_gpu(x) else fused.feature_write_reference
        write(self.data, slots, positions, x, residual, j * x.shape[-1])

    def previous(self, slots: Tensor, positions: Tensor) -> Tensor:
        """slots [B], positions [B, L] -> [B, L, F] the features at each position - 1 (zeros at 0): what a
        feature draft reads beside the token at each position."""
        prev = positions - 1
        rows = self.data[slots[:, None], prev.clamp(min=0)]
        return rows * (prev >= 0).unsqueeze(-1).to(rows.dtype)

    def put_many(self, writes) -> None:
        """writes: (slot, start, rows [n, F] in WIRE_DTYPE on the CPU): each write's rows to positions
        start..start + n - 1 of its slot, with one copy to the device for all of them (a message's
        features) and no wait for it."""
        writes = [w for w in writes if len(w[2])]
        if not writes:
            return
        rows = torch.cat([w[2] for w in writes]) if len(writes) > 1 else writes[0][2]
        arrived = torch.empty(len(rows), self.size, dtype=WIRE_DTYPE, device=self.data.device)
        copy_from_host(arrived, rows)
        at = 0
        for slot, start, part in writes:
            n = len(part)
            self.data[slot, start : start + n] = arrived[at : at + n]
            at += n


def to_wire(rows: Tensor) -> bytes:
    """[n, F] features -> little-endian bf16 bytes (numpy has no bf16: its bits travel as uint16)."""
    return rows.to(WIRE_DTYPE).contiguous().view(torch.int16).cpu().numpy().tobytes()


def from_wire(data: bytes, size: int, field: str) -> Tensor:
    """bf16 bytes -> [n, size] on the CPU; a ValueError naming `field` when they are not whole rows."""
    if len(data) % (2 * size):
        raise ValueError(f"{field}: {len(data)} bytes is not a whole number of bf16 rows of {size} features")
    flat = torch.from_numpy(np.frombuffer(data, dtype=np.int16).copy()).view(WIRE_DTYPE)
    return flat.view(-1, size)


def parse_ints(text: str, flag: str) -> tuple[int, ...]:
    """ "2,15,27" -> (2, 15, 27); "" -> (); a ValueError naming `flag` otherwise."""
    try:
        values = tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise ValueError(f"{flag}: {text!r} is not a comma-separated list of layer indices") from None
    if any(v < 0 for v in values):
        raise ValueError(f"{flag}: {text!r}: layer indices are >= 0")
    return values
