"""Target-side top-k / top-p masking and the draft-side sampler for sampled drafting.

Both are plain torch with no host synchronisation, so they can sit inside a CUDA graph.
"""

import torch
from torch import Tensor

from common.kernels import rng


def apply_top_k_top_p(logits: Tensor, top_k: Tensor | None, top_p: Tensor | None) -> Tensor:
    """Mask logits outside each row's top-k / top-p set to -inf.

    logits: [N, V] (already divided by the temperature: top-p is defined on the sampled
    distribution). top_k: [N] int, 0 = off. top_p: [N] float, >= 1 = off.
    Thresholds are on values, so tokens tied with the last kept one are kept too (the result
    does not depend on how a sort orders ties). The top token is always kept.
    """
    if top_k is None and top_p is None:
        return logits
    n, vocab = logits.shape
    sorted_logits = logits.sort(dim=-1, descending=True).values
    keep_from = sorted_logits[:, :1].clone().fill_(-float("inf"))  # keep everything by default
    if top_k is not None:
        _check_vector("top_k", top_k, n)
        k = torch.where(top_k > 0, top_k.long(), vocab).clamp(1, vocab)
        kth_value = sorted_logits.gather(1, (k - 1)[:, None])
        keep_from = torch.maximum(keep_from, kth_value)
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth_value, -float("inf"))
    if top_p is not None:
        _check_vector("top_p", top_p, n)
        probs = sorted_logits.softmax(dim=-1)
        mass_before = probs.cumsum(dim=-1) - probs
        # Rank 0 is always kept; p >= 1 must keep everything even when cumsum rounds to 1 early.
        keep = (mass_before < top_p[:, None].float()) | (top_p[:, None] >= 1.0)
        keep[:, 0] = True
        last_kept = keep.sum(dim=-1, keepdim=True) - 1
        keep_from = torch.maximum(keep_from, sorted_logits.gather(1, last_kept))
    return logits.masked_fill(logits < keep_from, -float("inf"))


def sample_draft_topk(
    logits: Tensor,  # [N, V] fp32 draft logits (soft-cap / scale already applied)
    temperature: Tensor,  # [N] fp32, > 0
    seeds: Tensor,  # [N] int64
    positions: Tensor,  # [N] int64: absolute position of the token being drafted
    top_k: int,  # K: size of the truncated draft distribution sent to the target
) -> tuple[Tensor, Tensor, Tensor]:
    """Sample one draft token per row from the draft's top-K truncated distribution.

    Returns (token [N] int64, topk_ids [N, K] int64, topk_probs [N, K] fp32). The token is a
    Gumbel-max draw over the K kept logits with DRAFT-stream noise keyed on the vocab id, so
    it is drawn from exactly the renormalised topk_probs that the target verifies against.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [N, V], got shape {tuple(logits.shape)}")
    n, vocab = logits.shape
    if not 1 <= top_k <= vocab:
        raise ValueError(f"top_k must be in [1, {vocab}], got {top_k}")
    for name, t in (("temperature", temperature), ("seeds", seeds), ("positions", positions)):
        _check_vector(name, t, n)
    scaled = logits.float() * (1.0 / temperature.float())[:, None]
    top_logits, topk_ids = scaled.topk(top_k, dim=-1)
    noise = rng.gumbel(seeds[:, None], positions[:, None], rng.STREAM_DRAFT, topk_ids)
    choice = (top_logits + noise).argmax(dim=-1, keepdim=True)
    token = topk_ids.gather(1, choice).squeeze(1)
    return token, topk_ids, top_logits.softmax(dim=-1)


def _check_vector(name: str, t: Tensor, n: int) -> None:
    if t.shape != (n,):
        raise ValueError(f"{name} must have shape [{n}], got {tuple(t.shape)}")
