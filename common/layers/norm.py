from __future__ import annotations

import torch
from torch import Tensor, nn

from common.kernels import fused
from common.layers.shard import set_shard


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, dtype=None, device=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)
        set_shard(self.weight, (dim,))

    def forward(self, x: Tensor, residual: Tensor | None = None) -> Tensor | tuple[Tensor, Tensor]:
        """norm(x), or with `residual`: (norm(x + residual), x + residual), the add fused into the norm.

        Normalise in fp32 like the HF reference: bf16 mean-of-squares loses too much. One fused kernel
        on the GPU, where the eager op chain's launches would dominate a small-batch step."""
        gpu = fused.on_gpu(x)
        if residual is None:
            return (
                fused.rms_norm(x, self.weight, self.eps)
                if gpu
                else fused.rms_norm_reference(x, self.weight, self.eps)
            )
        if gpu:
            return fused.add_rms_norm(x, residual, self.weight, self.eps)
        return fused.add_rms_norm_reference(x, residual, self.weight, self.eps)
