"""Feature draft (EAGLE-3 style): one decoder layer over the token embedding and the target's features.

Position p reads token t_p and f_{p-1}, the target's features at position p - 1 (the residual streams
entering a low, a middle and a high target layer, side by side: common/features.py). `fc` maps them to
the hidden width h; the layer's attention reads [input_layernorm(embed(t_p)) | hidden_norm(h)] (2H wide),
h is its residual stream, and the output after the final norm goes to the target's LM head and predicts
t_{p+1}. Past the committed tokens there are no target features: a drafted position reads the draft's
own pre-norm stream at the position before (`aux`) in place of fc(f), which is what training-time test
trains (common/training/feature_train.py). Position 0 has no predecessor and reads zeros.

The embedding and LM head are the target's (shared, frozen); the Markov head, a reduced draft vocabulary
(d2t) and local argmax work as in a layer draft (`Transformer`), whose head methods this class keeps.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.config import ModelConfig
from common.distributed import Comm
from common.kv_cache import KVCache
from common.layers.linear import QKVParallelLinear, ReplicatedLinear
from common.layers.norm import RMSNorm
from common.models.transformer import Transformer


class FeatureDraft(Transformer):
    def __init__(
        self,
        config: ModelConfig,
        comm: Comm,
        markov_head_mode: str = "replicated",
        replicate_lm_head: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        if config.num_hidden_layers != 1 or not config.feature_layers:
            raise ValueError(
                f"{config.name or 'draft'}: a feature draft has num_hidden_layers=1 and feature_layers "
                f"(got {config.num_hidden_layers}, {config.feature_layers})"
            )
        super().__init__(config, comm, markov_head_mode, replicate_lm_head, dtype, device)
        hidden = config.hidden_size
        kw = dict(dtype=dtype, device=device)
        layer = self.model.layers[0]
        layer.self_attn.qkv_proj = QKVParallelLinear(
            2 * hidden,
            config.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            comm,
            config.attention_bias,
            **kw,
        )
        layer.hidden_norm = RMSNorm(hidden, config.rms_norm_eps, **kw)
        self.model.fc = ReplicatedLinear(config.feature_size, hidden, **kw)

    def fuse(self, features: Tensor) -> Tensor:
        """[..., F] target features -> [..., H], the stream a position reads beside its token."""
        return self.model.fc(features)

    def forward(  # type: ignore[override]
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        cache: KVCache,
        ctx_len: int,
        fused: Tensor,
    ) -> tuple[Tensor, Tensor]:
        """input_ids, positions [B, L]; fused [B, L, H] (fc of target features, or the draft's own aux)
        -> (hidden [B, L, H] after the final norm, for the head; aux [B, L, H], the pre-norm stream the
        next drafted position reads)."""
        layer = self.model.layers[0]
        embeds = layer.input_layernorm(self.model.embed_tokens(input_ids))
        x = torch.cat([embeds, layer.hidden_norm(fused)], dim=-1)
        rope = self.rotary.table(cache.max_len)
        h = layer.self_attn(x, rope, slots, positions, cache.k[0], cache.v[0], ctx_len)
        h, residual = layer.post_attention_layernorm(h, fused)
        return self.model.norm(layer.mlp(h), residual)


def default_feature_layers(num_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice: the streams entering layers 2, L/2 and L-3 (low, middle, high)."""
    picks = (min(2, num_layers - 1), num_layers // 2, max(0, num_layers - 3))
    return tuple(sorted(set(picks)))
