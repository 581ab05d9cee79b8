from __future__ import annotations

import torch
from torch import Tensor, nn

from common.layers.shard import set_shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        set_shard(self.weight, (dim,))

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in fp32 like the HF reference: bf16 mean-of-squares loses too much.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)
