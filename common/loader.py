"""Loads a Hugging Face-format checkpoint directory (or a GGUF file, common.gguf) into a TP `Transformer`.

Each parameter knows which slice of the full checkpoint tensor its rank holds (`param.shard`), and only
that slice is read (safe_open + get_slice), so no rank ever materialises a full copy of a sharded weight.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from common.config import DTYPES, ModelConfig
from common.distributed import Comm
from common.draft_checkpoint import with_shared_weights
from common.gguf import GGUFCheckpoint, find_gguf, open_gguf
from common.kernels import onednn
from common.layers.linear import LINEAR_LAYERS
from common.layers.shard import checkpoint_parts
from common.models.feature_draft import FeatureDraft
from common.models.transformer import Transformer
from common.tokenizer import Tokenizer, load_tokenizer
from common.tp_executor import rank_device

__all__ = ["Tokenizer", "check_local_argmax", "load_model", "load_tokenizer"]

log = logging.getLogger("specsplit")

DRAFT_SAMPLING_MODES = ("greedy", "sampled")
PROGRESS_EVERY_S = 2.0  # a progress line in the log while a model loads


class CheckpointFiles:
    """Tensor name -> safetensors file, from model.safetensors.index.json or by scanning *.safetensors."""

    def __init__(self, path: Path):
        self.path = path
        self._handles: dict[Path, object] = {}
        index = path / "model.safetensors.index.json"
        if index.is_file():
            with open(index) as f:
                self.where = {name: path / file for name, file in json.load(f)["weight_map"].items()}
        else:
            files = sorted(path.glob("*.safetensors"))
            if not files:
                raise FileNotFoundError(f"{path}: no *.safetensors files and no model.safetensors.index.json")
            self.where = {}
            for file in files:
                for name in self._open(file).keys():
                    self.where[name] = file

    def _open(self, file: Path):
        if file not in self._handles:
            if not file.is_file():
                raise FileNotFoundError(f"{self.path}: index names {file.name}, which does not exist")
            self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
        return self._handles[file]

    def get_slice(self, name: str):
        if name not in self.where:
            raise ValueError(f"{self.path}: checkpoint is missing tensor '{name}'")
        return self._open(self.where[name]).get_slice(name)


def open_checkpoint(path: Path) -> tuple[ModelConfig, CheckpointFiles | GGUFCheckpoint]:
    """(config, tensor source) for a Hugging Face directory or a GGUF file (or a directory holding one);
    both sources hand out per-tensor slices by HF parameter name."""
    gguf_file = find_gguf(path)
    if gguf_file is not None:
        ckpt = open_gguf(gguf_file)
        return ckpt.config, ckpt
    return ModelConfig.from_pretrained(path), CheckpointFiles(path)


def load_param(files: CheckpointFiles | GGUFCheckpoint, name: str, param: nn.Parameter) -> None:
    spec = param.shard
    sl = files.get_slice(name)
    found = tuple(sl.get_shape())
    if found != spec.full_shape:
        raise ValueError(f"{files.path}: tensor '{name}' has shape {found}, expected {spec.full_shape}")
    if spec.dim is None:
        _copy_slice(sl, slice(None), param.data)
        return
    end = min(spec.start + spec.size, found[spec.dim])
    rows = max(0, end - spec.start)
    if rows < spec.size:
        param.data.zero_()  # vocab padding
    if rows:
        index = [slice(None)] * len(found)
        index[spec.dim] = slice(spec.start, end)
        _copy_slice(sl, tuple(index), param.data.narrow(spec.dim, 0, rows))


def _copy_slice(sl, index, dst: torch.Tensor) -> None:
    """dst <- sl[index]; a GGUF slice dequantizes straight into dst (no full-size fp32 temporary)."""
    if hasattr(sl, "read_into"):
        sl.read_into(dst, index)
    else:
        dst.copy_(sl[index])


def check_draft_sampling(use_local_argmax_reduction: bool, draft_sampling: str) -> None:
    """Local argmax yields only the top id: it cannot serve probabilistic drafting."""
    if draft_sampling not in DRAFT_SAMPLING_MODES:
        raise ValueError(f"draft_sampling={draft_sampling!r}: expected one of {DRAFT_SAMPLING_MODES}")
    if use_local_argmax_reduction and draft_sampling != "greedy":
        raise ValueError(
            "use_local_argmax_reduction=True is incompatible with draft_sampling='sampled': "
            "probabilistic drafting needs the full vocab distribution, local argmax only yields the top id"
        )


def check_local_argmax(model: nn.Module, use_local_argmax_reduction: bool, draft_sampling: str) -> None:
    """The local-argmax switch needs greedy drafting and a model that can reduce locally."""
    check_draft_sampling(use_local_argmax_reduction, draft_sampling)
    if use_local_argmax_reduction and not callable(getattr(model, "get_top_tokens", None)):
        raise ValueError(
            f"use_local_argmax_reduction=True: draft model {type(model).__name__} has no get_top_tokens()"
        )


def load_service_model(config, comm: Comm, **kwargs) -> tuple[torch.device, Transformer]:
    """A service's model (`config`: a ServiceConfig) on this rank's device in its dtype, progress logged
    by rank 0 only: (device, model). kwargs go to load_model (the draft's head and argmax modes)."""
    device = rank_device(config.device, comm.rank)
    progress = comm.rank == 0
    dtype = DTYPES[config.dtype]
    return device, load_model(config.model, comm, device=device, dtype=dtype, progress=progress, **kwargs)


def load_model(
    path: str | Path,
    comm: Comm,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    markov_head_mode: str = "replicated",
    use_local_argmax_reduction: bool = False,
    draft_sampling: str = "greedy",
    progress: bool = False,
    replicate_lm_head: bool = False,
) -> Transformer:
    """Builds the model for `comm.rank` and reads only that rank's slices of the checkpoint.

    markov_head_mode: "replicated" (no collective) or "sharded" (the all_reduce + gather baseline).
    replicate_lm_head: keep the whole LM head on every rank (disable_tp); no gather for its logits.
    """
    path = Path(path)
    if draft_sampling not in DRAFT_SAMPLING_MODES or (
        use_local_argmax_reduction and draft_sampling != "greedy"
    ):
        check_local_argmax(
            nn.Module(), use_local_argmax_reduction, draft_sampling
        )  # fail before reading weights
    config, files = open_checkpoint(path)
    model_class = FeatureDraft if config.feature_layers else Transformer
    model = model_class(config, comm, markov_head_mode, replicate_lm_head, dtype, device)
    # A trained draft stores only its own tensors and reads the shared ones from its target.
    files = with_shared_weights(path, files)
    params = list(model.named_parameters())
    total = sum(p.numel() * p.element_size() for _, p in params) / 2**20
    done = 0.0
    t0 = shown = time.perf_counter()
    for i, (name, param) in enumerate(params):
        for part_name, part in checkpoint_parts(name, param):  # merged qkv / gate_up: one per part
            load_param(files, part_name, part)
        done += param.numel() * param.element_size() / 2**20
        if progress and time.perf_counter() - shown >= PROGRESS_EVERY_S:
            shown = time.perf_counter()
            log.info("loading %s: %d/%d tensors, %.0f/%.0f MiB, %.1f s", path.name, i + 1, len(params), done,
                     total, shown - t0)  # fmt: skip
    log.info("loaded %s: %d tensors, %.0f MiB %s on %s in %.1f s", path.name, len(params), total,
             str(dtype).removeprefix("torch."), device, time.perf_counter() - t0)  # fmt: skip
    check_local_argmax(model, use_local_argmax_reduction, draft_sampling)
    model.use_local_argmax_reduction = use_local_argmax_reduction
    if model.lm_head.weight.device.type == "cpu":
        layers = [m for m in model.modules() if isinstance(m, LINEAR_LAYERS)]
        onednn.pack_modules([*layers, model.lm_head])  # fp32 only; the embedding table is never packed
    return model.eval()
