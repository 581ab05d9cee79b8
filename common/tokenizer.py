"""Tokenizer: Hugging Face `tokenizer.json` through the `tokenizers` library, or raw UTF-8 bytes."""

from __future__ import annotations

import json
from pathlib import Path


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, vocab_size, eos_token_id (None when unknown)."""

    def __init__(self, hf_tokenizer=None, eos_token_id: int | None = None):
        self._hf = hf_tokenizer
        self.eos_token_id = eos_token_id

    @property
    def vocab_size(self) -> int:
        return 256 if self._hf is None else self._hf.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str) -> list[int]:
        if self._hf is None:
            return list(text.encode("utf-8"))
        return self._hf.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        if self._hf is None:
            # ids past the byte range (a model vocab larger than 256) have no text
            return bytes(i for i in ids if 0 <= i < 256).decode("utf-8", errors="replace")
        return self._hf.decode(list(ids), skip_special_tokens=True)

    @property
    def is_byte_level(self) -> bool:
        return self._hf is None


def _eos_from_files(path: Path, hf) -> int | None:
    tok_cfg = path / "tokenizer_config.json"
    if hf is not None and tok_cfg.is_file():
        eos = json.loads(tok_cfg.read_text()).get("eos_token")
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str) and hf.token_to_id(eos) is not None:
            return hf.token_to_id(eos)
    cfg = path / "config.json"
    if cfg.is_file():
        eos = json.loads(cfg.read_text()).get("eos_token_id")
        if isinstance(eos, list):
            eos = eos[0] if eos else None
        return eos
    return None


def load_tokenizer(path: str | Path) -> Tokenizer:
    path = Path(path)
    hf = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    return Tokenizer(hf, _eos_from_files(path, hf))
