"""The target service's one config object (flags and SPECSPLIT_* env vars, see common.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import flag


@dataclass
class TargetConfig:
    model: str = flag("", "target checkpoint directory (Hugging Face layout)")
    tp_size: int = flag(1, "tensor-parallel ranks for the target model")
    device: str = flag("cpu", "cpu or cuda")
    dtype: str = flag("float32", "weights and activations dtype", ("float32", "bfloat16", "float16"))
    host: str = flag("0.0.0.0", "gRPC bind address")
    port: int = flag(50051, "gRPC port (0 = pick a free one)")
    metrics_port: int = flag(9400, "Prometheus /metrics port (0 = pick a free one, -1 = off)")
    draft_address: str = flag("", "draft service host:port; empty = plain decoding")
    num_speculative_tokens: int = flag(4, "default k per request")
    max_speculative_tokens: int = flag(8, "largest k a request may ask for")
    max_batch_size: int = flag(32, "requests verified together (= target KV slots)")
    max_queued_requests: int = flag(256, "waiting requests before RESOURCE_EXHAUSTED")
    max_context_length: int = flag(4096, "prompt + max_new_tokens limit (capped by the model's)")
    max_stop_strings: int = flag(16, "stop strings per request")
    max_stop_string_length: int = flag(256, "characters per stop string")
    draft_timeout: float = flag(2.0, "seconds to wait for a draft proposal before verifying with k = 0")
    draft_backoff_max: float = flag(10.0, "longest pause between draft reconnect attempts, seconds")
    cuda_graphs: bool = flag(
        True, "replay verify steps from CUDA graphs (one per batch/width/context bucket)"
    )
    verify_backend: str = flag(
        "auto",
        "rejection kernels: triton, the torch reference, or auto "
        "(triton on CUDA or under TRITON_INTERPRET=1, else torch)",
        ("auto", "triton", "torch"),
    )
    drain_timeout: float = flag(30.0, "SIGTERM: seconds to let running requests finish")
    grpc_workers: int = flag(256, "gRPC server threads (each open Generate stream holds one)")
    auth_token_file: str = flag("", "file holding a bearer token every call must carry")
    tls_cert: str = flag("", "server certificate (PEM) for TLS")
    tls_key: str = flag("", "server private key (PEM) for TLS")
    tls_client_ca: str = flag("", "CA (PEM) for client certificates: turns on mTLS")
    draft_tls_ca: str = flag("", "CA (PEM) to verify the draft service: turns on TLS to the draft")
    draft_tls_cert: str = flag("", "client certificate (PEM) for mTLS to the draft")
    draft_tls_key: str = flag("", "client key (PEM) for mTLS to the draft")
    draft_tls_server_name: str = flag("", "override the TLS server name checked on the draft's certificate")
    draft_auth_token_file: str = flag("", "bearer token sent to the draft service")
    log_format: str = flag("text", "log lines as text or JSON", ("text", "json"))
    log_level: str = flag("INFO", "logging level")

    def validate(self) -> None:
        if not self.model:
            raise ValueError("--model: a target checkpoint directory is required")
        if self.tp_size < 1:
            raise ValueError("--tp-size: must be >= 1")
        if not 0 <= self.num_speculative_tokens <= self.max_speculative_tokens:
            raise ValueError("--num-speculative-tokens: must be in [0, --max-speculative-tokens]")
        if self.max_speculative_tokens > 64:
            raise ValueError("--max-speculative-tokens: must be <= 64")
        if self.max_batch_size < 1:
            raise ValueError("--max-batch-size: must be >= 1")
        if self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests: must be >= 0")
        if self.draft_timeout <= 0:
            raise ValueError("--draft-timeout: must be > 0")
