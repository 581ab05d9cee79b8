"""Llama-family GGUF checkpoints (llama.cpp's format): config, weights and tokenizer from one file.

The `gguf` library reads the file (GGUFReader) and dequantizes every supported quant type
(gguf.quants.dequantize); nothing here decodes blocks by hand. What this module adds is the mapping back
to the Hugging Face layout the rest of specsplit uses:

- tensor names: gguf's own HF -> GGUF name map (`gguf.get_tensor_name_map`), asked for each parameter
  name the model has, so `common.loader.load_param` slices each rank's share exactly as for safetensors;
- shapes: GGUF lists dims fastest-first (ggml order); reversed they are the HF [out, in] shapes;
- q/k rows: llama.cpp's converter permutes the rows of each head's q and k projections so that its
  rotary pairs adjacent dims; HF pairs dim i with i + head_dim/2. Undo it as transformers does
  (modeling_gguf_pytorch_utils.LlamaTensorProcessor). Skipping it is silent: the model answers EOS;
- the head: no `output.weight` means the head is tied to `token_embd`;
- the tokenizer (gpt2-style byte-level BPE) and chat template come from the metadata.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import ModelConfig

# general.architecture -> the HF architecture whose layout and config keys it shares.
GGUF_ARCHITECTURES = {"llama": "LlamaForCausalLM"}
# The tokenizer types we can rebuild with the `tokenizers` library.
GGUF_TOKENIZER_MODELS = ("gpt2",)
# llama.cpp pre-tokenizers that split every digit before the GPT-2 regex (llama-vocab.cpp groups these).
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r")


# One decoder layer's modules in a Hugging Face Llama checkpoint.
HF_LAYER_MODULES = (
    "input_layernorm",
    "self_attn.q_proj",
    "self_attn.k_proj",
    "self_attn.v_proj",
    "self_attn.o_proj",
    "post_attention_layernorm",
    "mlp.gate_proj",
    "mlp.up_proj",
    "mlp.down_proj",
)


def find_gguf(path: str | Path) -> Path | None:
    """`path` itself when it is a .gguf file; the one .gguf inside a directory that has no config.json;
    None for a Hugging Face (safetensors) directory. Raises when a directory holds several .gguf files."""
    path = Path(path)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"{path}: no such GGUF file")
        return path
    if not path.is_dir() or (path / "config.json").is_file():
        return None
    found = sorted(path.glob("*.gguf"))
    if len(found) > 1:
        names = ", ".join(f.name for f in found)
        raise ValueError(f"{path}: several .gguf files ({names}); pass --model with the file itself")
    return found[0] if found else None


class _TensorSlice:
    """What `load_param` needs of a safetensors slice: the full shape, and rows of the dequantized tensor."""

    def __init__(self, shape: tuple[int, ...], load):
        self._shape = shape
        self._load = load

    def get_shape(self) -> tuple[int, ...]:
        return self._shape

    def __getitem__(self, index) -> torch.Tensor:
        return self._load()[index]


class GGUFCheckpoint:
    """One GGUF file: `config` (ModelConfig), `get_slice(hf_name)` for the loader, `metadata(key)`."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = gguf.GGUFReader(self.path)
        except Exception as exc:  # the reader raises ValueError / struct / numpy errors on garbage
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.arch = self.metadata("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: general.architecture={self.arch!r} is not supported "
                f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
            )
        self.tensors = {t.name: t for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(
                f"{self.path}: tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported"
            )
        self.config = self._config()
        self._names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, self.config.num_hidden_layers)
        self._check_types()

    # -- metadata ----------------------------------------------------------------------------------
    def metadata(self, key: str, default: Any = ...) -> Any:
        field = self.reader.fields.get(key)
        if field is None:
            if default is ...:
                raise ValueError(f"{self.path}: metadata key '{key}' is missing")
            return default
        return field.contents()

    def _config(self) -> ModelConfig:
        a = self.arch
        need = lambda key: self.metadata(f"{a}.{key}")
        opt = lambda key, default=None: self.metadata(f"{a}.{key}", default)
        heads = int(need("attention.head_count"))
        hidden = int(need("embedding_length"))
        vocab = opt("vocab_size")
        if vocab is None:  # older files: the vocab size is the token list's length
            tokens = self.reader.fields.get("tokenizer.ggml.tokens")
            if tokens is None:
                raise ValueError(f"{self.path}: neither {a}.vocab_size nor tokenizer.ggml.tokens is set")
            vocab = len(tokens.data)
        scaling = opt("rope.scaling.type")
        raw = {
            "architectures": [GGUF_ARCHITECTURES[a]],
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(need("feed_forward_length")),
            "num_hidden_layers": int(need("block_count")),
            "num_attention_heads": heads,
            "num_key_value_heads": int(opt("attention.head_count_kv", heads)),
            "head_dim": int(opt("attention.key_length", hidden // heads)),
            "rms_norm_eps": float(need("attention.layer_norm_rms_epsilon")),
            "rope_theta": float(opt("rope.freq_base", 10000.0)),
            "rope_scaling": None
            if scaling in (None, "none")
            else {"rope_type": scaling, "factor": float(opt("rope.scaling.factor", 1.0))},
            "max_position_embeddings": int(opt("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "attention_bias": "blk.0.attn_q.bias" in self.tensors,
            "eos_token_id": self.metadata("tokenizer.ggml.eos_token_id", None),
            "bos_token_id": self.metadata("tokenizer.ggml.bos_token_id", None),
            "torch_dtype": "float32",
        }
        try:
            return ModelConfig.from_dict(raw, name=self.path.stem)
        except ValueError as exc:
            raise ValueError(f"{self.path}: {exc}".replace("config.json", "GGUF metadata")) from exc

    def _check_types(self) -> None:
        """Fail at open, naming the tensor and type, when gguf cannot dequantize a quant type."""
        import gguf

        for t in self.reader.tensors:
            qtype = t.tensor_type
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                continue
            try:  # one block of zeros tells whether the library implements this type
                type_size = gguf.GGML_QUANT_SIZES[qtype][1]
                gguf.quants.dequantize(np.zeros((1, type_size), np.uint8), qtype)
            except (NotImplementedError, KeyError) as exc:
                raise ValueError(
                    f"{self.path}: tensor '{t.name}' has quant type {qtype.name}, which the gguf library "
                    "cannot dequantize"
                ) from exc

    # -- tensors -----------------------------------------------------------------------------------
    def gguf_name(self, hf_name: str) -> str:
        name = self._names.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise ValueError(f"{self.path}: no GGUF tensor name for parameter '{hf_name}'")
        return name

    def get_slice(self, hf_name: str) -> _TensorSlice:
        name = self.gguf_name(hf_name)
        if name not in self.tensors:
            raise ValueError(f"{self.path}: missing tensor '{name}' (for '{hf_name}')")
        shape = tuple(int(d) for d in reversed(self.tensors[name].shape))
        return _TensorSlice(shape, functools.partial(self.tensor, name))

    def tensor(self, name: str) -> torch.Tensor:
        """The full fp32 tensor `name` in HF layout: dequantized, ggml dims reversed, q/k un-permuted."""
        import gguf

        t = self.tensors[name]
        shape = tuple(int(d) for d in reversed(t.shape))
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        w = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))  # a copy: F32 data is mmapped
        cfg = self.config
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            w = unpermute_rows(w, cfg.num_attention_heads)
        elif name.endswith(("attn_k.weight", "attn_k.bias")):
            w = unpermute_rows(w, cfg.num_key_value_heads)
        return w

    # -- tokenizer ---------------------------------------------------------------------------------
    def hf_tokenizer(self):
        """A `tokenizers.Tokenizer` rebuilt from tokenizer.ggml.* (byte-level BPE, as GPT-2)."""
        from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers
        from tokenizers import Tokenizer as HFTokenizer

        kind = self.metadata("tokenizer.ggml.model", None)
        if kind not in GGUF_TOKENIZER_MODELS:
            raise ValueError(
                f"{self.path}: tokenizer.ggml.model={kind!r} is not supported "
                f"(supported: {', '.join(GGUF_TOKENIZER_MODELS)})"
            )
        tokens = self.metadata("tokenizer.ggml.tokens")
        merges = [tuple(m.split(" ", 1)) for m in self.metadata("tokenizer.ggml.merges")]
        tok = HFTokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, merges))
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
        if self.metadata("tokenizer.ggml.pre", None) in DIGIT_SPLIT_PRE:
            tok.pre_tokenizer = pre_tokenizers.Sequence(
                [pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"), byte_level]
            )
        else:
            tok.pre_tokenizer = byte_level
        tok.decoder = decoders.ByteLevel()
        # CONTROL (3) tokens such as <|im_start|> must match whole in text (a chat template writes them).
        types = self.metadata("tokenizer.ggml.token_type", [])
        special = [AddedToken(t, special=True, normalized=False) for t, k in zip(tokens, types) if k == 3]
        user = [AddedToken(t, special=False, normalized=False) for t, k in zip(tokens, types) if k == 4]
        tok.add_special_tokens(special)
        tok.add_tokens(user)
        return tok

    def token(self, key: str) -> str | None:
        """The text of the special token tokenizer.ggml.<key> (bos_token_id, eos_token_id), if any."""
        i = self.metadata(f"tokenizer.ggml.{key}", None)
        if i is None:
            return None
        return self.reader.fields["tokenizer.ggml.tokens"].contents(int(i))


@functools.lru_cache(maxsize=2)
def open_gguf(path: Path) -> GGUFCheckpoint:
    """One reader per file and process: the loader and the tokenizer share it (opening parses metadata)."""
    return GGUFCheckpoint(path)


def unpermute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """[n_head * head_dim, ...] rows in llama.cpp's rotary order -> HF's (per head: evens then odds).

    transformers' LlamaTensorProcessor._reverse_permute_weights: view rows as [n_head, head_dim/2, 2]
    and swap the last two axes."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, half, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def permute_rows(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """HF -> llama.cpp row order (convert_hf_to_gguf's LlamaModel.permute); the inverse of unpermute_rows."""
    half = w.shape[0] // n_head // 2
    return w.reshape(n_head, 2, half, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()


def export_layers(src: str | Path, out: str | Path, layers: list[int] | None = None) -> Path:
    """Writes a Hugging Face checkpoint directory (config.json + fp32 model.safetensors) of the GGUF
    model at `src`, keeping only the decoder layers `layers` (renumbered 0..n-1; default all) with the
    embeddings, final norm and head. A layer subset of a target is a self-speculative draft: same
    tokenizer and vocab, no training (LayerSkip / Draft & Verify); the target's own head reads it."""
    from safetensors.torch import save_file

    ckpt = open_gguf(Path(find_gguf(src) or src))
    cfg = ckpt.config
    layers = list(range(cfg.num_hidden_layers)) if layers is None else list(layers)
    bad = [i for i in layers if not 0 <= i < cfg.num_hidden_layers]
    if bad:
        raise ValueError(f"layers: {bad[0]} is outside 0..{cfg.num_hidden_layers - 1}")
    layer_names = [f"{m}.weight" for m in HF_LAYER_MODULES]
    if cfg.attention_bias:
        layer_names += [f"self_attn.{p}_proj.bias" for p in "qkv"]
    tensors = {}
    for hf_name in ("model.embed_tokens.weight", "model.norm.weight"):
        tensors[hf_name] = ckpt.get_slice(hf_name)[:]
    if not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = ckpt.get_slice("lm_head.weight")[:]
    for new, old in enumerate(layers):
        for name in layer_names:
            tensors[f"model.layers.{new}.{name}"] = ckpt.get_slice(f"model.layers.{old}.{name}")[:]
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    config = {
        "architectures": [cfg.architecture],
        "model_type": "llama",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": len(layers),
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": cfg.rope_scaling,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "attention_bias": cfg.attention_bias,
        "eos_token_id": cfg.eos_token_id,
        "bos_token_id": cfg.bos_token_id,
        "torch_dtype": "float32",
        "source_layers": layers,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
