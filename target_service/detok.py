"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: a trailing incomplete UTF-8
character (decoded as U+FFFD) or a suffix that could still grow into a stop
string is held back, together with the tokens that produced it. So no partial
stop string is ever streamed, and token ids and text stay in step. Each new token
is decoded from a window of a few tokens (as vLLM's incremental detokenizer does),
so a token costs the same at the end of a long output as at its start.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field
from typing import Protocol

from common.tokenizer import DecodeStream


class Decoder(Protocol):
    def decode(self, ids: list[int]) -> str: ...

    def decode_stream(self) -> DecodeStream: ...


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
    text: str = ""  # decoded text of the confirmed tokens (never ends in a partial character)
    # char_end[j]: len(text) once token j is confirmed; tokens past len(char_end) await more bytes.
    char_end: list[int] = field(default_factory=list)
    # flush() decodes the unconfirmed tail from ids[prefix:]: the last confirmed token(s) as context
    prefix: int = 0
    stream: DecodeStream | None = None  # the tokenizer's incremental decoder, made on first use
    sent_ids: int = 0
    sent_chars: int = 0

    def _append(self, new_ids: list[int]) -> None:
        """Decodes `new_ids` onto the confirmed text, joined to it once: `text += chunk` per token would copy
        the whole text per token (64 streams of 5 tokens a step, 4000 tokens in: 0.87 ms, not 0.60)."""
        assert self.tokenizer is not None
        if self.stream is None:
            self.stream = self.tokenizer.decode_stream()
        step, ids, char_end = self.stream.step, self.ids, self.char_end
        chunks, length = [], len(self.text)
        for token in new_ids:
            ids.append(token)
            chunk = step(token)
            if chunk is None:
                continue  # an incomplete character: wait for its next bytes
            confirmed = len(char_end)
            length += len(chunk)
            chunks.append(chunk)
            char_end += [length] * (len(ids) - confirmed)
            self.prefix = confirmed
        if chunks:
            self.text += "".join(chunks)

    def _held_suffix(self, text: str) -> int:
        """Characters at the end of `text` that might still become a stop string."""
        hold = 0
        for stop in self.stop_strings:
            for n in range(min(len(stop) - 1, len(text)), 0, -1):
                if text.endswith(stop[:n]):
                    hold = max(hold, n)
                    break
        return hold

    def push(self, new_ids: list[int]) -> Delta:
        if self.tokenizer is None:
            self.ids.extend(new_ids)
            delta = Delta(self.ids[self.sent_ids :], "")
            self.sent_ids = len(self.ids)
            return delta
        self._append(new_ids)
        text = self.text
        if self.stop_strings:
            search_from = max(0, self.sent_chars - max(len(s) for s in self.stop_strings))
            hits = [(i, s) for s in self.stop_strings if (i := text.find(s, search_from)) >= 0]
            if hits:
                idx, stop = min(hits)
                end_ids = bisect.bisect_left(self.char_end, idx + len(stop)) + 1
                delta = Delta(self.ids[self.sent_ids : end_ids], text[self.sent_chars : idx], stopped=True)
                self.sent_ids, self.sent_chars = len(self.ids), idx
                return delta
        safe = len(text) - self._held_suffix(text)
        end_ids = bisect.bisect_right(self.char_end, safe)  # tokens whose text is all released
        delta = Delta(self.ids[self.sent_ids : end_ids], text[self.sent_chars : safe])
        self.sent_ids, self.sent_chars = max(self.sent_ids, end_ids), max(self.sent_chars, safe)
        return delta

    def flush(self) -> Delta:
        """At the end of a request (no stop string hit): release whatever was held back."""
        if self.tokenizer is None:
            return Delta(self.ids[self.sent_ids :], "")
        known = self.tokenizer.decode(self.ids[self.prefix : len(self.char_end)])
        tail = self.tokenizer.decode(self.ids[self.prefix :])[
            len(known) :
        ]  # incomplete characters, as U+FFFD
        delta = Delta(self.ids[self.sent_ids :], self.text[self.sent_chars :] + tail)
        self.sent_ids, self.sent_chars = len(self.ids), len(self.text)
        return delta
