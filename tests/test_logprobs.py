"""target_service.logprobs against a plain per-row reference (log_softmax of the tempered, truncated
logits); the end-to-end values are compared with transformers in tests/test_sdk_logprobs.py."""

from __future__ import annotations

import math

import torch

from target_service.logprobs import token_logprobs


def reference_row(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """log-probabilities of one row, written out: greedy is temperature 1 without truncation."""
    if temperature <= 0:
        return logits.double().log_softmax(-1)
    x = logits.double() / temperature
    order = x.argsort(descending=True)
    keep = torch.zeros_like(x, dtype=torch.bool)
    probs, mass = x.softmax(-1), 0.0
    for rank, i in enumerate(order.tolist()):
        if (top_k and rank >= top_k) or (rank > 0 and mass >= top_p):
            break
        keep[i] = True
        mass += float(probs[i])
    return x.masked_fill(~keep, -math.inf).log_softmax(-1)


def test_token_logprobs_match_the_reference_rows() -> None:
    gen = torch.Generator().manual_seed(0)
    width, vocab = 4, 50
    logits = torch.randn(3 * width, vocab, generator=gen) * 3
    temperature, top_k, top_p = [0.0, 0.7, 1.3], [5, 8, 0], [0.5, 1.0, 0.8]
    emitted = [[7, 3, 9], [], [11, 2]]
    # Sampled rows can only emit tokens inside their top-k/top-p set: use those.
    for b, js in ((2, range(2)),):
        for j in js:
            ref = reference_row(logits[b * width + j], temperature[b], top_k[b], top_p[b])
            emitted[b][j] = int(ref.argmax())
    num_top = [3, 0, 30]
    got = token_logprobs(logits, width, emitted, temperature, top_k, top_p, num_top)
    assert [len(g) for g in got] == [3, 0, 2]
    for b, tokens in enumerate(emitted):
        for j, (tok, lp) in enumerate(zip(tokens, got[b])):
            ref = reference_row(logits[b * width + j], temperature[b], top_k[b], top_p[b])
            assert lp.token_id == tok
            assert math.isclose(lp.logprob, float(ref[tok]), abs_tol=1e-5)
            finite = int(torch.isfinite(ref).sum())
            want = ref.topk(min(num_top[b], finite))
            assert list(lp.top_token_ids) == want.indices.tolist()
            assert torch.allclose(torch.tensor(list(lp.top_logprobs)), want.values.float(), atol=1e-5)
    # Greedy ignores top-k/top-p: its 3 alternatives are the 3 largest logits.
    assert list(got[0][0].top_token_ids) == logits[0].topk(3).indices.tolist()
    # Sampled with top-p 0.8: fewer than 30 finite alternatives, none of them -inf.
    assert 0 < len(got[2][0].top_token_ids) < 30 and all(math.isfinite(v) for v in got[2][0].top_logprobs)


def test_no_logprob_requests_cost_nothing() -> None:
    assert token_logprobs(torch.randn(4, 8), 2, [[], []], [0.0, 0.0], [0, 0], [1.0, 1.0], [0, 0]) == [[], []]
