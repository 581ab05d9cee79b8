"""How a parameter maps onto the full checkpoint tensor(s): which slice of which dim this rank holds.

A merged parameter (qkv_proj, gate_up_proj) is several checkpoint tensors stacked along dim 0, each cut
to this rank's slice: rank r holds [q_r; k_r; v_r]. It records its parts in `param.merged_parts`, and
`checkpoint_parts` turns it into one (checkpoint name, destination view) pair per part, so the loader
still reads each checkpoint tensor (q_proj, k_proj, v_proj, ...) by its own name and only its slice.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor, nn


@dataclass(frozen=True)
class ShardSpec:
    """This rank holds full[..., start:start + size, ...] along `dim` (None: the whole tensor, replicated).

    A slice that runs past the end of the full tensor (vocab padding) is zero-filled.
    """

    full_shape: tuple[int, ...]
    dim: int | None = None
    start: int = 0
    size: int = 0


@dataclass(frozen=True)
class MergedPart:
    """One checkpoint tensor inside a merged parameter: rows [offset, offset + spec.size) of dim 0."""

    name: str  # the checkpoint module name replacing the merged one, e.g. "q_proj" for "qkv_proj"
    offset: int
    spec: ShardSpec


@dataclass
class ParamPart:
    """A destination the loader fills: `data` (a view into the parameter) and the slice it holds."""

    data: Tensor
    shard: ShardSpec


def set_shard(
    param: nn.Parameter, full_shape: tuple[int, ...], dim: int | None = None, start: int = 0
) -> None:
    size = param.shape[dim] if dim is not None else 0
    param.shard = ShardSpec(tuple(full_shape), dim, start, size)  # type: ignore[attr-defined]


def set_merged_shards(param: nn.Parameter, parts: list[MergedPart]) -> None:
    param.merged_parts = parts  # type: ignore[attr-defined]


def checkpoint_parts(name: str, param: nn.Parameter) -> list[tuple[str, ParamPart | nn.Parameter]]:
    """(checkpoint tensor name, destination) pairs for parameter `name`: itself, or one per merged part.

    "model.layers.0.self_attn.qkv_proj.weight" -> ("...self_attn.q_proj.weight", rows of q), (k), (v).
    """
    parts = getattr(param, "merged_parts", None)
    if parts is None:
        return [(name, param)]
    module, _merged, leaf = name.rsplit(".", 2)
    return [
        (f"{module}.{p.name}.{leaf}", ParamPart(param.data.narrow(0, p.offset, p.spec.size), p.spec))
        for p in parts
    ]


def divide(numerator: int, denominator: int, what: str) -> int:
    if numerator % denominator:
        raise ValueError(f"{what}={numerator} is not divisible by tp_size={denominator}")
    return numerator // denominator
