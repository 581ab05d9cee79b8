"""Llama-family GGUF checkpoints (llama.cpp's format): config, weights and tokenizer from one file.

The `gguf` library reads the file (GGUFReader) and dequantizes every supported quant type (its per-type
`dequantize_rows`); nothing here decodes blocks by hand. What this module adds is the mapping back to the
Hugging Face layout the rest of specsplit uses:

- architectures: `llama` and `qwen2` (GGUF_ARCHITECTURES); the config comes from `<arch>.*` metadata;
- tensor names: gguf's own HF -> GGUF name map (`gguf.get_tensor_name_map`), asked for each parameter
  name the model has, so `common.loader.load_param` slices each rank's share exactly as for safetensors;
- shapes: GGUF lists dims fastest-first (ggml order); reversed they are the HF [out, in] shapes;
- q/k rows: for `llama` (NORM rope) llama.cpp's converter permutes the rows of each head's q and k so
  that its rotary pairs adjacent dims; HF pairs dim i with i + head_dim/2. Undo it as transformers does
  (modeling_gguf_pytorch_utils.LlamaTensorProcessor). Skipping it is silent: the model answers EOS.
  NEOX-rope archs (`qwen2`) pair dims as HF does and are stored unpermuted;
- the head: no `output.weight` means the head is tied to `token_embd`; q/k/v biases when present;
- the tokenizer (gpt2-style byte-level BPE, with llama.cpp's pre-tokenizer split) and chat template
  come from the metadata.

Loading is the slow part of a service's start on CPU, so it is done once per tensor and in place:
`read_into` dequantizes only the rows a rank holds, a block of rows at a time on torch's thread count
(numpy releases the GIL), straight into the parameter in the serving dtype (no full-size fp32 copy),
from a memory map the reader parses as plain arrays (np.memmap's per-slice Python hook costs seconds
over a 150k-token vocabulary).
"""

from __future__ import annotations

import functools
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from common.config import ModelConfig


@dataclass(frozen=True)
class GGUFArch:
    """What a `general.architecture` shares with an HF architecture, and how llama.cpp stored it."""

    hf_architecture: str
    model_arch: str  # the gguf library's MODEL_ARCH member: its HF <-> GGUF tensor name map
    permuted_qk: bool  # NORM rope: llama.cpp permuted q/k rows; NEOX rope (qwen2) keeps HF's order


