"""The draft service's one config object (flags and SPECSPLIT_* env vars, see common.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import flag


@dataclass
class DraftConfig:
    model: str = flag("", "draft checkpoint directory (Hugging Face layout)")
    tp_size: int = flag(1, "tensor-parallel ranks for the draft model")
    device: str = flag("cpu", "cpu or cuda")
    dtype: str = flag("float32", "weights and activations dtype", ("float32", "bfloat16", "float16"))
    host: str = flag("0.0.0.0", "gRPC bind address")
    port: int = flag(50052, "gRPC port (0 = pick a free one)")
    metrics_port: int = flag(9401, "Prometheus /metrics port (0 = pick a free one, -1 = off)")
    draft_sampling: str = flag(
        "greedy", "greedy drafting, or sampled from the draft's top-K", ("greedy", "sampled")
    )
    use_local_argmax_reduction: bool = flag(
        True, "greedy drafting reduces argmax per vocab shard (no logit gather)"
    )
    markov_head_mode: str = flag(
        "replicated", "Markov head weights on every rank or sharded", ("replicated", "sharded")
    )
    max_speculative_tokens: int = flag(8, "largest k a target may ask for")
    sampled_top_k: int = flag(16, "K of the truncated draft distribution sent with sampled drafting")
    max_batch_size: int = flag(64, "draft KV slots (concurrent requests over all targets)")
    max_context_length: int = flag(4096, "longest sequence a request may reach")
    cuda_graphs: bool = flag(True, "replay greedy draft steps from CUDA graphs (per batch/context bucket)")
    draft_ahead: bool = flag(True, "draft round r+1 while the target verifies round r")
    grpc_workers: int = flag(16, "gRPC server threads")
    auth_token_file: str = flag("", "file holding a bearer token every call must carry")
    tls_cert: str = flag("", "server certificate (PEM) for TLS")
    tls_key: str = flag("", "server private key (PEM) for TLS")
    tls_client_ca: str = flag("", "CA (PEM) for client certificates: turns on mTLS")
    log_format: str = flag("text", "log lines as text or JSON", ("text", "json"))
    log_level: str = flag("INFO", "logging level")

    def validate(self) -> None:
        if not self.model:
            raise ValueError("--model: a draft checkpoint directory is required")
        if self.tp_size < 1:
            raise ValueError("--tp-size: must be >= 1")
        if not 1 <= self.max_speculative_tokens <= 64:
            raise ValueError("--max-speculative-tokens: must be in [1, 64]")
        if self.sampled_top_k < 1:
            raise ValueError("--sampled-top-k: must be >= 1")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size: must be >= 1")

    @property
    def method(self) -> str:
        if self.draft_sampling == "sampled":
            return "sampled-topk"
        return "greedy-local-argmax" if self.use_local_argmax_reduction else "greedy"
