"""Writes tiny random checkpoints in Hugging Face layout (config.json + safetensors), deterministic per seed:
`specsplit make-tiny-model`, the models of `specsplit demo --tiny` and of the benches. The tests' fixture
(tests/tiny.py) adds the model features they switch on by name (`config`).

Scales are chosen so the models behave like language models in the ways tests care about: every layer
moves the residual stream (outputs depend on context, greedy continuations vary) and logits have a
spread of a few units, so top-2 margins are almost always far above fp32 noise.

A draft can be built from a base (`base`, `share_layers`): it copies the base's embeddings, final norm,
LM head and first layers, so its greedy guesses agree with the base often but not always.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from common.config import DTYPES

MODEL_TYPES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "Qwen3ForCausalLM": "qwen3"}


def _tensor_shapes(cfg: dict) -> dict[str, tuple[tuple[int, ...], float]]:
    """Checkpoint tensor name -> (shape, init std). Norm weights are marked with -(their mean)."""
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg["head_dim"]
    nh, nkv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    head_vocab = cfg.get("draft_vocab_size") or vocab
    tied = cfg["tie_word_embeddings"]
    shapes: dict[str, tuple[tuple[int, ...], float]] = {
        "model.embed_tokens.weight": ((vocab, h), 1.6 / math.sqrt(h) if tied else 1.0),
        "model.norm.weight": ((h,), -2.0 if tied else -1.0),
    }
    if not tied:
        shapes["lm_head.weight"] = ((head_vocab, h), 3.0 / math.sqrt(h))
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes[p + "input_layernorm.weight"] = ((h,), -1.0)
        shapes[p + "post_attention_layernorm.weight"] = ((h,), -1.0)
        for name, out in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            shapes[p + f"self_attn.{name}.weight"] = ((out, h), 1.0 / math.sqrt(h))
            if cfg.get("attention_bias"):
                shapes[p + f"self_attn.{name}.bias"] = ((out,), 0.1)
        shapes[p + "self_attn.o_proj.weight"] = ((h, nh * hd), 4.0 / math.sqrt(nh * hd))
        if cfg["architectures"][0] == "Qwen3ForCausalLM":
            shapes[p + "self_attn.q_norm.weight"] = ((hd,), -1.0)
            shapes[p + "self_attn.k_norm.weight"] = ((hd,), -1.0)
        shapes[p + "mlp.gate_proj.weight"] = ((inter, h), 1.0 / math.sqrt(h))
        shapes[p + "mlp.up_proj.weight"] = ((inter, h), 1.0 / math.sqrt(h))
        shapes[p + "mlp.down_proj.weight"] = ((h, inter), 4.0 / math.sqrt(inter))
    r = cfg.get("markov_rank", 0)
    if r:
        shapes["markov_head.markov_w1.weight"] = ((vocab, r), 1.0)
        shapes["markov_head.markov_w2.weight"] = ((head_vocab, r), 1.0 / math.sqrt(r))
    return shapes


def _random_tensors(cfg: dict, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for name, (shape, std) in _tensor_shapes(cfg).items():
        if std < 0:  # norm weight near -std, not exactly, so a missed load shows
            out[name] = -std * (1.0 + 0.1 * torch.randn(shape, generator=gen))
        else:
            out[name] = std * torch.randn(shape, generator=gen)
    return out


def _read_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as f:
            for name in f.keys():
                tensors[name] = f.get_tensor(name)
    return tensors


def _write_checkpoint(path: Path, tensors: dict[str, torch.Tensor], num_shards: int) -> None:
    if num_shards <= 1:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    names = list(tensors)
    weight_map = {}
    for shard in range(num_shards):
        file = f"model-{shard + 1:05d}-of-{num_shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[shard::num_shards]}
        save_file(part, str(path / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(part, file))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_tiny_model(
    path: str | Path,
    *,
    seed: int = 0,
    vocab_size: int = 512,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    architecture: str = "Qwen3ForCausalLM",
    tie_word_embeddings: bool = True,
    markov_rank: int = 0,
    base: str | Path | None = None,
    share_layers: int = 0,
    max_position_embeddings: int = 2048,
    draft_vocab_size: int | None = None,
    num_shards: int = 1,
    dtype: str = "float32",
    late_layer_scale: float = 1.0,
    late_layers_from: int = 0,
    tokenizer: bool = True,
    config: dict | None = None,
) -> Path:
    """Writes config.json + model.safetensors (or `num_shards` files and an index) and returns the dir.

    With `base`, the shapes come from the base config and the draft copies the base's embeddings, final
    norm, LM head (rows of the draft vocab when `draft_vocab_size` is set) and first `share_layers` layers.
    `config`: config.json entries over the defaults (head_dim, rope_theta, rope_scaling,
    final_logit_softcapping, logit_scale, eos_token_id, ...), before the tensors are shaped.
    """
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    base_cfg = json.loads((Path(base) / "config.json").read_text()) if base is not None else None
    head_dim, rope_theta, rope_scaling = None, 10000.0, None
    if base_cfg is not None:
        vocab_size, hidden_size = base_cfg["vocab_size"], base_cfg["hidden_size"]
        num_heads, num_kv_heads = base_cfg["num_attention_heads"], base_cfg["num_key_value_heads"]
        intermediate_size, head_dim = base_cfg["intermediate_size"], base_cfg["head_dim"]
        architecture, rope_theta = base_cfg["architectures"][0], base_cfg["rope_theta"]
        rope_scaling, max_position_embeddings = base_cfg["rope_scaling"], base_cfg["max_position_embeddings"]
        if share_layers > min(num_layers, base_cfg["num_hidden_layers"]):
            raise ValueError(f"share_layers={share_layers} exceeds the draft's or the base's layer count")
    if architecture not in MODEL_TYPES:
        raise ValueError(f"architecture={architecture!r}: expected one of {list(MODEL_TYPES)}")
    if draft_vocab_size == vocab_size:
        draft_vocab_size = None
    if draft_vocab_size is not None:
        tie_word_embeddings = False  # a draft-vocab head cannot share the full-vocab embedding
    cfg = {
        "architectures": [architecture],
        "model_type": MODEL_TYPES[architecture],
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": intermediate_size,
        "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads,
        "num_key_value_heads": num_kv_heads,
        "head_dim": head_dim or hidden_size // num_heads,
        "rms_norm_eps": 1e-6,
        "rope_theta": rope_theta,
        "rope_scaling": rope_scaling,
        "max_position_embeddings": max_position_embeddings,
        "tie_word_embeddings": tie_word_embeddings,
        "attention_bias": architecture == "Qwen2ForCausalLM",
        "torch_dtype": dtype,
        "bos_token_id": None,
        "eos_token_id": None,
        "final_logit_softcapping": None,
        "logit_scale": 1.0,
        "markov_rank": markov_rank,
        **(config or {}),
    }
    if draft_vocab_size is not None:
        cfg["draft_vocab_size"] = draft_vocab_size
    # A draft's own layers must differ from its base's even when both use the default seed.
    tensors = _random_tensors(cfg, seed if base is None else seed + 1_000_003)
    # Layers from `late_layers_from` on write `late_layer_scale` times smaller updates into the residual
    # stream: a draft made of the first layers then agrees with the target often (demos, tests).
    for i in range(late_layers_from, num_layers if late_layer_scale != 1.0 else 0):
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):
            tensors[f"model.layers.{i}.{name}"] *= late_layer_scale
    gen = torch.Generator().manual_seed(seed + 1)
    draft_ids = None
    if draft_vocab_size is not None:
        draft_ids = torch.randperm(vocab_size, generator=gen)[:draft_vocab_size].sort().values
        tensors["d2t"] = draft_ids - torch.arange(draft_vocab_size)
    if base_cfg is not None:
        _copy_from_base(tensors, _read_checkpoint(Path(base)), base_cfg, share_layers, draft_ids)
    tensors = {
        n: t.to(DTYPES[dtype]).contiguous() if t.is_floating_point() else t for n, t in tensors.items()
    }
    (path / "config.json").write_text(json.dumps(cfg, indent=2))
    _write_checkpoint(path, tensors, num_shards)
    if tokenizer:
        write_tokenizer(path, vocab_size)
    return path


_CORPUS = """\
Speculative decoding lets a small draft model propose several tokens that a large target model
then checks in a single forward pass. When the draft guesses well, the target emits many tokens per
step; when it guesses badly, the target still emits one token, exactly the one it would have chosen
alone. The output distribution never changes: greedy decoding gives the same tokens, and sampling
keeps the same distribution, because every draft token is accepted with probability min(1, p / q)
and a rejected position is resampled from the residual max(p - q, 0). Tensor parallel groups split
each weight matrix across GPUs; the draft service and the target service each own a group and talk
over gRPC streams. Metrics such as time per output token, acceptance rate and bytes moved per draft
token show whether the system is healthy. A quick brown fox jumps over the lazy dog, and the dog
sleeps in the warm afternoon sun while the engineers watch their dashboards and drink coffee.
"""


def write_tokenizer(path: Path, vocab_size: int) -> None:
    """A byte-level BPE `tokenizer.json` trained on a fixed English paragraph (deterministic), so tiny
    models produce readable subword text. Without it, the loader falls back to raw bytes."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=["<|endoftext|>"], show_progress=False
    )
    tok.train_from_iterator([_CORPUS] * 4, trainer)
    tok.save(str(path / "tokenizer.json"))


