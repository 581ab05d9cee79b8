"""fp32 linear layers on the CPU through oneDNN, with each weight packed once at load time.

F.linear on the CPU calls MKL's sgemm, which lays the weight out for its micro-kernel (packs it) on every
call; for the few rows of a decode or verify step the packing costs more than the product, and on AMD
CPUs MKL's path for 2-4 rows is slower than for 5. Measured on 2 cores of an AMD EPYC (torch 2.13):
SmolLM2-135M's gate_up [3072 x 576] at 3 rows takes 0.39 ms in F.linear and 0.13 ms packed; its LM head
[49152 x 576] 33 ms and 5 ms; 1 row 9.8 ms and 4.8 ms. oneDNN ships inside every torch CPU build
(torch.ops.mkldnn, the kernels torch.compile's CPU backend freezes weights into).

A packed weight is an opaque tensor kept beside the parameter (`weight.onednn`, with the parameter's
version counter at packing): a weight changed in place afterwards (an optimizer step) is never served
stale, the call falls back to F.linear. Calls that need a gradient also fall back (oneDNN's op has none).
As with MKL, a row may round differently with the number of rows in the call (a long K is summed in
splits for few rows). SPECSPLIT_ONEDNN=0 keeps F.linear.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch
from torch import Tensor, nn

ENABLED = os.environ.get("SPECSPLIT_ONEDNN", "1") != "0"
# Calls of more rows stay on F.linear: the few rows of a small batch's decode or verify step are where
# MKL's packing per call dominates, and oneDNN over every shape a server sees (prefills, large batches)
# grew a CPU target's memory by 4-8 % over a 64-stream soak against 1-3 % here (tests/test_load.py).
MAX_ROWS = 8


def available() -> bool:
    return ENABLED and torch.backends.mkldnn.is_available()


def pack(weight: Tensor) -> None:
    """Packs `weight` [N, K] (fp32, on the CPU) for `linear`; anything else is left as it is."""
    if available() and weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2:
        with torch.no_grad():
            weight.onednn = (torch.ops.mkldnn._reorder_linear_weight(weight.detach()), weight._version)  # type: ignore[attr-defined]


def pack_modules(modules: Iterable[nn.Module]) -> None:
    """Packs the `weight` of each module (ones that apply it as a linear layer)."""
    for module in modules:
        pack(module.weight)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor | None:
    """x [..., K] @ weight [N, K].T + bias [N] through the packed weight, or None where there is none
    (not packed, changed since, a gradient needed, or more than MAX_ROWS rows)."""
    packed = getattr(weight, "onednn", None)
    if packed is None or packed[1] != weight._version or x.dtype != torch.float32:
        return None
    if x.numel() > MAX_ROWS * x.shape[-1]:
        return None
    if torch.is_grad_enabled() and (x.requires_grad or weight.requires_grad):
        return None
    return torch.ops.mkldnn._linear_pointwise(x, packed[0], bias, "none", [], "")
