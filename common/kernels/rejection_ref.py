"""Plain PyTorch reference of speculative verification, written to be read.

It makes the same decisions as the Triton kernels in rejection.py from the same random
numbers (common/kernels/rng.py), so the two can be compared token for token. Per request b
with k_b draft tokens d_1..d_k and target logits rows L_0..L_k (row i scores position n_b + i):

greedy (temperature 0)
    accept d_{i+1} while d_{i+1} == argmax L_i (first maximum wins); then emit argmax L_i at
    the first mismatch, or the bonus argmax L_k after all k accepted.
sampled
    p_i = softmax(L_i / T), q_i the draft distribution (one-hot at d_{i+1} when none is given).
    Accept d_{i+1} iff u < p_i(d) / q_i(d) with u = uniform(seed, n_b + i, ACCEPT), in log space.
    At the first rejection emit a sample of normalize(max(p_i - q_i, 0)); after all k accepted
    emit a sample of p_k. Both samples are Gumbel-max draws, argmax_v (s_v + g_v), with
        s_v = L_i[v] / T + log1p(-q(v) / p(v))   (-inf where p(v) <= q(v))
    which differs from log(max(p - q, 0)) by the row constant log-sum-exp only; q/p is taken as
    exp(log q - log p), exact even when q/p is below one float32 ulp.

Defined results for bad input (never an out-of-bounds read):
- a draft id outside [0, V), or with q(d) == 0, is rejected;
- a row with a NaN or +inf logit, or with every logit -inf, rejects its draft token and emits the
  row's argmax with NaN treated as -inf (token 0 if nothing is finite);
- a residual that is empty (only by rounding, when p == q) emits the draft token itself.
"""

import torch
from torch import Tensor

from common.kernels import rng
from common.kernels.rejection import VerifyResult, check_verify_inputs, prepare_target


def verify_reference(
    target_logits: Tensor,
    draft_token_ids: Tensor,
    num_draft_tokens: Tensor,
    temperature: Tensor,
    seeds: Tensor,
    positions: Tensor,
    top_k: Tensor | None = None,
    top_p: Tensor | None = None,
    draft_probs: Tensor | None = None,
    draft_topk_ids: Tensor | None = None,
    draft_topk_probs: Tensor | None = None,
) -> VerifyResult:
    """Same contract as rejection.verify (see there for the shapes)."""
    batch, max_k = check_verify_inputs(
        target_logits, draft_token_ids, num_draft_tokens, temperature, seeds, positions,
        top_k, top_p, draft_probs, draft_topk_ids, draft_topk_probs,
    )  # fmt: skip
    greedy = temperature <= 0
    k = num_draft_tokens.long().clamp(0, max_k)
    if bool(greedy.all()):  # no row samples: skip the random numbers and softmaxes (CPU serving)
        return _verify_greedy(target_logits.float().view(batch, max_k + 1, -1), draft_token_ids, k)
    logits, inv_temp = prepare_target(target_logits, temperature, top_k, top_p)
    vocab = logits.shape[-1]
    logits = logits.float().view(batch, max_k + 1, vocab)
    vocab_ids = torch.arange(vocab, device=logits.device)

    out = torch.full((batch, max_k + 1), -1, dtype=torch.int64, device=logits.device)
    num_accepted = torch.zeros(batch, dtype=torch.int64, device=logits.device)
    done = torch.zeros(batch, dtype=torch.bool, device=logits.device)
    for i in range(max_k + 1):
        raw = logits[:, i]
        x = raw * inv_temp[:, None]
        bad_row = (raw.isnan() | (raw == float("inf"))).any(-1) | (raw == -float("inf")).all(-1)
        argmax_token = raw.nan_to_num(nan=-float("inf")).argmax(-1)
        lse = _logsumexp(x)
        position = positions + i

        has_draft = i < k
        d = draft_token_ids[:, i] if i < max_k else torch.full_like(k, -1)
        d_valid = has_draft & (d >= 0) & (d < vocab) & ~bad_row
        d_safe = torch.where(d_valid, d, 0)
        logp_d = x.gather(1, d_safe[:, None]).squeeze(1) - lse
        d_in_range = has_draft & (d >= 0) & (d < vocab)
        log_q = _draft_log_q(i, vocab, d, d_in_range, draft_probs, draft_topk_ids, draft_topk_probs)
        logq_d = log_q.gather(1, d_safe[:, None]).squeeze(1)
        log_u = torch.log(rng.uniform(seeds, position, rng.STREAM_ACCEPT, torch.zeros_like(d)))
        accept_sampled = (logq_d > -float("inf")) & (log_u < logp_d - logq_d)
        accept_greedy = d == argmax_token
        accept = d_valid & torch.where(greedy, accept_greedy, accept_sampled)

        # The token emitted if this row ends the round: residual sample, bonus sample or argmax.
        stream = torch.where(has_draft, rng.STREAM_RESIDUAL, rng.STREAM_BONUS)
        noise = rng.gumbel(seeds[:, None], position[:, None], stream[:, None], vocab_ids[None])
        log_p = x - lse[:, None]
        residual_adjust = torch.where(
            has_draft[:, None] & (log_p > log_q),
            torch.log1p(-torch.exp(log_q - log_p)),
            torch.where(has_draft[:, None], -float("inf"), 0.0),
        )
        score = (x.nan_to_num(nan=-float("inf")) + residual_adjust) + noise
        sampled_token = score.argmax(-1)  # first maximum wins, as in the kernel
        empty_residual = score.amax(-1) == -float("inf")
        sampled_token = torch.where(empty_residual & d_valid, d, sampled_token)
        sampled_token = torch.where(empty_residual & ~d_valid, argmax_token, sampled_token)
        emitted = torch.where(greedy | bad_row, argmax_token, sampled_token)

        active = ~done
        out[:, i] = torch.where(active, torch.where(accept, d, emitted), out[:, i])
        num_accepted += (active & accept).long()
        done |= ~accept
    return VerifyResult(out.int(), num_accepted.int(), (num_accepted + 1).int())


