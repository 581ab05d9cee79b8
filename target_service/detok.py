"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: a trailing incomplete UTF-8
character (decoded as U+FFFD) or a suffix that could still grow into a stop
string is held back, together with the tokens that produced it. So no partial
stop string is ever streamed, and token ids and text stay in step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...


@dataclass
class Delta:
    token_ids: list[int]
    text: str
    stopped: bool = False  # a stop string matched; the request ends here


@dataclass
class StreamDetokenizer:
    tokenizer: Decoder | None
    stop_strings: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    sent_ids: int = 0
    sent_chars: int = 0

    def _held_suffix(self, text: str) -> int:
        """Characters at the end of `text` that might still become a stop string or a whole character."""
        hold = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        if text.endswith("\ufffd"):
            hold = max(hold, len(text) - len(text.rstrip("\ufffd")))
        return hold

    def _ids_covering(self, chars: int) -> int:
        """Largest token count whose decoded text fits within the first `chars` characters."""
        j = self.sent_ids
        while j < len(self.ids) and len(self._decode(self.ids[: j + 1])) <= chars:
            j += 1
        return j

    def _decode(self, ids: list[int]) -> str:
        assert self.tokenizer is not None
        return self.tokenizer.decode(ids)

    def push(self, new_ids: list[int]) -> Delta:
        self.ids.extend(new_ids)
        if self.tokenizer is None:
            delta = Delta(self.ids[self.sent_ids :], "")
            self.sent_ids = len(self.ids)
            return delta
        text = self._decode(self.ids)
        if self.stop_strings:
            search_from = max(0, self.sent_chars - max(len(s) for s in self.stop_strings))
            hits = [(i, s) for s in self.stop_strings if (i := text.find(s, search_from)) >= 0]
            if hits:
                idx, stop = min(hits)
                end_ids = self._ids_covering(idx + len(stop) - 1) + 1
                delta = Delta(
                    self.ids[self.sent_ids : min(end_ids, len(self.ids))],
                    text[self.sent_chars : idx],
                    stopped=True,
                )
                self.sent_ids, self.sent_chars = len(self.ids), idx
                return delta
        safe = len(text) - self._held_suffix(text)
        end_ids = self._ids_covering(safe) if safe < len(text) else len(self.ids)
        delta = Delta(self.ids[self.sent_ids : end_ids], text[self.sent_chars : safe])
        self.sent_ids, self.sent_chars = end_ids, max(self.sent_chars, safe)
        return delta

    def flush(self) -> Delta:
        """At the end of a request (no stop string hit): release whatever was held back."""
        if self.tokenizer is None:
            return Delta(self.ids[self.sent_ids :], "")
        text = self._decode(self.ids)
        delta = Delta(self.ids[self.sent_ids :], text[self.sent_chars :])
        self.sent_ids, self.sent_chars = len(self.ids), len(text)
        return delta
