"""Vocab-parallel embedding and LM head.

Padding scheme: the vocab is padded up to a multiple of 64 * tp_size, so every rank holds the same number
of rows and each shard is a multiple of 64. Rank r owns global ids [r * shard, (r + 1) * shard); rows past
the real vocab are zero and are never returned (logits cut them off, local argmax masks them to -inf).

`disable_tp=True` builds the replicated variant: tp_rank 0, tp_size 1, the whole (64-padded) vocab on
every rank and no collective in forward. It is what the replicated Markov head uses, and an option for
small-vocab draft LM heads.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.distributed import Comm
from common.kernels import invariant, onednn
from common.layers.shard import set_shard

VOCAB_PADDING = 64


def pad_vocab_size(vocab_size: int, tp_size: int, multiple: int = VOCAB_PADDING) -> int:
    step = multiple * tp_size
    return (vocab_size + step - 1) // step * step


class VocabParallelEmbedding(nn.Module):
    def __init__(
        self,
        vocab_size: int,
        dim: int,
        comm: Comm,
        site: str = "embed",
        disable_tp: bool = False,
        pad_for_tp: int | None = None,
        dtype=None,
        device=None,
    ):
        """`pad_for_tp`: pad as if split that many ways (a replicated head lines up with a sharded one)."""
        super().__init__()
        self.comm = comm
        self.site = site
        self.vocab_size = vocab_size
        self.tp_rank = 0 if disable_tp else comm.rank
        self.tp_size = 1 if disable_tp else comm.world_size
        self.padded_vocab_size = pad_vocab_size(vocab_size, pad_for_tp or self.tp_size)
        if self.tp_size > 1 and self.padded_vocab_size >= 2**24:
            # local argmax ships global ids as fp32, exact only below 2**24
            raise ValueError(f"vocab_size={vocab_size}: too large for exact fp32 token ids (< 2**24)")
        self.shard_size = self.padded_vocab_size // self.tp_size
        self.shard_start = self.tp_rank * self.shard_size
        # Real (non-padding) rows in this shard: a host int, so masking never reads the device.
        self.shard_valid = max(0, min(self.shard_size, vocab_size - self.shard_start))
        self.weight = nn.Parameter(
            torch.empty(self.shard_size, dim, dtype=dtype, device=device), requires_grad=False
        )
        set_shard(self.weight, (vocab_size, dim), dim=0, start=self.shard_start)

    def forward(self, ids: Tensor) -> Tensor:
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.shard_start
        outside = (local < 0) | (local >= self.shard_size)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0)
        return self.comm.all_reduce(out, self.site)

    def local_logits(self, hidden: Tensor) -> Tensor:
        """Raw [N, shard_size] logits of this rank's vocab slice (a tied embedding serves as the LM head)."""
        if invariant.active():
            return invariant.linear(hidden, self.weight)
        out = onednn.linear(hidden, self.weight)  # the CPU, a head packed at load; None elsewhere
        return F.linear(hidden, self.weight) if out is None else out


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head; applied through LogitsProcessor (local_logits), never looked up."""
