"""The tests' tiny random checkpoints: common.tiny's writer (`specsplit make-tiny-model`) with the model
features the tests switch on by name. Each feature left at None keeps the writer's default."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from common import tiny


def make_tiny_model(
    path: str | Path,
    *,
    head_dim: int | None = None,
    rope_theta: float | None = None,
    rope_scaling: dict | None = None,
    final_logit_softcapping: float | None = None,
    logit_scale: float | None = None,
    **kwargs: Any,
) -> Path:
    """common.tiny.make_tiny_model(path, **kwargs) with these config.json entries set where given."""
    features = dict(head_dim=head_dim, rope_theta=rope_theta, rope_scaling=rope_scaling,
                    final_logit_softcapping=final_logit_softcapping, logit_scale=logit_scale)  # fmt: skip
    config = {name: value for name, value in features.items() if value is not None}
    return tiny.make_tiny_model(path, config=config, **kwargs)
