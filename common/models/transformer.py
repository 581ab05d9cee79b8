"""Decoder-only transformer for the Llama / Qwen2 / Qwen3 family, tensor-parallel inside.

Parameter names match the Hugging Face checkpoints (model.layers.N.self_attn.o_proj.weight, ...), except
the merged projections qkv_proj (q_proj, k_proj, v_proj) and gate_up_proj (gate_proj, up_proj), which the
loader fills part by part (common/layers/shard.py). One forward serves prefill, one-token decode and
(k+1)-token verification: each row writes its new K/V into its cache slot at its positions, then attends
over its slot's keys up to its own position (a "branch" row reads a prefix it shares with another
request from that request's slot instead: `Transformer.forward`'s prefix). No host syncs, static shapes
per (B, L, ctx_len).

On the GPU a layer is: add+RMSNorm, qkv GEMM, rotary + KV write + attention (one kernel), o_proj,
add+RMSNorm, gate_up GEMM, SiLU-and-mul, down GEMM (common/kernels/fused.py, launched with PDL on Hopper;
qkv and o_proj at up to 16 rows in common/kernels/skinny.py, where gate_up and SiLU-and-mul are one kernel
at up to 16 rows too); on the CPU the torch references of the same.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor, nn

from common.config import ModelConfig
from common.distributed import Comm
from common.features import FeatureStore
from common.kernels import fused, invariant
from common.kv_cache import KVCache
from common.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from common.layers.logits import LogitsProcessor, top2_tokens, top_tokens
from common.layers.markov import MarkovHead
from common.layers.norm import RMSNorm
from common.layers.rotary import RotaryEmbedding
from common.layers.shard import divide, set_shard
from common.layers.vocab import ParallelLMHead, VocabParallelEmbedding


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, **kw):
        super().__init__()
        hd = cfg.head_dim
        self.head_dim = hd
        self.num_heads = divide(cfg.num_attention_heads, comm.world_size, "num_attention_heads")
        self.num_kv_heads = divide(cfg.num_key_value_heads, comm.world_size, "num_key_value_heads")
        self.scale = 1.0 / math.sqrt(hd)
        # One GEMM for q, k and v: this rank's [q heads | k heads | v heads].
        self.qkv_proj = QKVParallelLinear(
            cfg.hidden_size,
            hd,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            comm,
            cfg.attention_bias,
            **kw,
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
        slots: Tensor,
        positions: Tensor,
        k_cache: Tensor,
        v_cache: Tensor,
        ctx_len: int,
        prefix: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        bsz, seq, _ = x.shape
        hd, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = self.qkv_proj(x).view(bsz, seq, nh + 2 * nkv, hd)
        q, k, v = qkv.split((nh, nkv, nkv), dim=2)  # views: the fused kernel reads them in place
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        # Rotary on q and k, the K/V cache write and attention over the live KV, in one kernel.
        attend = fused.rotary_attention if fused.on_gpu(x) else fused.rotary_attention_reference
        # Branch rows (prefix given) read their shared prefix's KV from another slot; their own new K/V
        # go into `slots` as for any row.
        prefix_slots, prefix_len = prefix if prefix is not None else (None, None)
        out = attend(
            q, k, v, *rope, positions, slots, k_cache, v_cache, ctx_len, self.scale,
            prefix_slots=prefix_slots, prefix_len=prefix_len,
        )  # fmt: skip
        return self.o_proj(out.reshape(bsz, seq, nh * hd))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, **kw):
        super().__init__()
        # One GEMM for gate and up: this rank's [gate shard | up shard].
        self.gate_up_proj = MergedColumnParallelLinear(
            cfg.hidden_size, [cfg.intermediate_size] * 2, ["gate_proj", "up_proj"], comm, **kw
        )
        self.down_proj = RowParallelLinear(cfg.intermediate_size, cfg.hidden_size, comm, "mlp_out", **kw)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(self.gate_up_proj(x, glu=True))  # silu(gate) * up: `linear`'s glu


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, comm: Comm, **kw):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.self_attn = Attention(cfg, comm, **kw)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **kw)
        self.mlp = MLP(cfg, comm, **kw)

    def forward(self, x: Tensor, residual: Tensor | None, *attn_args) -> tuple[Tensor, Tensor]:
        """(x, residual) -> (this layer's MLP output, residual stream before it). The residual add of
        each block is fused into the next norm (vLLM style): the stream is x + residual."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, *attn_args)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


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
        # Set on a target that serves a feature draft: every forward writes its features there.
        self.feature_store: FeatureStore | None = None
        # A target served with --batch-invariant: its forwards and logits run the batch-invariant kernels
        # (common/kernels/invariant.py), so a token's logits do not depend on the step that computes them.
        self.batch_invariant = False

    def forward(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        cache: KVCache,
        ctx_len: int,
        prefix: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        """input_ids, positions [B, L] int64; slots [B] -> hidden [B, L, hidden] after the final norm.

        Row b's tokens are written to cache slot slots[b] at `positions` before attention; a query at
        position p sees its slot's keys at positions <= p. Padded tail entries of a row (positions
        continuing past the real ones, < cache.max_len) write harmless KV beyond the valid length.

        prefix: None, or (prefix_slots, prefix_len) [B] int64 device tensors for branch rows: row b then
        sees the keys at positions < prefix_len[b] in slot prefix_slots[b] (another request's cache that
        shares that prefix, not copied) and those from prefix_len[b] on in slots[b]. Its new tokens are
        still written to slots[b]; prefix_len[b] = 0 makes row b a plain row. No host syncs either way.
        """
        store = self.feature_store
        layers = () if store is None else store.layers
        write = None if store is None else partial(store.write_stream, slots, positions)
        hidden, _ = self.forward_streams(input_ids, positions, slots, cache, ctx_len, layers, prefix, write)
        return hidden

    def forward_streams(
        self,
        input_ids: Tensor,
        positions: Tensor,
        slots: Tensor,
        cache: KVCache,
        ctx_len: int,
        layers: tuple[int, ...] = (),
        prefix: tuple[Tensor, Tensor] | None = None,
        write: Callable[[int, Tensor, Tensor | None], None] | None = None,
        streams_only: bool = False,
    ) -> tuple[Tensor | None, list[Tensor]]:
        """`forward`, and the residual streams entering each of `layers` ([B, L, hidden] each): the
        features a feature draft reads (common/features.py). With `write`, write(j, x, residual) gets
        the j-th of them as its two terms instead (a FeatureStore's), and the list stays empty.
        `streams_only`: stop once the last of `layers` is reached and return (None, streams); the layers
        past it and their KV are skipped (training reads features only)."""
        rope = self.rotary.table(cache.max_len)  # every position the cache holds
        x, residual = self.model.embed_tokens(input_ids), None
        streams = []
        last = max(layers) if streams_only else -1
        with invariant.batch_invariant(self.batch_invariant):
            for i, layer in enumerate(self.model.layers):
                if i in layers and write is not None:
                    write(layers.index(i), x, residual)
                elif i in layers:
                    streams.append(x if residual is None else x + residual)
                if i == last:
                    return None, streams  # the last stream is taken as its layer is entered
                kv = cache.k[i], cache.v[i]
                x, residual = layer(x, residual, rope, slots, positions, *kv, ctx_len, prefix)
        return self.model.norm(x, residual)[0], streams

    def compute_logits(
        self, hidden: Tensor, prev_token_ids: Tensor | None = None, upcast: bool = True
    ) -> Tensor:
        """[N, H] -> fp32 [N, V_head] logits over the LM head's vocab (the draft vocab when d2t is set):
        padding removed, soft-cap then scale, plus the Markov bias when prev_token_ids [N] is given.
        upcast=False: in the model's dtype where that is exact (`LogitsProcessor.__call__`), for
        consumers that read any float dtype as fp32 (the rejection kernels, logprobs)."""
        with_bias = self.markov_head is not None and prev_token_ids is not None
        with invariant.batch_invariant(self.batch_invariant):
            logits = self.logits_processor(self.lm_head, hidden, upcast=upcast or with_bias)
        if with_bias:
            logits = logits + self.markov_head.bias(prev_token_ids)
        return logits

    def get_top_tokens(self, hidden: Tensor, prev_token_ids: Tensor | None = None, second: bool = False):
        """[N, H] -> [N] int64 ids (LM-head vocab) equal to compute_logits(...).argmax(-1), ties included,
        with one [N, 2] all_gather instead of a full-vocab gather. second=True: (ids, second-best ids),
        one [N, 4] all_gather."""
        head = self.lm_head
        scores = self.logits_processor.local_scores(head, hidden)
        if self.markov_head is not None and prev_token_ids is not None:
            scores = scores + self.markov_head.bias_for_shard(
                prev_token_ids, head.shard_start, head.shard_size
            )
        return top2_tokens(scores, head) if second else top_tokens(scores, head)

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
