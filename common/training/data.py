"""Distillation data: the target's own generations, with its top-K next-token distribution at every step.

Each prompt is answered at a few temperatures (greedy text is what greedy speculation verifies; sampled
text covers the rest of the distribution). At every generated position we keep the target's top-K
probabilities at temperature 1, so the draft learns the whole shape of the target's next-token
distribution (a KL loss), not only one sampled token. Data is written in parts, one per prompt batch,
so a run cut off by a time limit resumes where it stopped.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from common.kv_cache import KVCache
from common.models.generate import forward_rows
from common.models.transformer import Transformer


def write_whole(path: Path, write: Callable[[Path], object]) -> None:
    """`write` to a side file, then renamed to `path`: a reader (another data shard's run) never sees
    half a file."""
    side = path.with_name(path.name + ".partial")
    write(side)
    side.replace(path)


@dataclass
class Sequences:
    """Variable-length sequences stored flat. Row i is tokens[offsets[i]:offsets[i + 1]].

    topk_ids / topk_probs [N_tokens, K]: the target's distribution of the token AFTER each position;
    trained[N_tokens]: positions whose next token the draft learns (the answer, not the prompt).
    """

    tokens: Tensor  # [N] int64
    offsets: Tensor  # [num_seqs + 1] int64
    topk_ids: Tensor  # [N, K] int64
    topk_probs: Tensor  # [N, K] float32, rows sum to <= 1
    trained: Tensor  # [N] bool

    @property
    def num_seqs(self) -> int:
        return len(self.offsets) - 1

    def row(self, i: int) -> slice:
        return slice(int(self.offsets[i]), int(self.offsets[i + 1]))

    def save(self, path: Path) -> None:
        tensors = {
            "tokens": self.tokens,
            "offsets": self.offsets,
            "topk_ids": self.topk_ids.int(),
            "topk_probs": self.topk_probs.half(),
            "trained": self.trained.to(torch.uint8),
        }
        write_whole(path, lambda side: save_file(tensors, str(side)))

    @classmethod
    def load(cls, path: Path) -> Sequences:
        t = load_file(str(path))
        return cls(
            t["tokens"], t["offsets"], t["topk_ids"].long(), t["topk_probs"].float(), t["trained"].bool()
        )

    @classmethod
    def concat(cls, parts: list[Sequences]) -> Sequences:
        lengths = torch.cat([p.offsets.diff() for p in parts])
        offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
        return cls(
            torch.cat([p.tokens for p in parts]),
            offsets,
            torch.cat([p.topk_ids for p in parts]),
            torch.cat([p.topk_probs for p in parts]),
            torch.cat([p.trained for p in parts]),
        )


EXIT_CHECK_EVERY = 16  # decode steps between read-backs of whether a batch's answers have all ended


def _sample(logits: Tensor, temperature: float, gen: torch.Generator) -> Tensor:
    """fp32 [B, V] -> [B] ids: argmax at temperature 0, else a draw from softmax(logits / T)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, -1)
    return torch.multinomial(probs, 1, generator=gen).squeeze(-1)


