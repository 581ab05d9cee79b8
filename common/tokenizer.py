"""Tokenizer: Hugging Face `tokenizer.json` (or a GGUF file's metadata) through the `tokenizers` library,
or raw UTF-8 bytes; plus the model's chat template, rendered with jinja2 as transformers renders it."""

from __future__ import annotations

import codecs
import json
from datetime import datetime
from pathlib import Path
from typing import Protocol


class ChatTemplateError(ValueError):
    """The messages do not fit the template (it raised), or the model has no chat template."""


class Tokenizer:
    """encode(text) -> ids, decode(ids) -> text, vocab_size, eos_token_id (None when unknown),
    apply_chat_template(messages) -> ids when the model ships a chat template."""

    def __init__(
        self,
        hf_tokenizer=None,
        eos_token_id: int | None = None,
        chat_template: str | None = None,
        special_tokens: dict[str, str | None] | None = None,
    ):
        self._hf = hf_tokenizer
        self.eos_token_id = eos_token_id
        self.chat_template = chat_template
        self.special_tokens = special_tokens or {}  # bos_token / eos_token text, passed to the template
        self._no_text_ids: frozenset[int] | None = None  # special tokens: `decode` skips them

    def render_chat(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The prompt text for `messages` ([{role, content}]), ending with the assistant's turn opener."""
        if not self.chat_template:
            raise ChatTemplateError("messages: the target model has no chat template")
        import jinja2

        try:
            return _compile(self.chat_template).render(
                messages=messages, add_generation_prompt=add_generation_prompt, **self.special_tokens
            )
        except jinja2.TemplateError as exc:
            raise ChatTemplateError(f"messages: the chat template rejected them: {exc}") from exc

    def apply_chat_template(self, messages: list[dict[str, str]]) -> list[int]:
        """Ids of the rendered chat prompt. Special tokens the template writes (e.g. <|im_start|>) map to
        their ids; no BOS is added beyond what the template writes (as transformers' apply_chat_template)."""
        return self.encode(self.render_chat(messages))

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

    def decode_stream(self) -> DecodeStream:
        """A new incremental decoder for one output: step(id) -> the text that token completes, or None
        while it ends in an incomplete character (the text then comes with a later token)."""
        if self._hf is None:
            return _ByteDecodeStream()
        if self._no_text_ids is None:
            added = self._hf.get_added_tokens_decoder()
            self._no_text_ids = frozenset(i for i, tok in added.items() if tok.special)
        return _HFDecodeStream(self._hf, self._no_text_ids, self.vocab_size)

    @property
    def is_byte_level(self) -> bool:
        return self._hf is None


class DecodeStream(Protocol):
    def step(self, token_id: int) -> str | None: ...


class _HFDecodeStream:
    """The tokenizers library's own incremental decoder (Rust: one call per token, the prefix window and
    the byte-fallback / UTF-8 hold-back inside), with the special tokens skipped as `decode` does.

    DecodeStream answers None for any token that adds no text, not only for an incomplete character. A
    special token or an id past the tokenizer's vocabulary (a model's padding rows) has no text at all:
    it is answered "" here without being fed, so its id is released at once instead of waiting for the
    next token with text (which a model sampling only such ids would never produce)."""

    def __init__(self, hf, no_text_ids: frozenset[int], vocab_size: int) -> None:
        from tokenizers.decoders import DecodeStream as _Stream

        self._hf, self._stream = hf, _Stream(skip_special_tokens=True)
        self._no_text_ids, self._vocab_size = no_text_ids, vocab_size

    def step(self, token_id: int) -> str | None:
        if token_id in self._no_text_ids or not 0 <= token_id < self._vocab_size:
            return ""
        return self._stream.step(self._hf, token_id)


class _ByteDecodeStream:
    """Raw UTF-8 bytes (ids 0-255; larger ids have no text) through Python's incremental UTF-8 codec."""

    def __init__(self) -> None:
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")

    def step(self, token_id: int) -> str | None:
        if not 0 <= token_id < 256:
            return ""
        text = self._utf8.decode(bytes((token_id,)))
        return None if not text and self._utf8.getstate()[0] else text


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


def _compile(template: str):
    """transformers' chat-template environment: sandboxed, trim/lstrip blocks, loop controls, tojson,
    raise_exception and strftime_now."""
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template)


def _template_from_files(path: Path) -> str | None:
    """chat_template.jinja, else tokenizer_config.json's chat_template (the default one of a list)."""
    if (path / "chat_template.jinja").is_file():
        return (path / "chat_template.jinja").read_text()
    tok_cfg = path / "tokenizer_config.json"
    if not tok_cfg.is_file():
        return None
    template = json.loads(tok_cfg.read_text()).get("chat_template")
    if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template}
        template = named.get("default")
    return template


def _special_from_files(path: Path) -> dict[str, str | None]:
    tok_cfg = path / "tokenizer_config.json"
    raw = json.loads(tok_cfg.read_text()) if tok_cfg.is_file() else {}
    out = {}
    for key in ("bos_token", "eos_token"):
        value = raw.get(key)
        out[key] = value.get("content") if isinstance(value, dict) else value
    return out


def load_tokenizer(path: str | Path) -> Tokenizer:
    """From a Hugging Face directory (tokenizer.json, tokenizer_config.json, chat_template.jinja) or a
    GGUF file / a directory holding one (its tokenizer.* metadata)."""
    from common.gguf import find_gguf, open_gguf

    path = Path(path)
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        ckpt = open_gguf(gguf_file)
        special = {"bos_token": ckpt.token("bos_token_id"), "eos_token": ckpt.token("eos_token_id")}
        eos = ckpt.metadata("tokenizer.ggml.eos_token_id", None)
        template = ckpt.metadata("tokenizer.chat_template", None)
        return Tokenizer(ckpt.hf_tokenizer(), None if eos is None else int(eos), template, special)
    hf = None
    if (path / "tokenizer.json").is_file():
        from tokenizers import Tokenizer as HFTokenizer

        hf = HFTokenizer.from_file(str(path / "tokenizer.json"))
    return Tokenizer(hf, _eos_from_files(path, hf), _template_from_files(path), _special_from_files(path))
