"""How long a service takes to load a GGUF: the file's metadata, its tensors (dequantized into the
serving dtype) and its tokenizer, on this machine's cores. `make test` prints it for the catalogue's
SmolLM2 and Qwen2.5-Coder-0.5B files (a benchmark line in the CI log, not an assertion):

    python bench/gguf_load.py MODEL_OR_PATH ... [--dtype float32] [--threads N]
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from common.config import DTYPES
from common.distributed import init_tp
from common.gguf import find_gguf, open_gguf
from common.loader import load_model
from common.tokenizer import load_tokenizer


def measure(model: str, dtype: str) -> str:
    path = find_gguf(model)  # a catalogue name is fetched first (not timed)
    if path is None:
        raise SystemExit(f"{model}: not a GGUF file or catalogue name")
    open_gguf.cache_clear()
    t0 = time.perf_counter()
    open_gguf(path)
    t1 = time.perf_counter()
    load_model(path, init_tp(1, 0), dtype=DTYPES[dtype])
    t2 = time.perf_counter()
    load_tokenizer(path)
    t3 = time.perf_counter()
    return (
        f"GGUF load: {path.name} ({path.stat().st_size / 1e6:.0f} MB) -> {dtype} in {t3 - t0:.1f} s "
        f"(metadata {t1 - t0:.1f} s, tensors {t2 - t1:.1f} s, tokenizer {t3 - t2:.1f} s; "
        f"{torch.get_num_threads()} threads)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", nargs="+", help="GGUF files or catalogue names (specsplit fetch)")
    ap.add_argument("--dtype", default="float32", choices=list(DTYPES))
    ap.add_argument("--threads", type=int, default=min(2, os.cpu_count() or 1), help="torch threads")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    for model in args.models:
        print(measure(model, args.dtype), flush=True)


if __name__ == "__main__":
    main()