def _topk(logits: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """fp32 [..., V] -> (ids [..., K], probs [..., K]) of softmax(logits), on logits' device."""
    probs, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    return ids, probs


@torch.inference_mode()
def sample_answers(
    target: Transformer,
    prompts: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    eos_token_ids: set[int],
    gen: torch.Generator,
    top_k: int = 0,
) -> tuple[list[list[int]], list, list]:
    """The target's answers to `prompts` (one batch; each ends at its first EOS, kept), and with
    top_k > 0 its top-K at every prompt position, and at every answer position but the last as one
    (ids [n, K], probs [n, K]) pair per answer (else [] and []).
    The decode loop stays on the device: a step's tokens and top-K are kept there and read back once at the
    end; a finished row keeps decoding (its outputs are dropped), so the batch's shape never changes, and
    the loop ends within EXIT_CHECK_EVERY steps of the last row's end."""
    n = len(prompts)
    cache = KVCache.for_model(target, n, max(map(len, prompts)) + max_new_tokens)
    hidden = forward_rows(target, cache, list(range(n)), [0] * n, prompts)
    lengths = [len(p) for p in prompts]
    # Prompt positions: their top-K is kept (cheap) but they are not trained on.
    prompt_topk = []
    if top_k:
        for b in range(n):  # one row's [L, V] logits at a time
            ids, probs = _topk(target.compute_logits(hidden[b, : lengths[b]]), top_k)
            prompt_topk.append((ids.cpu(), probs.cpu()))
    device = hidden.device
    starts = torch.tensor(lengths, dtype=torch.int64, device=device)
    slots = torch.arange(n, device=device)
    eos_ids = torch.tensor(sorted(eos_token_ids), dtype=torch.int64)
    eos = eos_ids.to(device)
    logits = target.compute_logits(hidden[slots, starts - 1])
    live = torch.ones(n, dtype=torch.bool, device=device)
    tokens, tops = [], []  # per step: [B] ids; ([B, K] ids, [B, K] probs) of the next token's distribution
    for step in range(max_new_tokens):
        ids = target.map_to_target(_sample(logits, temperature, gen))
        tokens.append(ids)
        live &= ~torch.isin(ids, eos)
        # Whether every row has ended is read back every EXIT_CHECK_EVERY steps only: a read-back each step
        # would stop the host from queueing the next step's kernels while the GPU runs this one.
        last = step + 1 == max_new_tokens
        if last or (step % EXIT_CHECK_EVERY == EXIT_CHECK_EVERY - 1 and not bool(live.any())):
            break
        positions = (starts + step)[:, None]
        hidden = target(ids[:, None], positions, slots, cache, max(lengths) + step + 1)
        logits = target.compute_logits(hidden[:, 0])
        if top_k:
            tops.append(_topk(logits, top_k))
    decoded = torch.stack(tokens, 1).cpu()  # [B, steps]
    ended = torch.isin(decoded, eos_ids)
    # each answer runs to its first EOS (kept), or through every step
    ends = torch.where(ended.any(1), ended.int().argmax(1) + 1, decoded.shape[1]).tolist()
    answers = [decoded[b, : ends[b]].tolist() for b in range(n)]
    answer_topk = []
    if top_k:
        if tops:
            top_ids = torch.stack([t[0] for t in tops], 1).cpu()  # [B, steps - 1, K]
            top_probs = torch.stack([t[1] for t in tops], 1).cpu()
        else:
            top_ids = torch.zeros(n, 0, top_k, dtype=torch.int64)
            top_probs = torch.zeros(n, 0, top_k)
        answer_topk = [(top_ids[b, : ends[b] - 1], top_probs[b, : ends[b] - 1]) for b in range(n)]
    return answers, prompt_topk, answer_topk


def generate_batch(
    target: Transformer,
    prompts: list[list[int]],
    temperature: float,
    max_new_tokens: int,
    top_k: int,
    eos_token_ids: set[int],
    gen: torch.Generator,
) -> Sequences:
    """Answers `prompts` with the target (one batch) and records its top-K at every position."""
    answers, prompt_topk, answer_topk = sample_answers(
        target, prompts, temperature, max_new_tokens, eos_token_ids, gen, top_k
    )
    return _pack(prompts, answers, prompt_topk, answer_topk)


def _pack(prompts, answers, prompt_topk, answer_topk) -> Sequences:
    """Position p of a sequence holds token p and the target's distribution of token p + 1. The last
    answer token has no next token recorded, so the sequence ends one short of its full text."""
    parts = []
    for prompt, answer, (p_ids, p_probs), (a_ids, a_probs) in zip(prompts, answers, prompt_topk, answer_topk):
        tokens = prompt + answer[:-1] if len(answer) > 1 else list(prompt)
        ids = torch.cat([p_ids, a_ids[: len(tokens) - len(prompt)]])
        probs = torch.cat([p_probs, a_probs[: len(tokens) - len(prompt)]])
        trained = torch.zeros(len(tokens), dtype=torch.bool)
        trained[len(prompt) - 1 :] = True  # the last prompt position predicts the first answer token
        parts.append(
            Sequences(
                torch.tensor(tokens, dtype=torch.int64),
                torch.tensor([0, len(tokens)], dtype=torch.int64),
                ids.long(),
                probs.float(),
                trained,
            )
        )
    return Sequences.concat(parts)


def first_eos(ids: list[int], eos_token_ids: set[int]) -> list[int]:
    """`ids` cut just after its first EOS (kept), or whole."""
    for i, tok in enumerate(ids):
        if tok in eos_token_ids:
            return ids[: i + 1]
    return ids