GGUF_ARCHITECTURES = {
    "llama": GGUFArch("LlamaForCausalLM", "LLAMA", permuted_qk=True),
    "qwen2": GGUFArch("Qwen2ForCausalLM", "QWEN2", permuted_qk=False),
}
# The tokenizer types we can rebuild with the `tokenizers` library.
GGUF_TOKENIZER_MODELS = ("gpt2",)
# llama.cpp pre-tokenizers that split every digit before the GPT-2 regex (llama-vocab.cpp groups these).
DIGIT_SPLIT_PRE = ("smollm", "starcoder", "refact", "codeshell", "exaone", "minerva", "command-r")
# llama.cpp pre-tokenizers with their own split regex (llama-vocab.cpp, LLAMA_VOCAB_PRE_TYPE_*), applied
# before the byte-level mapping. No normalizer: llama.cpp and transformers' GGUF tokenizer apply none
# (Qwen2's own tokenizer.json NFC-normalizes; a decomposed "é" tokenizes differently there).
PRE_TOKENIZER_SPLITS = {
    "qwen2": (
        r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
        r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
# Dequantize this many elements at a time: a block of rows stays in cache and the fp32 temporary small.
DEQUANT_BLOCK_ELEMENTS = 1 << 18


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
    a catalogue model's file (specsplit.catalog: fetched if not cached) for its name; None for a Hugging
    Face (safetensors) directory. Raises when a directory holds several .gguf files."""
    from specsplit.catalog import resolve_model

    path = resolve_model(path)
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
    """What `load_param` needs of a safetensors slice (the full shape; `[index]`: that part of the fp32
    tensor), plus `read_into(dst, index)`, which dequantizes straight into `dst` (common.gguf's docstring)."""

    def __init__(self, ckpt: GGUFCheckpoint, name: str):
        self._ckpt, self._name = ckpt, name

    def get_shape(self) -> tuple[int, ...]:
        return hf_shape(self._ckpt.tensors[self._name])

    def __getitem__(self, index) -> torch.Tensor:
        return self._ckpt.tensor(self._name)[index]

    def read_into(self, dst: torch.Tensor, index=slice(None)) -> None:
        self._ckpt.read_into(self._name, dst, index)


def hf_shape(t) -> tuple[int, ...]:
    """A reader tensor's shape in HF order (GGUF lists dims fastest-first)."""
    return tuple(int(d) for d in reversed(t.shape))


def _read(path: Path):
    """gguf.GGUFReader over plain ndarray views of a copy-on-write memory map: the same pages, without
    np.memmap's Python hook on every slice the reader takes (one per token string), and writable, so
    torch.from_numpy takes the dequantized F32 rows as they are."""
    import gguf

    class Reader(gguf.GGUFReader):
        @property
        def data(self) -> np.ndarray:
            return self._plain

        @data.setter
        def data(self, mapped: np.memmap) -> None:
            self._plain = mapped.view(np.ndarray)

    return Reader(path, mode="c")


def row_dequantizer(qtype):
    """rows of one tensor's data ([n, bytes] uint8 blocks, or F32/F16 values) -> fp32 [n, elements], by
    the gguf library's per-type code. Raises NotImplementedError for a type the library cannot decode."""
    import gguf

    if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
        return lambda rows: rows  # the reader already typed them; copy_ converts F16
    quant = getattr(gguf.quants, qtype.name, None)
    if quant is None or not hasattr(quant, "dequantize_rows"):
        raise NotImplementedError(qtype.name)
    quant.init_grid()  # the IQ types' lookup grids; a no-op for the others
    return quant.dequantize_rows


class GGUFCheckpoint:
    """One GGUF file: `config` (ModelConfig), `get_slice(hf_name)` for the loader, `metadata(key)`."""

    def __init__(self, path: str | Path):
        import gguf

        self.path = Path(path)
        try:
            self.reader = _read(self.path)
        except Exception as exc:  # the reader raises ValueError / struct / numpy errors on garbage
            raise ValueError(f"{self.path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from exc
        self.arch = self.metadata("general.architecture")
        if self.arch not in GGUF_ARCHITECTURES:
            raise ValueError(
                f"{self.path}: general.architecture={self.arch!r} is not supported "
                f"(supported: {', '.join(GGUF_ARCHITECTURES)})"
            )
        self.layout = GGUF_ARCHITECTURES[self.arch]
        self.tensors = {t.name: t for t in self.reader.tensors}
        if "rope_freqs.weight" in self.tensors:
            raise ValueError(
                f"{self.path}: tensor 'rope_freqs.weight' (llama3-style rope scaling) is not supported"
            )
        self._threads: ThreadPoolExecutor | None = None
        self.config = self._config()
        model_arch = gguf.MODEL_ARCH[self.layout.model_arch]
        self._names = gguf.get_tensor_name_map(model_arch, self.config.num_hidden_layers)
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
            "architectures": [self.layout.hf_architecture],
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
            try:  # one block of zeros tells whether the library implements this type
                type_size = gguf.GGML_QUANT_SIZES[qtype][1]
                row_dequantizer(qtype)(np.zeros((1, type_size), np.uint8))
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
        return _TensorSlice(self, name)

    def tensor(self, name: str) -> torch.Tensor:
        """The full fp32 tensor `name` in HF layout: dequantized, ggml dims reversed, q/k un-permuted."""
        out = torch.empty(hf_shape(self.tensors[name]), dtype=torch.float32)
        self.read_into(name, out)
        return out

    def read_into(self, name: str, dst: torch.Tensor, index=slice(None)) -> None:
        """dst <- tensor(name)[index] (`index`: step-1 slices of the leading dims), in dst's dtype:
        only the rows `index` selects are dequantized, DEQUANT_BLOCK_ELEMENTS at a time."""
        t = self.tensors[name]
        shape = hf_shape(t)
        index = index if isinstance(index, tuple) else (index,)
        dequantize = row_dequantizer(t.tensor_type)
        order = self._row_order(name, shape[0])
        if len(shape) == 1:  # norms and biases: small, one row
            full = torch.from_numpy(dequantize(t.data.reshape(1, -1))).view(-1)
            dst.copy_((full if order is None else full[order])[index])
            return
        rows = np.arange(shape[0])[index[0]]
        if order is not None:
            rows = order.numpy()[rows]
        data = t.data.reshape(shape[0], -1)
        cols = (slice(None), *index[1:])
        step = max(1, DEQUANT_BLOCK_ELEMENTS // (t.n_elements // shape[0]))

        def block(start: int) -> None:
            r = rows[start : start + step]
            quantized = data[r] if order is not None else data[r[0] : r[0] + len(r)]  # a view, not a copy
            values = torch.from_numpy(dequantize(quantized)).view(len(r), *shape[1:])
            dst[start : start + len(r)].copy_(values[cols])

        list(self._pool().map(block, range(0, len(rows), step)))  # numpy releases the GIL in each op

    def _pool(self) -> ThreadPoolExecutor:
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max(1, torch.get_num_threads()), "gguf-dequant")
        return self._threads

    def _row_order(self, name: str, rows: int) -> torch.Tensor | None:
        """For llama's permuted q/k (weights and biases): HF row i is GGUF row order[i]; else None."""
        if not self.layout.permuted_qk:
            return None
        if name.endswith(("attn_q.weight", "attn_q.bias")):
            return unpermute_rows(torch.arange(rows), self.config.num_attention_heads)
        if name.endswith(("attn_k.weight", "attn_k.bias")):
            return unpermute_rows(torch.arange(rows), self.config.num_key_value_heads)
        return None

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
        pre = self.metadata("tokenizer.ggml.pre", None)
        own_split = pre in PRE_TOKENIZER_SPLITS  # else GPT-2's regex, inside ByteLevel
        byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=not own_split)
        if own_split:
            split = pre_tokenizers.Split(Regex(PRE_TOKENIZER_SPLITS[pre]), behavior="isolated")
            tok.pre_tokenizer = pre_tokenizers.Sequence([split, byte_level])
        elif pre in DIGIT_SPLIT_PRE:
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
        "model_type": cfg.architecture.removesuffix("ForCausalLM").lower(),
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
