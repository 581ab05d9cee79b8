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


def write_tiny_gguf(path: Path, arch: str, cfg, tensors: dict) -> Path:
    """A GGUF file of architecture `arch` with `cfg`'s hyper-parameters and `tensors` (GGUF names ->
    float32 numpy arrays), written by the `gguf` library's own GGUFWriter."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    for name, t in tensors.items():
        w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path
