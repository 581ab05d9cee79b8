"""Markov head of DSpark drafts: a low-rank bias on the next token that depends on the previous one.

bias(prev) = LogitsProcessor(W2, W1[prev]) with W1: [V, r], W2: [V_draft, r] (so soft-cap and scale apply).

replicated (default): both small matrices live whole on every rank; no collective at all. With local
    argmax each rank computes the bias for its own LM-head shard only.
sharded (baseline): W1 is a VocabParallelEmbedding (an all_reduce of [N, r]) and W2 a sharded head whose
    logits are gathered over the full draft vocab each position.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from common.distributed import Comm
from common.layers.logits import LogitsProcessor, gather_vocab_shards
from common.layers.vocab import ParallelLMHead, VocabParallelEmbedding

MARKOV_MODES = ("replicated", "sharded")


class MarkovHead(nn.Module):
    site = "markov_head"

    def __init__(
        self,
        vocab_size: int,
        draft_vocab_size: int,
        rank: int,
        comm: Comm,
        processor: LogitsProcessor,
        mode: str = "replicated",
        dtype=None,
        device=None,
    ):
        super().__init__()
        if mode not in MARKOV_MODES:
            raise ValueError(f"markov_head_mode={mode!r}: expected one of {MARKOV_MODES}")
        self.mode = mode
        self.processor = processor
        replicated = mode == "replicated"
        kw = dict(dtype=dtype, device=device)
        self.markov_w1 = VocabParallelEmbedding(
            vocab_size, rank, comm, site=self.site, disable_tp=replicated, **kw
        )
        # Pad the replicated W2 like the sharded LM head so a shard's rows line up with it.
        self.markov_w2 = ParallelLMHead(
            draft_vocab_size, rank, comm, disable_tp=replicated, pad_for_tp=comm.world_size, **kw
        )

    def bias(self, prev_token_ids: Tensor) -> Tensor:
        """[N] previous (full-vocab) token ids -> fp32 [N, V_draft] bias."""
        return self.processor(self.markov_w2, self.markov_w1(prev_token_ids), site=self.site)

    def bias_for_shard(self, prev_token_ids: Tensor, start: int, size: int) -> Tensor:
        """fp32 [N, size] bias for draft ids [start, start + size) of the padded vocab (one LM-head shard)."""
        low_rank = self.markov_w1(prev_token_ids)
        if self.mode == "replicated":
            raw = F.linear(low_rank, self.markov_w2.weight[start : start + size])
            return self.processor.process(raw)
        raw = gather_vocab_shards(self.markov_w2.local_logits(low_rank), self.markov_w2, self.site)
        return self.processor.process(raw[:, start : start + size])
