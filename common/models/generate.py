"""Batching helpers around `Transformer.forward`: ragged rows in one forward, and plain greedy decoding.

Plain greedy decoding here is the reference that speculative decoding must reproduce token for token.
"""

from __future__ import annotations

import torch
from torch import Tensor

from common.kv_cache import KVCache, SlotTable
from common.models.transformer import Transformer


def forward_rows(
    model: Transformer, cache: KVCache, slots: list[int], starts: list[int], rows: list[list[int]]
) -> Tensor:
    """One forward over ragged rows: row b appends `rows[b]` to slot `slots[b]` from position `starts[b]`.

    Rows are right-padded to the longest with their last token at positions continuing past the real
    ones (harmless KV beyond the valid length). Returns hidden [B, L, H]; row b's real outputs are
    [b, :len(rows[b])].
    """
    width = max(len(r) for r in rows)
    ctx_len = max(s + width for s in starts)
    if ctx_len > cache.max_len:
        raise ValueError(f"rows reach position {ctx_len - 1}, past the KV cache max_len={cache.max_len}")
    if any(not r for r in rows):
        raise ValueError("rows: every row needs at least one token")
    device = cache.k[0].device
    ids = torch.tensor([r + [r[-1]] * (width - len(r)) for r in rows], dtype=torch.int64, device=device)
    positions = torch.tensor(starts, dtype=torch.int64, device=device)[:, None] + torch.arange(
        width, device=device
    )
    slot_t = torch.tensor(slots, dtype=torch.int64, device=device)
    return model(ids, positions, slot_t, cache, ctx_len)


@torch.inference_mode()
def greedy_generate(
    model: Transformer, prompts: list[list[int]], max_new_tokens: int, cache: KVCache | None = None
) -> list[list[int]]:
    """Plain greedy decoding of a batch of prompts of different lengths; returns the new tokens per prompt."""
    longest = max(len(p) for p in prompts) + max_new_tokens
    cache = cache or KVCache.for_model(model, len(prompts), longest)
    table = SlotTable(cache.num_slots)
    slots = [table.alloc() for _ in prompts]
    hidden = forward_rows(model, cache, slots, [0] * len(prompts), prompts)
    last = torch.tensor([len(p) - 1 for p in prompts], device=hidden.device)
    tokens = model.map_to_target(model.compute_logits(hidden[torch.arange(len(prompts)), last]).argmax(-1))
    lengths = [len(p) for p in prompts]
    out: list[list[int]] = [[] for _ in prompts]
    for step in range(max_new_tokens):
        for b, t in enumerate(tokens.tolist()):
            out[b].append(t)
        if step + 1 == max_new_tokens:
            break
        hidden = forward_rows(model, cache, slots, lengths, [[o[-1]] for o in out])
        lengths = [n + 1 for n in lengths]
        tokens = model.map_to_target(model.compute_logits(hidden[:, 0]).argmax(-1))
    return out
