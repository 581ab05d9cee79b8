"""Log-probabilities of the emitted tokens, from the verify logits the step already has (no extra forward).

Speculative decoding emits a request's token j from verify row j: the target's logits after the
committed context plus the first j drafts, all accepted when token j is emitted. Those are the logits
plain decoding computes for the same position, so the values equal plain decoding's within
floating-point tolerance.

The distribution is the one the token was drawn from (vLLM's "processed" logprobs): logits divided by
the temperature, then top-k and top-p. A greedy request (temperature 0) reports temperature 1 without
truncation: its drawing distribution would be one-hot. Alternatives outside the top-k/top-p set (log
probability -inf) are left out of the top-N list.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor

from common.kernels.rejection import prepare_target
from specsplit.v1 import target_pb2

# Most alternatives a request may ask for (OpenAI's and vLLM's default limit).
MAX_LOGPROBS = 20


def processed_logprobs(
    logits: Tensor,  # [N, V] target logits, any float dtype
    temperature: Tensor,  # [N] fp32, 0 = greedy
    top_k: Tensor | None,  # [N] int32, 0 = off; None: off for every row
    top_p: Tensor | None,  # [N] fp32, >= 1 = off; None: off for every row
) -> Tensor:  # [N, V] fp32 log-probabilities
    """The rejection step's own target distribution (prepare_target: 1/T, top-k, top-p; greedy rows
    untouched), in log space."""
    masked, inv_temp = prepare_target(logits, temperature, top_k, top_p)
    return (masked.float() * inv_temp[:, None]).log_softmax(dim=-1)


def token_logprobs(
    logits: Tensor,  # [B * width, V] verify logits, request b's row j at b * width + j
    width: int,
    emitted: Sequence[Sequence[int]],  # per request of the batch: the tokens the step emitted
    temperature: Sequence[float],  # per request
    top_k: Sequence[int],
    top_p: Sequence[float],
    num_top: Sequence[int],  # per request: alternatives to list (0: the emitted token's only)
) -> list[list[target_pb2.TokenLogprob]]:
    """For each request, one TokenLogprob per emitted token."""
    rows = [b * width + j for b, tokens in enumerate(emitted) for j in range(len(tokens))]
    if not rows:
        return [[] for _ in emitted]
    owner = [b for b, tokens in enumerate(emitted) for _ in tokens]
    device = logits.device

    def per_row(values: Sequence[Any], dtype: torch.dtype) -> Tensor:
        return torch.tensor([values[b] for b in owner], dtype=dtype, device=device)

    logprobs = processed_logprobs(
        logits[torch.tensor(rows, device=device)],
        per_row(temperature, torch.float32),
        per_row(top_k, torch.int32) if any(top_k) else None,
        per_row(top_p, torch.float32) if any(p < 1.0 for p in top_p) else None,
    )
    flat = [t for ts in emitted for t in ts]
    tokens = torch.tensor(flat, dtype=torch.int64, device=device)
    chosen = logprobs.gather(1, tokens[:, None]).squeeze(1)
    n_top = min(max(num_top), logprobs.shape[1])
    top_values, top_ids = logprobs.topk(n_top, dim=-1)  # n_top = 0 gives [M, 0]
    # One device-to-host copy for everything.
    chosen_l, values_l, ids_l = chosen.tolist(), top_values.tolist(), top_ids.long().tolist()
    out: list[list[target_pb2.TokenLogprob]] = [[] for _ in emitted]
    for i, b in enumerate(owner):
        n = num_top[b]
        keep = [(t, v) for t, v in zip(ids_l[i][:n], values_l[i][:n]) if v != float("-inf")]
        out[b].append(
            target_pb2.TokenLogprob(
                token_id=flat[i],
                logprob=chosen_l[i],
                top_token_ids=[t for t, _ in keep],
                top_logprobs=[v for _, v in keep],
            )
        )
    return out


def add_pending_logprobs(
    batch: Sequence[Any], logits: Tensor | None, width: int, emitted: Sequence[Sequence[int]]
) -> None:
    """Scheduler hook after the verify step: appends the logprobs of each emitted token of the requests
    that asked for them to `req.pending_logprobs` (streamed with their tokens, in order).

    batch: the step's requests; logits: the step's [Bp * width, V]; emitted: per request, its tokens.
    """
    want = [b for b, req in enumerate(batch) if req.logprobs is not None]
    if not want or logits is None:
        return
    computed = token_logprobs(
        logits,
        width,
        [emitted[b] if b in want else [] for b in range(len(batch))],
        [r.temperature for r in batch],
        [r.top_k for r in batch],
        [r.top_p for r in batch],
        [r.logprobs or 0 for r in batch],
    )
    for b in want:
        batch[b].pending_logprobs.extend(computed[b])
