"""How a parameter maps onto the full checkpoint tensor: which slice of which dim this rank holds."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds full[..., start:start + size, ...] along `dim` (None: the whole tensor, replicated).

    A slice that runs past the end of the full tensor (vocab padding) is zero-filled.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    size: int = 0


def set_shard(
    param: nn.Parameter, full_shape: tuple[int, ...], dim: int | None = None, start: int = 0
) -> None:
    size = param.shape[dim] if dim is not None else 0
    param.shard = ShardSpec(tuple(full_shape), dim, start, size)  # type: ignore[attr-defined]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator
