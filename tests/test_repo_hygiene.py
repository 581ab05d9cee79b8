"""The tracked files describe the product as it is: no development-history phrases (an ordinal, or
this / last / next, before the word session) in code, tests, docs or scripts. History lives in git.
"session" stays where it names a real thing (DraftSession, draft_session, scope="session" of pytest)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

ORDINAL = r"(?:\d+(?:st|nd|rd|th)|[a-z-]*(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|teenth|tieth))"  # noqa: E501
HISTORY = re.compile(rf"\b(?:{ORDINAL}|this|last|next|previous|earlier)\s+sessions?\b", re.IGNORECASE)
# Real names that contain the word: removed before matching.
REAL_NAMES = re.compile(r"DraftSession|draft_session|scope\s*=\s*[\"']session[\"']", re.IGNORECASE)


def history_phrases(text: str) -> list[str]:
    return [m.group(0) for m in HISTORY.finditer(REAL_NAMES.sub("", text))]


def _tracked_texts():
    files = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in filter(None, files.decode().split("\0")):
        path = ROOT / name
        if not path.is_file():  # deleted in the work tree, or a submodule
            continue
        data = path.read_bytes()
        if b"\0" in data[:8192]:  # a binary file
            continue
        yield name, data.decode("utf-8", errors="replace")


def test_the_pattern_finds_history_and_spares_real_names():
    word = "session"  # split so that this file does not match itself
    history = [f"Twenty-fifth {word}", f"the 3rd {word}", f"sixth, seventh and ninth {word}s",
               f"In this\n{word}", f"last {word}", f"next {word}", f"the eleventh {word}'s run"]  # fmt: skip
    for phrase in history:
        assert history_phrases(phrase), phrase
    for real in ("DraftSession", "the draft_session module", f'@pytest.fixture(scope="{word}")',
                 f"the draft {word} sees it", f"a {word} of the SDK", f"with {word}:"):  # fmt: skip
        assert not history_phrases(real), real


def test_no_tracked_file_names_development_history():
    found = [f"{name}: {phrase!r}" for name, text in _tracked_texts() for phrase in history_phrases(text)]
    assert not found, f"{len(found)} development-history phrases (history belongs in git):\n" + "\n".join(
        found[:50]
    )
