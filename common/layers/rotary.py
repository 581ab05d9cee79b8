"""Rotary position embeddings (HF "rotate half" layout) with the rope_theta / rope_scaling of the config."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


def rope_inv_freq(head_dim: int, theta: float, scaling: dict | None) -> Tensor:
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim))
    if not scaling:
        return inv_freq.float()
    rope_type = scaling.get("rope_type", scaling.get("type", "default"))
    if rope_type == "linear":
        inv_freq = inv_freq / float(scaling["factor"])
    elif rope_type == "llama3":
        inv_freq = _llama3_inv_freq(inv_freq, scaling)
    return inv_freq.float()


def _llama3_inv_freq(inv_freq: Tensor, scaling: dict) -> Tensor:
    # Llama 3.1: long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_len = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_len / low_freq_factor
    high_freq_wavelen = old_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, theta: float, scaling: dict | None, device=None):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(head_dim, theta, scaling).to(device), persistent=False)
        self._table: tuple[Tensor, Tensor] | None = None

    def forward(self, positions: Tensor) -> tuple[Tensor, Tensor]:
        """positions [B, L] -> cos, sin [B, L, 1, head_dim] in fp32."""
        freqs = positions.unsqueeze(-1).float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(-2)
        return emb.cos(), emb.sin()

    def table(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin [>= length, head_dim] fp32: row p is `forward`'s for position p. Built once (at a
        forward's first, eager run: never inside a CUDA-graph capture); every forward after it reads its
        rows by position inside the attention kernel instead of computing them (five small kernels per
        forward: the cast, the product, the concatenation, cos and sin)."""
        table = self._table
        if table is None or table[0].shape[0] < length or table[0].device != self.inv_freq.device:
            if self.inv_freq.is_cuda and torch.cuda.is_current_stream_capturing():
                raise RuntimeError(f"rotary table for {length} positions first needed inside a graph capture")
            positions = torch.arange(length, device=self.inv_freq.device).unsqueeze(0)
            # One thread on the CPU: there a table-sized cos / sin is split between MKL's threads, and a
            # thread's first call came out up to 1e-5 off for its rows under load (two builds of one
            # table differed; tests/test_fused_kernels.py failed about 1 run in 10 on a loaded 2-core
            # machine). Built once per cache length, at start-up.
            if positions.is_cuda:
                cos, sin = self(positions)
            else:
                threads = torch.get_num_threads()
                torch.set_num_threads(1)
                try:
                    cos, sin = self(positions)
                finally:
                    torch.set_num_threads(threads)
            table = self._table = (cos.view(length, -1), sin.view(length, -1))
        return table
