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
        self._cos = self._sin = torch.empty(0, head_dim // 2, device=device)

    def table(self, length: int) -> tuple[Tensor, Tensor]:
        """cos, sin [>= length, head_dim // 2] fp32: row p holds position p's angles (HF's rotate-half
        layout uses each angle for dims i and i + head_dim / 2, so half a row is the whole of it).

        Built once per cache length, outside any CUDA graph (a graph's capture first runs its step
        eagerly), so a step only reads it: no per-step cos / sin kernels. Each entry is the same
        elementwise float(p) * inv_freq -> cos / sin a per-step computation would make."""
        if self._cos.shape[0] < length:
            freqs = torch.arange(length, device=self.inv_freq.device).float()[:, None] * self.inv_freq
            self._cos, self._sin = freqs.cos(), freqs.sin()
        return self._cos, self._sin
