"""Service configuration: one dataclass per service, exposed as flags and env vars.

Each dataclass field becomes a flag `--field-name` and an environment variable
`SPECSPLIT_FIELD_NAME` (for containers); a flag beats the environment, which beats
the default. Help text lives in the field's metadata, so flags, env vars and docs
come from one place.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing
from dataclasses import dataclass
from typing import Any, TypeVar

T = TypeVar("T")

ENV_PREFIX = "SPECSPLIT_"


def flag(default: Any, help: str, choices: tuple[str, ...] | None = None) -> Any:
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices})


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def _base_type(tp: Any) -> type:
    if isinstance(tp, types.UnionType) or typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return args[0]
    return tp


def _parse_bool(text: str) -> bool:
    lowered = text.strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def build_parser(cls: type, prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        tp = _base_type(hints[field.name])
        name = "--" + field.name.replace("_", "-")
        help_text = (
            f"{field.metadata.get('help', '')} [env {env_name(field.name)}; default {field.default!r}]"
        )
        if tp is bool:
            parser.add_argument(
                name, dest=field.name, action=argparse.BooleanOptionalAction, default=None, help=help_text
            )
        else:
            parser.add_argument(
                name,
                dest=field.name,
                type=tp,
                default=None,
                choices=field.metadata.get("choices"),
                help=help_text,
            )
    return parser


def parse_config(
    cls: type[T], argv: list[str] | None, prog: str, description: str = "", env: bool = True
) -> T:
    """Flags, then SPECSPLIT_* environment variables (unless `env` is False: a second service's flags
    inside another's process must not pick up the first one's), then defaults. Errors name the flag."""
    parser = build_parser(cls, prog, description)
    args = vars(parser.parse_args(argv))
    hints = typing.get_type_hints(cls)
    values: dict[str, Any] = {}
    for field in dataclasses.fields(cls):
        value = args[field.name]
        if value is None and env and env_name(field.name) in os.environ:
            raw = os.environ[env_name(field.name)]
            tp = _base_type(hints[field.name])
            try:
                value = _parse_bool(raw) if tp is bool else tp(raw)
            except ValueError as exc:
                parser.error(f"{env_name(field.name)}: {exc}")
            choices = field.metadata.get("choices")
            if choices and value not in choices:
                parser.error(f"{env_name(field.name)}: {value!r} is not one of {', '.join(choices)}")
        if value is not None:
            values[field.name] = value
    config = cls(**values)
    validate = getattr(config, "validate", None)
    if validate is not None:
        try:
            validate()
        except ValueError as exc:
            parser.error(str(exc))
    return config


@dataclass
class ServiceConfig:
    """Flags both services share; each service's config extends it (and may change a default)."""

    model: str = flag(
        "",
        "checkpoint: a Hugging Face directory, a .gguf file or a directory holding one, or a "
        "catalogue name (`specsplit fetch --help`)",
    )
    tp_size: int = flag(1, "tensor-parallel ranks for the model")
    device: str = flag("cpu", "cpu or cuda")
    dtype: str = flag("float32", "weights and activations dtype", ("float32", "bfloat16", "float16"))
    host: str = flag("0.0.0.0", "gRPC bind address")
    port: int = flag(50051, "gRPC port (0 = pick a free one)")
    metrics_port: int = flag(9400, "Prometheus /metrics port (0 = pick a free one, -1 = off)")
    health_port: int = flag(
        -1,
        "plaintext port serving only grpc.health.v1, for kubelet probes under TLS (0 = free one, -1 = off)",
    )
    served_model_name: str = flag(
        "", "name in the `model` metric label and GetModelInfo (default: checkpoint name)"
    )
    max_batch_size: int = flag(32, "concurrent requests (= KV slots)")
    max_context_length: int = flag(4096, "longest sequence a request may reach (capped by the model's)")
    cuda_graphs: bool = flag(
        True, "replay decode steps from CUDA graphs (one per batch/width/context bucket)"
    )
    grpc_workers: int = flag(64, "gRPC server threads")
    auth_token_file: str = flag("", "file holding a bearer token every call must carry")
    tls_cert: str = flag("", "server certificate (PEM) for TLS")
    tls_key: str = flag("", "server private key (PEM) for TLS")
    tls_client_ca: str = flag("", "CA (PEM) for client certificates: turns on mTLS")
    tls_reload_interval: float = flag(
        10.0,
        "seconds between checks of the TLS files for a renewal (new connections also check at their "
        "handshake); 0 = only at handshakes",
    )
    log_format: str = flag("text", "log lines as text or JSON", ("text", "json"))
    log_level: str = flag("INFO", "logging level")
    switch_interval: float = flag(
        0.0005,
        "Python's GIL switch interval in seconds: how long a busy thread may hold up one that has work "
        "(a message that arrived, a reply to send); Python's default is 0.005",
    )

    def validate(self) -> None:
        if not self.model:
            raise ValueError("--model: a checkpoint directory or .gguf file is required")
        if self.tp_size < 1:
            raise ValueError("--tp-size: must be >= 1")
        if not 1e-6 <= self.switch_interval <= 0.1:
            raise ValueError("--switch-interval: must be in [1e-6, 0.1] seconds")
        if self.tls_reload_interval < 0:
            raise ValueError("--tls-reload-interval: must be >= 0 seconds")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size: must be >= 1")
        if self.max_context_length < 2:
            raise ValueError("--max-context-length: must be >= 2")
        if self.device not in ("cpu", "cuda") and not self.device.startswith("cuda:"):
            raise ValueError(f"--device: expected cpu or cuda, got {self.device!r}")
