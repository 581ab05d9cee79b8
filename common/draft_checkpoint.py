"""Draft checkpoints that borrow tensors from their target: only the draft-only tensors are on disk.

A trained draft shares its target's tokenizer and embedding / LM head. Storing those again would cost as
much as the whole draft (SmolLM2-135M: 57 MB of bf16 embedding against 20 MB of draft layers), so the
draft's config.json names the target instead:

    "shared_weights": {"path": "<target>", "tensors": ["model.embed_tokens.weight"]}

`path` is a target checkpoint directory, a safetensors file, or a .gguf file; relative paths are relative
to the draft directory, `python-package:PKG/FILE` names a file inside an installed package (found
without importing it), and a catalogue name (`specsplit fetch`) the file fetched for it. The loader reads
the listed tensors from there and everything else from the draft.

A draft with a reduced vocabulary (`draft_vocab_size`, a d2t table of its own) adds `"lm_head_rows":
"d2t"`: its `lm_head.weight` is the target's LM head (the embedding of a tied target) restricted to the
rows d2t names, draft id i -> target id i + d2t[i], gathered at load.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import torch

from specsplit.catalog import CATALOG, resolve_model

SHARED_WEIGHTS_KEY = "shared_weights"
LM_HEAD_ROWS_KEY = "lm_head_rows"
PACKAGE_PREFIX = "python-package:"


def shared_weights_spec(path: Path) -> dict[str, Any] | None:
    """The draft's `shared_weights` entry (validated), or None for a self-contained checkpoint."""
    config_file = path / "config.json"
    if not config_file.is_file():  # a GGUF file, or a directory holding one, is always self-contained
        return None
    spec = json.loads(config_file.read_text()).get(SHARED_WEIGHTS_KEY)
    if spec is None:
        return None
    if not isinstance(spec, dict) or not isinstance(spec.get("path"), str):
        raise ValueError(f"{config_file}: '{SHARED_WEIGHTS_KEY}.path' must be a string")
    tensors = spec.get("tensors")
    if not isinstance(tensors, list) or not all(isinstance(t, str) for t in tensors):
        raise ValueError(f"{config_file}: '{SHARED_WEIGHTS_KEY}.tensors' must be a list of tensor names")
    if spec.get(LM_HEAD_ROWS_KEY, "d2t") != "d2t":
        raise ValueError(
            f"{config_file}: '{SHARED_WEIGHTS_KEY}.{LM_HEAD_ROWS_KEY}' must be \"d2t\" (the draft's own "
            f"table of the target rows it keeps), got {spec[LM_HEAD_ROWS_KEY]!r}"
        )
    return spec


def resolve_target_path(draft_dir: Path, where: str) -> Path:
    """`where` from the config -> an existing path; the error names the config field and what was tried."""
    if where.startswith(PACKAGE_PREFIX):
        package, _, rel = where[len(PACKAGE_PREFIX) :].partition("/")
        spec = importlib.util.find_spec(package)  # locates the package without importing it
        locations = list(spec.submodule_search_locations or []) if spec else []
        for loc in locations:
            if (Path(loc) / rel).exists():
                return Path(loc) / rel
        raise FileNotFoundError(
            f"{draft_dir}/config.json: {SHARED_WEIGHTS_KEY}.path={where!r}: "
            f"{'package ' + package + ' is not installed' if not locations else rel + ' not found in it'}"
        )
    found = Path(where).expanduser()
    if not found.is_absolute():
        found = draft_dir / found
    if not found.exists() and where in CATALOG:  # a catalogue name: its file, fetched if not cached
        return resolve_model(where)
    if not found.exists():
        raise FileNotFoundError(
            f"{draft_dir}/config.json: {SHARED_WEIGHTS_KEY}.path={where!r}: {found} does not exist"
        )
    return found


class SafetensorsFile:
    """One .safetensors file with the `get_slice` interface of the loader's CheckpointFiles."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self.path = path
        self._f = safe_open(str(path), framework="pt", device="cpu")

    def get_slice(self, name: str):
        if name not in self._f.keys():
            raise ValueError(f"{self.path}: checkpoint is missing tensor '{name}'")
        return self._f.get_slice(name)


class HeadRows:
    """The target's LM head restricted to the rows a reduced-vocab draft keeps, as a checkpoint slice
    (`get_shape`, `[index]`); the rows are gathered once, on first read."""

    def __init__(self, own, target):
        self.path = own.path
        d2t = own.get_slice("d2t")[:].to(torch.int64)
        self.rows = torch.arange(len(d2t)) + d2t
        try:
            self.head = target.get_slice("lm_head.weight")
        except (KeyError, ValueError):  # a tied target: its embedding is its head
            self.head = target.get_slice("model.embed_tokens.weight")
        vocab = self.head.get_shape()[0]
        if len(self.rows) and not (0 <= int(self.rows.min()) and int(self.rows.max()) < vocab):
            raise ValueError(
                f"{self.path}: tensor 'd2t' maps draft ids to target ids outside 0..{vocab - 1} "
                f"(the target's LM head rows)"
            )
        self._full: torch.Tensor | None = None

    def get_shape(self) -> tuple[int, ...]:
        return (len(self.rows), *self.head.get_shape()[1:])

    def __getitem__(self, index) -> torch.Tensor:
        if self._full is None:
            self._full = self.head[:][self.rows]
        return self._full[index]


class SharedCheckpointFiles:
    """The draft's own files, plus `tensors` served from the target's checkpoint (and the LM head's kept
    rows, for a reduced-vocab draft)."""

    def __init__(self, own, target, shared: list[str], head_rows: bool = False):
        self.own = own
        self.target = target
        self.shared = set(shared)
        self.path = own.path
        self.head_rows = HeadRows(own, target) if head_rows else None

    def get_slice(self, name: str):
        if name == "lm_head.weight" and self.head_rows is not None:
            return self.head_rows
        return (self.target if name in self.shared else self.own).get_slice(name)


def open_target(path: Path, checkpoint_files_cls):
    """A target checkpoint (directory, .safetensors or .gguf) -> an object with get_slice(name)."""
    from common.gguf import find_gguf, open_gguf

    gguf_file = find_gguf(path)
    if gguf_file is not None:
        return open_gguf(gguf_file)
    if path.is_file():
        return SafetensorsFile(path)
    return checkpoint_files_cls(path)


def with_shared_weights(path: Path, own, checkpoint_files_cls=None):
    """The loader's hook: `own` unchanged for a self-contained checkpoint, else own + target tensors."""
    spec = shared_weights_spec(path)
    if spec is None:
        return own
    target = open_target(resolve_target_path(path, spec["path"]), checkpoint_files_cls or type(own))
    return SharedCheckpointFiles(own, target, spec["tensors"], LM_HEAD_ROWS_KEY in spec)
