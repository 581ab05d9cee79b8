"""How well a draft agrees with its target under greedy speculation, and what a draft step costs.

Greedy speculation accepts the longest prefix of the k drafted tokens that equals the target's own greedy
tokens. While the draft agrees, its context equals the target's, so a draft's k-token rollout from any
position is decided by ONE teacher-forced forward over the target's greedy text: match[p] says whether
the draft's argmax after position p is the target's token p + 1. Rounds are then replayed exactly as the
service runs them: from position p, a = the run of matches (at most k), and the next round starts after
the a accepted tokens and the target's bonus token.

Per-token acceptance α is solved from the mean accepted length: E[a] = Σ_{i=1..k} α^i.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from common.kv_cache import KVCache
from common.models.generate import greedy_generate
from common.models.transformer import Transformer
from common.training.data import first_eos


@dataclass
class Acceptance:
    k: int
    mean_accepted: float  # E[a], drafted tokens accepted per round (the bonus token not counted)
    alpha: float  # per-token acceptance solved from mean_accepted
    rounds: int
    agreement: float  # fraction of positions where the draft's next token is the target's
    # Feature drafts (feature_acceptance), at each round's first drafted position: the fraction of rounds
    # whose target token is the draft's first or second choice (what verifying two candidates there would
    # accept), and whose target token the draft's reduced vocabulary cannot propose at all.
    first_top2: float | None = None
    first_out_of_vocab: float | None = None

    def as_dict(self) -> dict:
        out = {
            "k": self.k,
            "mean_accepted": round(self.mean_accepted, 4),
            "alpha": round(self.alpha, 4),
            "rounds": self.rounds,
            "agreement": round(self.agreement, 4),
        }
        for name in ("first_top2", "first_out_of_vocab"):
            if getattr(self, name) is not None:
                out[name] = round(getattr(self, name), 4)
        return out


def solve_alpha(mean_accepted: float, k: int) -> float:
    """α in [0, 1] with Σ_{i=1..k} α^i = mean_accepted (bisection; the sum rises with α)."""
    if mean_accepted <= 0:
        return 0.0
    if mean_accepted >= k:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid**i for i in range(1, k + 1)) < mean_accepted:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def target_texts(
    target: Transformer, prompts: list[list[int]], max_new_tokens: int, eos: set[int], batch_size: int = 16
) -> list[list[int]]:
    """The target's greedy answers, cut after EOS: the text a greedy speculative run must reproduce."""
    out = []
    for i in range(0, len(prompts), batch_size):
        batch = prompts[i : i + batch_size]
        out += [first_eos(a, eos) for a in greedy_generate(target, batch, max_new_tokens)]
    return out


def _answer_logits(model: Transformer, prompt: list[int], answer: list[int], use_markov: bool):
    """(logits [len(answer), V] that predict each answer token, the answer ids [len(answer)]): one
    teacher-forced forward over prompt + answer."""
    device = model.model.embed_tokens.weight.device
    seq = prompt + answer
    cache = KVCache.for_model(model, 1, len(seq))
    ids = torch.tensor([seq], device=device)
    positions = torch.arange(len(seq), device=device)[None]
    hidden = model(ids, positions, torch.zeros(1, dtype=torch.int64, device=device), cache, len(seq))
    rows = slice(len(prompt) - 1, len(seq) - 1)  # positions that predict the answer tokens
    prev = ids[0, rows] if use_markov else None
    return model.compute_logits(hidden[0, rows], prev), ids[0, len(prompt) :]


@torch.inference_mode()
def match_flags(
    draft: Transformer, prompts: list[list[int]], answers: list[list[int]], use_markov: bool
) -> list[Tensor]:
    """Per sequence: bool [len(answer)] — does the draft, after prompt + answer[:j], guess answer[j]?"""
    out = []
    for prompt, answer in zip(prompts, answers):
        logits, truth = _answer_logits(draft, prompt, answer, use_markov)
        out.append((draft.map_to_target(logits.argmax(-1)) == truth).cpu())
    return out


@torch.inference_mode()
def target_confidence(
    target: Transformer, prompts: list[list[int]], answers: list[list[int]]
) -> list[Tensor]:
    """Per sequence: float [len(answer)], the target's own probability of answer[j] after
    prompt + answer[:j] (its top-1 where the answer is its greedy text): how sure the target was."""
    out = []
    for prompt, answer in zip(prompts, answers):
        logits, truth = _answer_logits(target, prompt, answer, use_markov=False)
        probs = torch.softmax(logits.float(), -1)
        out.append(probs.gather(-1, truth[:, None])[:, 0].cpu())
    return out


def agreement_by_confidence(
    matches: list[Tensor], confidence: list[Tensor], edges: tuple[float, ...] = (0.0, 0.3, 0.5, 0.7, 0.9, 1.0)
) -> list[dict]:
    """The draft's agreement among the positions where the target's confidence lies in each range: are
    the misses the tokens the target itself was unsure of?"""
    m, c = torch.cat(matches), torch.cat(confidence)
    bins = torch.bucketize(c, torch.tensor(edges[1:-1], dtype=c.dtype), right=True)  # [lo, hi); 1.0: last
    out = []
    for i, (lo, hi) in enumerate(itertools.pairwise(edges)):
        inside = bins == i
        n = int(inside.sum())
        out.append({
            "target_p": f"{lo:.1f}-{hi:.1f}",
            "share_of_positions": round(n / max(1, len(c)), 4),
            "agreement": round(float(m[inside].float().mean()) if n else 0.0, 4),
            "share_of_misses": round(int((~m & inside).sum()) / max(1, int((~m).sum())), 4),
        })  # fmt: skip
    return out


def replay_rounds(matches: list[Tensor], k: int) -> list[int]:
    """Accepted lengths of the greedy speculative rounds over each sequence (see the module docstring)."""
    accepted = []
    for m in matches:
        flags = m.tolist()
        p = 0
        while p < len(flags):
            a = 0
            while a < k and p + a < len(flags) and flags[p + a]:
                a += 1
            accepted.append(a)
            p += a + 1  # a accepted tokens and the target's bonus token
    return accepted


def acceptance(matches: list[Tensor], k: int) -> Acceptance:
    accepted = replay_rounds(matches, k)
    mean = sum(accepted) / max(1, len(accepted))
    total = sum(len(m) for m in matches)
    agree = sum(int(m.sum()) for m in matches) / max(1, total)
    return Acceptance(k, mean, solve_alpha(mean, k), len(accepted), agree)


@torch.inference_mode()
def draft_step_seconds(
    draft: Transformer, use_markov: bool, context: int = 256, iters: int = 50, batch: int = 1
) -> float:
    """Mean seconds of one draft decode step (forward of one token + logits + argmax) at `context`."""
    device = draft.model.embed_tokens.weight.device
    cache = KVCache.for_model(draft, batch, context + 1)
    ids = torch.ones(batch, 1, dtype=torch.int64, device=device)
    slots = torch.arange(batch, device=device)
    positions = torch.full((batch, 1), context - 1, dtype=torch.int64, device=device)

    def step() -> None:
        hidden = draft(ids, positions, slots, cache, context)
        draft.greedy_draft_tokens(hidden[:, 0], ids[:, 0] if use_markov else None)

    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    for _ in range(5):
        step()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    sync()
    return (time.perf_counter() - t0) / iters