def _copy_from_base(tensors, base_tensors, base_cfg, share_layers: int, draft_ids) -> None:
    tensors["model.embed_tokens.weight"] = base_tensors["model.embed_tokens.weight"].float()
    tensors["model.norm.weight"] = base_tensors["model.norm.weight"].float()
    base_head = base_tensors.get("lm_head.weight", base_tensors["model.embed_tokens.weight"]).float()
    if "lm_head.weight" in tensors:
        tensors["lm_head.weight"] = base_head if draft_ids is None else base_head[draft_ids]
    for i in range(share_layers):
        prefix = f"model.layers.{i}."
        for name, t in base_tensors.items():
            if name.startswith(prefix):
                tensors[name] = t.float()


def make_model_pair(
    target: Path,
    draft: Path,
    *,
    draft_layers: int,
    target_layers: int,
    late_layer_scale: float,
    markov_rank: int = 0,
    **shape,
) -> tuple[Path, Path]:
    """A target and a draft made of its first `draft_layers` layers (plus its embeddings and head), each
    written once. The target's later layers are damped by `late_layer_scale` so that the draft agrees
    with it often: random weights have no language for a draft to learn."""
    if not (target / "config.json").exists():
        make_tiny_model(target, seed=0, num_layers=target_layers, late_layer_scale=late_layer_scale,
                        late_layers_from=draft_layers, **shape)  # fmt: skip
    if not (draft / "config.json").exists():
        make_tiny_model(draft, seed=1, num_layers=draft_layers, base=target, share_layers=draft_layers,
                        markov_rank=markov_rank, **shape)  # fmt: skip
    return target, draft


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="specsplit make-tiny-model", description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path, help="output directory")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab-size", type=int, default=512)
    ap.add_argument("--hidden-size", type=int, default=64)
    ap.add_argument("--num-layers", type=int, default=2)
    ap.add_argument("--num-heads", type=int, default=4)
    ap.add_argument("--num-kv-heads", type=int, default=2)
    ap.add_argument("--intermediate-size", type=int, default=128)
    ap.add_argument("--architecture", default="Qwen3ForCausalLM", choices=list(MODEL_TYPES))
    ap.add_argument("--untied", action="store_true", help="separate lm_head.weight")
    ap.add_argument("--markov-rank", type=int, default=0, help="add a Markov head of this rank")
    ap.add_argument("--draft-vocab-size", type=int, default=None, help="LM head over a subset (d2t table)")
    ap.add_argument("--base", type=Path, default=None, help="build a draft sharing weights with this model")
    ap.add_argument("--share-layers", type=int, default=0)
    ap.add_argument("--num-shards", type=int, default=1, help="safetensors files (>1 writes an index)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--late-layer-scale", type=float, default=1.0, help="scale o_proj / down_proj of ...")
    ap.add_argument("--no-tokenizer", action="store_true", help="no tokenizer.json (byte-level fallback)")
    ap.add_argument("--late-layers-from", type=int, default=0, help="... the layers from this index on")
    a = ap.parse_args(argv)
    out = make_tiny_model(
        a.out,
        seed=a.seed,
        vocab_size=a.vocab_size,
        hidden_size=a.hidden_size,
        num_layers=a.num_layers,
        num_heads=a.num_heads,
        num_kv_heads=a.num_kv_heads,
        intermediate_size=a.intermediate_size,
        architecture=a.architecture,
        tie_word_embeddings=not a.untied,
        markov_rank=a.markov_rank,
        draft_vocab_size=a.draft_vocab_size,
        base=a.base,
        share_layers=a.share_layers,
        num_shards=a.num_shards,
        dtype=a.dtype,
        late_layer_scale=a.late_layer_scale,
        late_layers_from=a.late_layers_from,
        tokenizer=not a.no_tokenizer,
    )
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
