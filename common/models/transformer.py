"""Decoder-only transformer for the Llama / Qwen2 / Qwen3 family, tensor-parallel inside.

Parameter names match the Hugging Face checkpoints (model.layers.N.self_attn.q_proj.weight, ...), so the
loader maps them one to one. One forward serves prefill, one-token decode and (k+1)-token verification:
each row writes its new K/V into its cache slot at its positions, then attends over cache[:, :ctx_len]
with a causal mask by absolute position. No host syncs, static shapes per (B, L, ctx_len).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from common.config import ModelConfig
from common.distributed import Comm
from common.kv_cache import KVCache
from common.layers.linear import ColumnParallelLinear, RowParallelLinear
from common.layers.logits import LogitsProcessor, top_tokens
from common.layers.markov import MarkovHead
from common.layers.norm import RMSNorm
from common.layers.rotary import RotaryEmbedding, apply_rotary
from common.layers.shard import divide, set_shard
from common.layers.vocab import ParallelLMHead, VocabParallelEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, **kw):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.num_heads = divide(cfg.num_attention_heads, comm.world_size, "num_attention_heads")
        self.num_kv_heads = divide(cfg.num_key_value_heads, comm.world_size, "num_key_value_heads")
        self.q_proj = ColumnParallelLinear(
            cfg.hidden_size, cfg.num_attention_heads * hd, comm, cfg.attention_bias, **kw
        )
        self.k_proj = ColumnParallelLinear(
            cfg.hidden_size, cfg.num_key_value_heads * hd, comm, cfg.attention_bias, **kw
        )
        self.v_proj = ColumnParallelLinear(
            cfg.hidden_size, cfg.num_key_value_heads * hd, comm, cfg.attention_bias, **kw
        )
        self.o_proj = RowParallelLinear(cfg.num_attention_heads * hd, cfg.hidden_size, comm, "attn_out", **kw)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, **kw)
            self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, **kw)
        self.qk_norm = cfg.qk_norm

    def forward(
        self,
        x: Tensor,
        rope: tuple[Tensor, Tensor],
        mask: Tensor,
        slots: Tensor,
        positions: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        ctx_len: int,
    ) -> Tensor:
        bsz, seq, _ = x.shape
        hd, nkv = self.head_dim, self.num_kv_heads
        group = self.num_heads // nkv
        q = self.q_proj(x).view(bsz, seq, self.num_heads, hd)
        k = self.k_proj(x).view(bsz, seq, nkv, hd)
        v = self.v_proj(x).view(bsz, seq, nkv, hd)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)

        rows = slots.unsqueeze(1)
        k_cache[rows, positions] = k
        v_cache[rows, positions] = v
        keys = k_cache[:, :ctx_len][slots]  # [B, ctx, nkv, hd]
        values = v_cache[:, :ctx_len][slots]

        # GQA without repeating K/V: the `group` query heads of one KV head become extra query rows.
        q = q.view(bsz, seq, nkv, group, hd).permute(0, 2, 3, 1, 4).reshape(bsz, nkv, group * seq, hd)
        scores = torch.matmul(q, keys.permute(0, 2, 3, 1)).float() * (1.0 / math.sqrt(hd))
        scores = scores.view(bsz, nkv, group, seq, ctx_len).masked_fill(~mask, float("-inf"))
        probs = scores.softmax(-1).to(values.dtype).view(bsz, nkv, group * seq, ctx_len)
        out = torch.matmul(probs, values.permute(0, 2, 1, 3))  # [B, nkv, group * seq, hd]
        out = out.view(bsz, nkv, group, seq, hd).permute(0, 3, 1, 2, 4).reshape(bsz, seq, self.num_heads * hd)
        return self.o_proj(out)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, **kw):
        super().__init__()
        self.gate_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, comm, **kw)
        self.up_proj = ColumnParallelLinear(cfg.hidden_size, cfg.intermediate_size, comm, **kw)
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, comm, "mlp_out", **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, comm, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, comm, **kw)

    def forward(self, x: Tensor, *attn_args) -> Tensor:
        x = x + self.self_attn(self.input_layernorm(x), *attn_args)
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderStack(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, replicate_vocab: bool, **kw):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            cfg.vocab_size, cfg.hidden_size, comm, disable_tp=replicate_vocab, **kw
        )
        self.layers = nn.ModuleList(DecoderLayer(cfg, comm, **kw) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)


class Transformer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        comm: Comm,
        markov_head_mode: str = "replicated",
        replicate_lm_head: bool = False,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
    ):
        super().__init__()
        config.check_tp(comm.world_size)
        self.config = config
        self.comm = comm
        self.use_local_argmax_reduction = False  # set by load_model after validation
        kw = dict(dtype=dtype, device=device)
        self.model = DecoderStack(config, comm, replicate_lm_head and config.tie_word_embeddings, **kw)
        if config.tie_word_embeddings:
            self.lm_head: VocabParallelEmbedding = self.model.embed_tokens
        else:
            self.lm_head = ParallelLMHead(
                config.lm_head_vocab_size, config.hidden_size, comm, disable_tp=replicate_lm_head, **kw
            )
        self.logits_processor = LogitsProcessor(config.final_logit_softcapping, config.logit_scale)
        self.markov_head = None
        if config.markov_rank:
            self.markov_head = MarkovHead(
                config.vocab_size,
                config.lm_head_vocab_size,
                config.markov_rank,
                comm,
                self.logits_processor,
                markov_head_mode,
                **kw,
            )
        self.d2t = None
        if config.draft_vocab_size is not None:
            self.d2t = nn.Parameter(
                torch.zeros(config.draft_vocab_size, dtype=torch.int64, device=device), False
            )
            set_shard(self.d2t, (config.draft_vocab_size,))
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling, device=device)

    def forward(
        self, input_ids: Tensor, positions: Tensor, slots: Tensor, cache: KVCache, ctx_len: int
    ) -> Tensor:
        """input_ids, positions [B, L] int64; slots [B] -> hidden [B, L, hidden] after the final norm.

        Row b's tokens are written to cache slot slots[b] at `positions` before attention; a query at
        position p sees its slot's keys at positions <= p. Padded tail entries of a row (positions
        continuing past the real ones, < cache.max_len) write harmless KV beyond the valid length.
        """
        rope = self.rotary(positions)
        key_pos = torch.arange(ctx_len, device=positions.device)
        # [B, 1, 1, L, ctx]: broadcast over KV heads and the query heads of a group
        mask = (key_pos <= positions.unsqueeze(-1))[:, None, None]
        x = self.model.embed_tokens(input_ids)
        for i, layer in enumerate(self.model.layers):
            x = layer(x, rope, mask, slots, positions, cache.k[i], cache.v[i], ctx_len)
        return self.model.norm(x)

    def compute_logits(self, hidden: Tensor, prev_token_ids: Tensor | None = None) -> Tensor:
        """[N, H] -> fp32 [N, V_head] logits over the LM head's vocab (the draft vocab when d2t is set):
        padding removed, soft-cap then scale, plus the Markov bias when prev_token_ids [N] is given."""
        logits = self.logits_processor(self.lm_head, hidden)
        if self.markov_head is not None and prev_token_ids is not None:
            logits = logits + self.markov_head.bias(prev_token_ids)
        return logits

    def get_top_tokens(self, hidden: Tensor, prev_token_ids: Tensor | None = None) -> Tensor:
        """[N, H] -> [N] int64 ids (LM-head vocab) equal to compute_logits(...).argmax(-1), ties included,
        with one [N, 2] all_gather instead of a full-vocab gather."""
        head = self.lm_head
        scores = self.logits_processor.local_scores(head, hidden)
        if self.markov_head is not None and prev_token_ids is not None:
            scores = scores + self.markov_head.bias_for_shard(
                prev_token_ids, head.shard_start, head.shard_size
            )
        return top_tokens(scores, head)

    def map_to_target(self, draft_ids: Tensor) -> Tensor:
        """Draft-vocab ids -> target-vocab ids through d2t (target = draft + d2t[draft]); identity without."""
        if self.d2t is None:
            return draft_ids
        return draft_ids + self.d2t[draft_ids]

    def greedy_draft_tokens(self, hidden: Tensor, prev_token_ids: Tensor | None = None) -> Tensor:
        """One greedy draft step: [N, H] -> [N] target-vocab ids. Local argmax when the switch is on."""
        if self.use_local_argmax_reduction:
            ids = self.get_top_tokens(hidden, prev_token_ids)
        else:
            ids = self.compute_logits(hidden, prev_token_ids).argmax(-1)
        return self.map_to_target(ids)