def _verify_greedy(logits: Tensor, draft_token_ids: Tensor, k: Tensor) -> VerifyResult:
    """verify_reference when every row is greedy: logits [B, K + 1, V] fp32, draft_token_ids [B, K],
    k [B] (clamped). The same tokens as the general loop: row i's argmax (NaN as -inf) accepts d_{i+1}
    when they are equal and the row is neither bad nor past k; the first rejection emits the argmax."""
    batch, width, vocab = logits.shape
    bad_row = (logits.isnan() | (logits == float("inf"))).any(-1) | (logits == -float("inf")).all(-1)
    argmax = logits.nan_to_num(nan=-float("inf")).argmax(-1)  # [B, K + 1]
    drafts = torch.full((batch, width), -1, dtype=torch.int64, device=logits.device)
    drafts[:, : width - 1] = draft_token_ids.long()
    slot = torch.arange(width, device=logits.device)
    accept = (slot < k[:, None]) & (drafts >= 0) & (drafts < vocab) & ~bad_row & (drafts == argmax)
    num_accepted = accept.long().cumprod(-1).sum(-1)  # the accepted prefix
    out = torch.where(slot < num_accepted[:, None], drafts, argmax)
    out = torch.where(slot <= num_accepted[:, None], out, -1)
    return VerifyResult(out.int(), num_accepted.int(), (num_accepted + 1).int())


def _logsumexp(x: Tensor) -> Tensor:
    m = x.nan_to_num(nan=-float("inf")).amax(-1)
    m_safe = torch.where(m == -float("inf"), 0.0, m)
    return m_safe + torch.log(torch.exp(x - m_safe[:, None]).sum(-1))


def _draft_log_q(i, vocab, d, d_in_range, draft_probs, draft_topk_ids, draft_topk_probs) -> Tensor:
    """log q_i over the vocabulary, [B, V]. One-hot at the draft token when no q is given."""
    q = torch.zeros(d.shape[0], vocab, device=d.device)
    if draft_probs is not None:
        if i < draft_probs.shape[1]:
            q = draft_probs[:, i].float()
    elif draft_topk_ids is not None:
        if i < draft_topk_ids.shape[1]:
            ids = draft_topk_ids[:, i]
            in_range = (ids >= 0) & (ids < vocab)
            # Duplicated ids add up; out-of-range ids carry no mass.
            q.scatter_add_(1, torch.where(in_range, ids, 0), torch.where(in_range, draft_topk_probs[:, i], 0))
    else:
        q.scatter_(1, torch.where(d_in_range, d, 0)[:, None], d_in_range.float()[:, None])
    return torch.log(q)
