"""Building a draft from its target, and writing it as a draft-only checkpoint.

The draft is the target's architecture with fewer layers (each initialised from a chosen target layer),
the target's final norm (trainable), the target's embedding and LM head (shared; frozen by default) and
an optional DSpark Markov head of rank r (bias(prev) = W2 · W1[prev], W2 starting at zero so an untrained
head changes nothing). On disk the draft holds only the tensors that are its own; config.json names the
target for the rest (common/draft_checkpoint.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn

from common.config import DTYPES, ModelConfig
from common.distributed import Comm
from common.draft_checkpoint import LM_HEAD_ROWS_KEY, SHARED_WEIGHTS_KEY
from common.layers.shard import checkpoint_parts
from common.models.transformer import Transformer

SHARED_PREFIXES = ("model.embed_tokens.", "lm_head.")


def config_to_dict(cfg: ModelConfig) -> dict:
    """A Hugging Face-style config.json that ModelConfig.from_dict reads back to the same config."""
    raw = {k: v for k, v in dataclasses.asdict(cfg).items() if k not in ("architecture", "qk_norm", "name")}
    raw["architectures"] = [cfg.architecture]
    if raw["draft_vocab_size"] is None:
        del raw["draft_vocab_size"]
    return raw


def draft_config(target: ModelConfig, num_layers: int, markov_rank: int) -> ModelConfig:
    return dataclasses.replace(target, num_hidden_layers=num_layers, markov_rank=markov_rank, name="draft")


def is_shared(name: str) -> bool:
    return name.startswith(SHARED_PREFIXES)


def build_draft(
    target: Transformer,
    layer_map: list[int],
    markov_rank: int,
    seed: int,
    train_shared: bool = False,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A draft (float32 to train): draft layer i starts as target layer layer_map[i]; trainable parameters
    marked."""
    for i in layer_map:
        if not 0 <= i < target.config.num_hidden_layers:
            raise ValueError(
                f"--init-layers: {i} is not a layer of the target (0..{target.config.num_hidden_layers - 1})"
            )
    cfg = draft_config(target.config, len(layer_map), markov_rank)
    draft = Transformer(cfg, Comm(), dtype=dtype, device=device)
    src = {n: p for n, p in target.named_parameters()}
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.startswith("model.layers."):
                _, _, idx, rest = name.split(".", 3)
                param.copy_(src[f"model.layers.{layer_map[int(idx)]}.{rest}"])
            elif name.startswith("markov_head."):
                gen = torch.Generator().manual_seed(seed)
                if "markov_w1" in name:
                    param.copy_(torch.randn(param.shape, generator=gen) / markov_rank**0.5)
                else:
                    param.zero_()  # an untrained head adds nothing
            else:
                param.copy_(src[name])
            param.requires_grad_(train_shared or not is_shared(name))
    return draft


def own_tensors(model: nn.Module, include_shared: bool, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The draft's tensors to write, by checkpoint name and shape (vocab padding cut off), in `dtype`;
    merged qkv / gate_up parameters split back into the checkpoint's own q/k/v and gate/up tensors."""
    out = {}
    for param_name, param in model.named_parameters():
        for name, part in checkpoint_parts(param_name, param):
            if is_shared(name) and not include_shared:
                continue
            spec, t = part.shard, part.data.detach()
            if spec.dim is not None and t.shape[spec.dim] != spec.full_shape[spec.dim]:
                t = t.narrow(spec.dim, 0, spec.full_shape[spec.dim])
            out[name] = t.to(dtype if t.is_floating_point() else t.dtype).contiguous().cpu()
    return out


def target_reference(target_path: Path, out_dir: Path, given: str | None) -> str:
    """How the draft's config names its target: as given, else relative to the draft dir when possible."""
    if given:
        return given
    try:
        return os.path.relpath(target_path.resolve(), out_dir.resolve())
    except ValueError:  # another drive
        return str(target_path.resolve())


def save_draft(
    draft: Transformer,
    out_dir: Path,
    target_ref: str,
    save_dtype: str,
    include_shared: bool,
    extra: dict,
) -> int:
    """Writes config.json + model.safetensors (draft-only tensors unless include_shared); returns bytes."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = own_tensors(draft, include_shared, DTYPES[save_dtype])
    raw = config_to_dict(draft.config)
    raw["torch_dtype"] = save_dtype
    if not include_shared:
        shared = sorted({n for n, _ in draft.named_parameters() if is_shared(n)})
        raw[SHARED_WEIGHTS_KEY] = {"path": target_ref, "tensors": shared}
        if draft.d2t is not None and "lm_head.weight" in shared:
            raw[SHARED_WEIGHTS_KEY][LM_HEAD_ROWS_KEY] = "d2t"  # the target's head rows the draft keeps
    raw["draft_training"] = extra
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    save_file(tensors, str(out_dir / "model.safetensors"), metadata={"format": "pt"})
    return (out_dir / "model.safetensors").stat().st_size
