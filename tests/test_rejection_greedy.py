"""Greedy verification and defined results for bad input: kernel vs reference vs a naive loop."""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from common.kernels.rejection import verify
from common.kernels.rejection_ref import verify_reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def naive_greedy(logits, draft, k):
    """Token-by-token greedy verification, one request at a time (first maximum wins)."""
    batch, max_k = draft.shape
    rows = logits.float().view(batch, max_k + 1, -1)
    out = torch.full((batch, max_k + 1), -1, dtype=torch.int32)
    accepted = torch.zeros(batch, dtype=torch.int32)
    for b in range(batch):
        for i in range(int(k[b]) + 1):
            target = int(rows[b, i].argmax())
            if i < k[b] and int(draft[b, i]) == target:
                out[b, i] = target
                accepted[b] += 1
                continue
            out[b, i] = target
            break
    return out, accepted


def greedy_batch(batch, max_k, vocab, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    # Integer-valued logits make ties common; the kernel must pick the first maximum.
    logits = torch.randint(-4, 5, (batch * (max_k + 1), vocab), generator=g).float().to(dtype)
    target = logits.float().view(batch, max_k + 1, vocab).argmax(-1)
    draft = torch.randint(0, vocab, (batch, max_k), generator=g)
    # Mix all-accepted, first-rejected and partly accepted requests.
    accept_upto = torch.randint(0, max_k + 1, (batch,), generator=g)
    keep = torch.arange(max_k)[None] < accept_upto[:, None]
    draft = torch.where(keep, target[:, :max_k], draft)
    draft[0] = target[0, :max_k]  # all accepted
    draft[1] = (target[1, :max_k] + 1) % vocab  # first rejected
    k = torch.randint(0, max_k + 1, (batch,), generator=g, dtype=torch.int32)
    k[0], k[1], k[2] = max_k, max_k, 0
    return logits, draft, k


def call(fn, logits, draft, k, **kw):
    batch = draft.shape[0]
    args = dict(
        temperature=torch.zeros(batch),
        seeds=torch.arange(batch),
        positions=torch.full((batch,), 10),
    )
    args.update(kw)
    tensors = [logits, draft, k, args["temperature"], args["seeds"], args["positions"]]
    res = fn(*[t.to(DEVICE) for t in tensors])
    return res.output_tokens.cpu(), res.num_accepted.cpu(), res.num_emitted.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("max_k,vocab", [(4, 96), (1, 1000), (0, 64)])
def test_greedy_matches_naive_loop_and_reference(dtype, max_k, vocab):
    logits, draft, k = greedy_batch(48, max_k, vocab, dtype, seed=max_k * 7 + vocab)
    out, acc, emitted = call(verify, logits, draft, k)
    want_out, want_acc = naive_greedy(logits, draft, k)
    assert torch.equal(out, want_out)
    assert torch.equal(acc, want_acc)
    assert torch.equal(emitted, want_acc + 1)
    ref_out, ref_acc, _ = call(verify_reference, logits, draft, k)
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    if max_k > 0:
        assert acc[0] == max_k and acc[1] == 0 and acc[2] == 0
        assert 0 < (acc < torch.as_tensor(k)).sum() < len(k)  # both outcomes exercised
    # Unused slots are -1, used ones are valid ids.
    slots = torch.arange(max_k + 1)[None]
    assert torch.all((out == -1) == (slots >= emitted[:, None]))
    assert torch.all((out[slots < emitted[:, None]] >= 0) & (out[slots < emitted[:, None]] < vocab))


def test_ties_resolve_to_the_first_maximum():
    vocab = 50
    logits = torch.zeros(2, vocab)
    logits[:, [7, 30, 49]] = 3.0  # three-way tie, across positions of the row
    out, acc, _ = call(verify, logits, torch.tensor([[30]]), torch.tensor([1], dtype=torch.int32))
    assert out.tolist() == [[7, -1]] and acc.tolist() == [0]
    out, acc, _ = call(verify, logits, torch.tensor([[7]]), torch.tensor([1], dtype=torch.int32))
    assert out.tolist() == [[7, 7]] and acc.tolist() == [1]


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_bad_rows_and_draft_ids_are_rejected_with_a_defined_token(temperature):
    vocab, max_k = 40, 2
    logits = torch.randn(5 * (max_k + 1), vocab, generator=torch.Generator().manual_seed(1))
    target = logits.view(5, max_k + 1, vocab).argmax(-1)
    draft = target[:, :max_k].clone()
    draft[0, 0] = vocab  # out of range (>= V): rejected, no out-of-bounds read
    draft[1, 0] = -3  # negative id: rejected
    logits[2 * (max_k + 1), 5] = float("nan")  # NaN row: rejected, argmax with NaN as -inf
    logits[3 * (max_k + 1), 9] = float("inf")  # +inf row: rejected, the +inf token is the argmax
    logits[4 * (max_k + 1)] = float("nan")  # nothing finite: rejected, token 0
    k = torch.full((5,), max_k, dtype=torch.int32)
    temp = torch.full((5,), temperature)
    out, acc, emitted = call(verify, logits, draft, k, temperature=temp)
    ref_out, ref_acc, _ = call(verify_reference, logits, draft, k, temperature=temp)
    assert acc.tolist() == [0, 0, 0, 0, 0] and emitted.tolist() == [1] * 5
    clean_argmax = logits.nan_to_num(nan=-float("inf")).view(5, max_k + 1, vocab)[:, 0].argmax(-1)
    if temperature == 0:
        assert out[:, 0].tolist() == clean_argmax.tolist()
    assert out[2:, 0].tolist() == [clean_argmax[2].item(), 9, 0]
    assert torch.equal(out, ref_out) and torch.equal(acc, ref_acc)
    assert torch.all(out[:, 1:] == -1)


def test_bad_shapes_name_the_tensor():
    logits = torch.randn(6, 10, device=DEVICE)
    ok = dict(
        draft_token_ids=torch.zeros(2, 2, dtype=torch.long, device=DEVICE),
        num_draft_tokens=torch.zeros(2, dtype=torch.int32, device=DEVICE),
        temperature=torch.zeros(2, device=DEVICE),
        seeds=torch.zeros(2, dtype=torch.long, device=DEVICE),
        positions=torch.zeros(2, dtype=torch.long, device=DEVICE),
    )
    verify(logits, **ok)
    for name, bad in [
        ("num_draft_tokens", torch.zeros(3, dtype=torch.int32, device=DEVICE)),
        ("temperature", torch.zeros(2, dtype=torch.float64, device=DEVICE)),
        ("seeds", torch.zeros(2, dtype=torch.int32, device=DEVICE)),
    ]:
        with pytest.raises(ValueError, match=name):
            verify(logits, **{**ok, name: bad})
    with pytest.raises(ValueError, match="target_logits"):
        verify(torch.randn(5, 10, device=DEVICE), **ok)
    with pytest.raises(ValueError, match="draft_topk_probs"):
        verify(logits, **ok, draft_topk_ids=torch.zeros(2, 2, 3, dtype=torch.long, device=DEVICE))


def test_greedy_first_maximum_across_vocab_chunks(monkeypatch):
    """Ties split over several vocab chunks still resolve to the first maximum."""
    from common.kernels import rejection

    monkeypatch.setattr(rejection, "STATS_PROGRAMS", 1 << 20)
    monkeypatch.setattr(rejection, "STATS_BLOCK_BYTES", 64)
    monkeypatch.setattr(rejection, "STATS_MAX_BLOCKS", 2)
    assert rejection.stats_config(4, 300, 4)[2] > 4
    logits, draft, k = greedy_batch(16, 3, 300, torch.float32, seed=4)
    out, acc, _ = call(verify, logits, draft, k)
    want_out, want_acc = naive_greedy(logits, draft, k)
    assert torch.equal(out, want_out) and torch.equal(acc, want_acc)


@pytest.mark.parametrize("max_k,vocab", [(4, 96), (2, 40)])
def test_reference_greedy_shortcut_equals_its_general_loop(max_k, vocab):
    """An all-greedy batch skips the random numbers (the CPU serving path); the same rows in a batch with
    one sampled request take the general loop. Both give the same tokens, bad rows and ids included."""
    logits, draft, k = greedy_batch(24, max_k, vocab, torch.float32, seed=vocab)
    logits[3 * (max_k + 1), 5] = float("nan")
    logits[4 * (max_k + 1) + 1] = float("nan")
    draft[5, 0] = vocab
    draft[6, 0] = -2
    alone = call(verify_reference, logits, draft, k)
    sampled_row = torch.randn(max_k + 1, vocab, generator=torch.Generator().manual_seed(0))
    mixed = call(verify_reference, torch.cat([logits, sampled_row]), torch.cat([draft, draft[:1]]),
                 torch.cat([k, k[:1]]), temperature=torch.cat([torch.zeros(24), torch.ones(1)]),
                 seeds=torch.arange(25), positions=torch.full((25,), 10))  # fmt: skip
    for got, want in zip(alone, mixed):
        assert torch.equal(got, want[:24])
    assert 0 < int(alone[1].sum()) < int(k.sum())  # accepted and rejected drafts both present
