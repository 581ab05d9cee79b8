"""Megatron-style column / row parallel linear layers. Column: output features split; row: input features
split, partial products summed with one all_reduce."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from common.distributed import Comm
from common.kernels.skinny import linear
from common.layers.shard import MergedPart, ShardSpec, divide, set_merged_shards, set_shard


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
        return linear(x, self.weight, self.bias)


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
        return self.comm.all_reduce(linear(x, self.weight), self.site)


class MergedColumnParallelLinear(nn.Module):
    """Several column-parallel projections of the same input in one GEMM (gate_up_proj, qkv_proj).

    Rank r holds [part_0 shard r; part_1 shard r; ...] along the output dim, so the local output splits
    into the local shards of each part with no collective. Each part is still loaded from its own
    checkpoint tensor (`merged_parts`, see common/layers/shard.py).
    """

    def __init__(
        self,
        in_features: int,
        part_sizes: list[int],
        part_names: list[str],
        comm: Comm,
        bias: bool = False,
        dtype=None,
        device=None,
    ):
        super().__init__()
        self.comm = comm
        self.local_sizes = [
            divide(n, comm.world_size, f"output features of {name} ({in_features}x{n})")
            for n, name in zip(part_sizes, part_names)
        ]
        total = sum(self.local_sizes)
        self.weight = nn.Parameter(
            torch.empty(total, in_features, dtype=dtype, device=device), requires_grad=False
        )
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(total, dtype=dtype, device=device), requires_grad=False)
        for param, full_tail in ((self.weight, (in_features,)), (self.bias, ())):
            if param is None:
                continue
            parts, offset = [], 0
            for name, full, local in zip(part_names, part_sizes, self.local_sizes):
                spec = ShardSpec((full, *full_tail), dim=0, start=comm.rank * local, size=local)
                parts.append(MergedPart(name, offset, spec))
                offset += local
            set_merged_shards(param, parts)

    def forward(self, x: Tensor, glu: bool = False) -> Tensor:
        """glu (two parts, [gate; up]): silu(gate) * up of this rank's shards (`linear`)."""
        assert not glu or len(self.local_sizes) == 2, "glu needs exactly two parts, [gate; up]"
        return linear(x, self.weight, self.bias, glu=glu)


class QKVParallelLinear(MergedColumnParallelLinear):
    """q, k and v projections in one GEMM; the local output is [q heads | k heads | v heads] of this rank."""

    def __init__(
        self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, comm: Comm, bias: bool, **kw
    ):
        sizes = [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim]
        super().__init__(hidden, sizes, ["q_proj", "k_proj", "v_proj"], comm, bias, **kw)


class ReplicatedLinear(nn.Module):
    """y = x @ W.T with the whole W on every rank: for small matrices whose input every rank already
    holds in full (a feature draft's fc), where a sharded one would cost a gather per call."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, dtype=None, device=None):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device), requires_grad=False
        )
        set_shard(self.weight, (out_features, in_features))
        self.bias = None
        if bias:
            self.bias = nn.Parameter(
                torch.empty(out_features, dtype=dtype, device=device), requires_grad=False
            )
            set_shard(self.bias, (out_features,))

    def forward(self, x: Tensor) -> Tensor:
        return linear(x, self.weight, self.bias)


# Every module above applies its `weight` through `linear` (the loader packs them for the CPU: onednn.py).
LINEAR_LAYERS = (ColumnParallelLinear, RowParallelLinear, MergedColumnParallelLinear, ReplicatedLinear)
