"""Prompts the target writes itself (self-instruct), added to the built-in training prompts.

Why: the SmolLM2 draft trained on the built-in prompts alone agreed with its target far more on text like
its training data than on new chat. On CPU (fp32, 24 prompts each, 128 new tokens, α at k = 4): 0.742 on
training prompts, 0.614 on the training templates with topics no prompt names, 0.488 on the held-out
chat prompts; the draft retrained with 4853 self-instructed prompts 0.730 / 0.638 / 0.550 (the shipped
draft, with 9414 such prompts, reaches held-out α 0.597 on the GPU). Part of the gap is memorised
answers, part is form: 97 % of the built-in prompts are one of 36 templates on one of 173 topics.
The target's own questions ("How are volcanoes formed?") are free chat in the target's own distribution,
as many as the device budget allows.

The target answers SELF_INSTRUCT_FORMS (numbered lists of five questions or requests, most on a
training topic) sampled at T = 0.7; every list item that reads as one prompt is kept, once, unless it
names a held-out prompt's subject or is a built-in prompt already. A prompt set other than the general
one (`--prompt-set coding`) brings its own forms, topics, prompts and held-out subjects.
"""

from __future__ import annotations

import random
import re

import torch

from common.models.transformer import Transformer
from common.training import prompts as builtin_prompts
from common.training.data import sample_answers

TEMPERATURE = 0.7
MAX_NEW_TOKENS = 160  # five short items and the chatter around them

_ITEM = re.compile(r"^\s*(?:#?\d{1,2}[.):]|[-*•])\s+(.+?)\s*$")


def parse_items(text: str) -> list[str]:
    """The list items of `text` that read as one prompt each: 3 to 30 words, a letter first, a sentence
    end last, no link or markdown label (these were mostly noise)."""
    out = []
    for line in text.splitlines():
        m = _ITEM.match(line)
        if m is None:
            continue
        item = m.group(1).strip().strip('"*').strip()
        if (
            3 <= len(item.split()) <= 30
            and item[0].isalpha()
            and item[-1] in "?.!"
            and not any(bad in item for bad in ("http", "[", "**", ":"))
        ):
            out.append(item)
    return out


def writing_prompts(count: int, seed: int, prompt_set: str = "general") -> list[str]:
    """`count` instructions that ask the target for prompts: seeded (form, topic) draws from the forms and
    topics of `prompt_set` (builtin_prompts.PROMPT_SETS)."""
    ps = builtin_prompts.PROMPT_SETS[prompt_set]
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        form = rng.choice(ps.self_instruct_forms)
        out.append(form.format(t=rng.choice(ps.self_instruct_topics)) if "{t}" in form else form)
    return out


def self_instruct_prompts(
    target: Transformer,
    tokenizer,
    encode,
    eos: set[int],
    count: int,
    seed: int,
    batch_size: int,
    prompt_set: str = "general",
) -> tuple[list[str], dict]:
    """Prompts the target writes in answer to `count` instructions (`encode`: texts -> prompt ids, chat
    template included), and counts for the log: instructions, items parsed, kept."""
    asks = writing_prompts(count, seed, prompt_set)
    device = target.model.embed_tokens.weight.device
    items: list[str] = []
    for i in range(0, len(asks), batch_size):
        gen = torch.Generator(device=device).manual_seed(seed * 100_003 + i)
        answers, _, _ = sample_answers(
            target, encode(asks[i : i + batch_size]), TEMPERATURE, MAX_NEW_TOKENS, eos, gen
        )
        for answer in answers:
            items += parse_items(tokenizer.decode([t for t in answer if t not in eos]))
    ps = builtin_prompts.PROMPT_SETS[prompt_set]
    known = {p.casefold() for p in ps.training(0) + ps.held_out()}
    kept = []
    for item in items:
        key = item.casefold()
        if key not in known and not ps.names_held_out_subject(item):
            known.add(key)
            kept.append(item)
    return kept, {"instructions": len(asks), "items": len(items), "kept": len(kept)}
