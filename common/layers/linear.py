"""Megatron-style column / row parallel linear layers. Column: output features split; row: input features
split, partial products summed with one all_reduce."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.distributed import Comm
from common.layers.shard import divide, set_shard


class ColumnParallelLinear(nn.Module):
    """y[:, shard] = x @ W[shard].T. The output stays sharded: no collective."""

    def __init__(
        self, in_features: int, out_features: int, comm: Comm, bias: bool = False, dtype=None, device=None
    ):
        super().__init__()
        self.comm = comm
        per_rank = divide(
            out_features, comm.world_size, f"output features of a {in_features}x{out_features} linear"
        )
        start = comm.rank * per_rank
        self.weight = nn.Parameter(
            torch.empty(per_rank, in_features, dtype=dtype, device=device), requires_grad=False
        )
        set_shard(self.weight, (out_features, in_features), dim=0, start=start)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(per_rank, dtype=dtype, device=device), requires_grad=False)
            set_shard(self.bias, (out_features,), dim=0, start=start)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x[:, shard] @ W[:, shard].T). Takes the sharded output of a ColumnParallelLinear."""

    def __init__(self, in_features: int, out_features: int, comm: Comm, site: str, dtype=None, device=None):
        super().__init__()
        self.comm = comm
        self.site = site
        per_rank = divide(
            in_features, comm.world_size, f"input features of a {in_features}x{out_features} linear"
        )
        self.weight = nn.Parameter(
            torch.empty(out_features, per_rank, dtype=dtype, device=device), requires_grad=False
        )
        set_shard(self.weight, (out_features, in_features), dim=1, start=comm.rank * per_rank)

    def forward(self, x: Tensor) -> Tensor:
        return self.comm.all_reduce(F.linear(x, self.weight), self.site)
