"""Model configuration parsed from a Hugging Face config.json (Llama / Qwen2 / Qwen3 decoder-only models)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")
SUPPORTED_ROPE_TYPES = ("default", "llama3", "linear")


def parse_feature_layers(value: Any) -> tuple[int, ...] | None:
    """config.json 'feature_layers' (a list of target layer indices) -> a tuple; None when absent."""
    if value is None:
        return None
    if (
        not isinstance(value, list | tuple)
        or not value
        or not all(isinstance(i, int) and i >= 0 for i in value)
    ):
        raise ValueError(f"config.json: feature_layers={value!r}: expected a non-empty list of layer indices")
    return tuple(value)


# Names the checkpoints, flags and tiny models use for weight dtypes.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool  # Qwen2: bias on q/k/v projections
    qk_norm: bool  # Qwen3: RMSNorm over head_dim on q and k
    eos_token_id: int | list[int] | None
    bos_token_id: int | None
    torch_dtype: str
    final_logit_softcapping: float | None = None
    logit_scale: float = 1.0
    markov_rank: int = 0  # 0 = no Markov head
    draft_vocab_size: int | None = None  # set when the LM head covers a smaller draft vocab (d2t table)
    # A feature draft (common/models/feature_draft.py): the target layers whose input streams it reads.
    feature_layers: tuple[int, ...] | None = None
    name: str = ""

    @property
    def feature_size(self) -> int:
        """Width of one position's target features: the chosen layers' streams side by side."""
        return len(self.feature_layers or ()) * self.hidden_size

    @property
    def lm_head_vocab_size(self) -> int:
        """Rows of the LM head: the draft vocab when a d2t table maps it onto the full vocab."""
        return self.draft_vocab_size or self.vocab_size

    @classmethod
    def from_pretrained(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        config_file = path / "config.json" if path.is_dir() else path
        if not config_file.is_file():
            raise FileNotFoundError(f"no config.json in {path}")
        with open(config_file) as f:
            raw = json.load(f)
        return cls.from_dict(raw, name=config_file.parent.name)

    @classmethod
    def from_dict(cls, raw: dict[str, Any], name: str = "") -> ModelConfig:
        archs = raw.get("architectures") or []
        arch = archs[0] if archs else None
        if arch not in SUPPORTED_ARCHITECTURES:
            raise ValueError(
                f"config.json 'architectures'={archs!r}: unsupported architecture; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )

        def need(key: str) -> Any:
            if key not in raw:
                raise ValueError(f"config.json: missing required field '{key}' for {arch}")
            return raw[key]

        hidden = int(need("hidden_size"))
        num_heads = int(need("num_attention_heads"))
        num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
        head_dim = raw.get("head_dim")
        if head_dim is None:
            if hidden % num_heads:
                raise ValueError(
                    f"config.json: hidden_size={hidden} is not divisible by num_attention_heads={num_heads} "
                    "(and no head_dim is given)"
                )
            head_dim = hidden // num_heads
        if num_heads % num_kv_heads:
            raise ValueError(
                f"config.json: num_attention_heads={num_heads} is not divisible by "
                f"num_key_value_heads={num_kv_heads}"
            )
        rope_scaling = raw.get("rope_scaling")
        if rope_scaling is not None:
            rope_type = rope_scaling.get("rope_type", rope_scaling.get("type", "default"))
            if rope_type not in SUPPORTED_ROPE_TYPES:
                raise ValueError(
                    f"config.json: rope_scaling.rope_type={rope_type!r} is not supported "
                    f"(supported: {', '.join(SUPPORTED_ROPE_TYPES)})"
                )
        draft_vocab = raw.get("draft_vocab_size")
        vocab = int(need("vocab_size"))
        if draft_vocab is not None and int(draft_vocab) == vocab:
            draft_vocab = None
        tie = bool(raw.get("tie_word_embeddings", False))
        if draft_vocab is not None and tie:
            raise ValueError(
                "config.json: tie_word_embeddings=true needs "
                f"draft_vocab_size ({draft_vocab}) == vocab_size ({vocab})"
            )
        return cls(
            architecture=arch,
            vocab_size=vocab,
            hidden_size=hidden,
            intermediate_size=int(need("intermediate_size")),
            num_hidden_layers=int(need("num_hidden_layers")),
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            head_dim=int(head_dim),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta", 10000.0)),
            rope_scaling=rope_scaling,
            max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
            tie_word_embeddings=tie,
            attention_bias=bool(raw.get("attention_bias", arch == "Qwen2ForCausalLM")),
            qk_norm=arch == "Qwen3ForCausalLM",
            eos_token_id=raw.get("eos_token_id"),
            bos_token_id=raw.get("bos_token_id"),
            torch_dtype=str(raw.get("torch_dtype", "float32")),
            final_logit_softcapping=raw.get("final_logit_softcapping"),
            logit_scale=float(raw.get("logit_scale", 1.0)),
            markov_rank=int(raw.get("markov_rank", 0) or 0),
            draft_vocab_size=None if draft_vocab is None else int(draft_vocab),
            feature_layers=parse_feature_layers(raw.get("feature_layers")),
            name=name,
        )

    def check_tp(self, tp_size: int) -> None:
        """Raises ValueError naming the size that a `tp_size`-way split cannot divide."""
        for field, value in (
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("intermediate_size", self.intermediate_size),
        ):
            if value % tp_size:
                raise ValueError(
                    f"{self.name or 'model'}: {field}={value} is not divisible by tp_size={tp_size}"
                )
