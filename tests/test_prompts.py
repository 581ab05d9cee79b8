"""The coding prompt set (common/training/prompts.py PROMPT_SETS["coding"]): held-out coding prompts that
no coding training prompt, nor a kept self-instructed one, touches."""

from __future__ import annotations

import re

from common.training import prompts as builtin_prompts
from common.training.self_instruct import writing_prompts

CODING = builtin_prompts.PROMPT_SETS["coding"]


def test_coding_held_out_prompts_are_disjoint_from_training() -> None:
    training, held_out = CODING.training(0), CODING.held_out()
    assert len(held_out) == len(set(held_out)) >= 64
    assert len(training) == len(set(training)) > 1000
    assert not set(training) & set(held_out)
    assert held_out == CODING.held_out() and training == CODING.training(0)  # deterministic
    assert training != CODING.training(1) and sorted(training) == sorted(CODING.training(1))
    for subject, words in CODING.subjects.items():
        pattern = re.compile(rf"\b({words})\b", re.IGNORECASE)
        assert any(pattern.search(p) for p in held_out), subject  # the pattern finds its prompt
        hits = [p for p in training if pattern.search(p)]
        assert not hits, (subject, hits[:3])
    # Every held-out prompt has a subject; the one-pattern filter agrees with the per-subject ones.
    assert all(map(CODING.names_held_out_subject, held_out))
    assert not any(map(CODING.names_held_out_subject, training))


def test_coding_self_instruct_asks_for_programming_prompts_and_drops_held_out_subjects() -> None:
    asks = writing_prompts(200, seed=0, prompt_set="coding")
    assert asks == writing_prompts(200, seed=0, prompt_set="coding")
    forms = [re.escape(f).replace(r"\{t\}", "(.+)") for f in builtin_prompts.CODING_SELF_INSTRUCT_FORMS]
    topics = set(builtin_prompts.CODING_TOPICS)
    for ask in asks:
        match = next(m for f in forms if (m := re.fullmatch(f, ask)))
        assert all(t in topics for t in match.groups()), ask
    assert len(set(asks)) > 80
    assert not any(map(CODING.names_held_out_subject, asks))
    # What the filter drops: an item naming a held-out subject, in any case, as a whole word.
    assert CODING.names_held_out_subject("How do I build a TRIE in Go?")
    assert not CODING.names_held_out_subject("How do I retrieve a value from a map?")
    # The general set keeps its own subjects.
    assert builtin_prompts.PROMPT_SETS["general"].names_held_out_subject("Why is the sky blue?")
    assert not builtin_prompts.PROMPT_SETS["general"].names_held_out_subject("How do I build a trie?")
