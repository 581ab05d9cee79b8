"""The target service's one config object (flags and SPECSPLIT_* env vars, see common.settings)."""

from __future__ import annotations

from dataclasses import dataclass

from common.settings import ServiceConfig, flag
from target_service.step_profile import parse_window


@dataclass
class TargetConfig(ServiceConfig):
    draft_address: str = flag(
        "", "draft replicas: host:port, a comma list, or a DNS name for all of them; empty = plain decoding"
    )
    draft_local: str = flag(
        "",
        "run the draft in this process instead of as a service, from serve-draft's flags (e.g. '--model "
        "DIR'; device and dtype default to the target's): one GPU without the gRPC round trip between two "
        "services; the draft's metrics on its own --metrics-port (default 9401). Needs --tp-size 1",
    )
    draft_feature_layers: str = flag(
        "",
        "target layers whose input streams a feature draft reads, e.g. 2,14,25 (its GetDraftInfo's "
        "feature_layers; with --draft-local read from the draft's config)",
    )
    draft_chain: bool = flag(
        True,
        "with --draft-local, launch the draft's next round for greedy requests right after each verify, "
        "fed from the verify's output on the GPU: the round runs while the host commits the step",
    )
    http_port: int = flag(
        -1,
        "port of the OpenAI-compatible HTTP API (/v1/completions, /v1/chat/completions, /v1/models; "
        "the same --auth-token-file): 0 = pick a free one, -1 = off",
    )
    num_speculative_tokens: int = flag(4, "default k per request")
    max_speculative_tokens: int = flag(8, "largest k a request may ask for")
    max_batch_size: int = flag(32, "requests verified together (= target KV slots)")
    max_queued_requests: int = flag(256, "waiting requests before RESOURCE_EXHAUSTED")
    admit_wait_steps: int = flag(
        0,
        "while a batch decodes, waiting requests join it in groups: once --admit-group of the batch they "
        "would make fits, or once the first has waited this many steps (an empty batch takes them at once). "
        "Each join is a prefill forward that reads every weight, however few its rows; a speculating "
        "batch, whose requests finish at different steps, otherwise pays one almost every step. 0 = at once",
    )
    admit_group: float = flag(
        0.125, "the share of the batch a group of joining requests fills (--admit-wait-steps)"
    )
    batch_invariant: bool = flag(
        False,
        "every GEMM of the target in one fixed-tile kernel and its attention in one shape for every step "
        "(common/kernels/invariant.py): a token's logits are the same bits in a plain step, a verify step "
        "and a prefill at any batch, so bf16 greedy output with speculation equals plain decoding at any "
        "batch; slower than the tuned kernels. Needs --tp-size 1 (the all-reduce's sums depend on its size)",
    )
    max_stop_strings: int = flag(16, "stop strings per request")
    max_stop_string_length: int = flag(256, "characters per stop string")
    speculation_policy: str = flag(
        "adaptive",
        "how many draft tokens a step asks for: fixed (each request's k) or adaptive (the k in [0, k] that "
        "maximises expected tokens per second from measured step costs and running acceptance)",
        ("fixed", "adaptive"),
    )
    draft_timeout: float = flag(2.0, "seconds to wait for a draft proposal before verifying with k = 0")
    draft_backoff_max: float = flag(10.0, "longest pause between draft reconnect attempts, seconds")
    verify_backend: str = flag(
        "auto",
        "rejection kernels: triton, the torch reference, or auto "
        "(triton on CUDA or under TRITON_INTERPRET=1, else torch)",
        ("auto", "triton", "torch"),
    )
    drain_timeout: float = flag(30.0, "SIGTERM: seconds to let running requests finish")
    max_stream_backlog: int = flag(
        1024, "responses a client may leave unread before its stream is cancelled (RESOURCE_EXHAUSTED)"
    )
    stream_interval: int = flag(
        1,
        "send a request's tokens once this many are ready (its first and its last at once): fewer "
        "stream writes per step at large batch, for chunkier streams",
    )
    stream_messages_per_step: int = flag(
        16,
        "at most this many stream messages per step (0: no limit), the requests waiting longest first: "
        "token-by-token streams up to this many requests, chunks of about B / N tokens above",
    )
    prefill_graph_tokens: int = flag(
        2048,
        "prefills of up to this many padded tokens (rows x length, each a power of two) replay CUDA graphs "
        "captured at start-up: a short prompt's eager prefill costs its kernel launches; 0 = always eager",
    )
    step_trace: str = flag(
        "",
        "append one JSON line per step to this file (target_service/step_trace.py: batch, width, k, "
        "tokens, phase times; for finding where a serving loop's time goes); empty = off",
    )
    profile_dir: str = flag(
        "",
        "torch.profiler over --profile-steps serving steps into this folder (target_service/step_profile.py: "
        "a timeline, device time per kernel, device-busy over wall); empty = off",
    )
    profile_steps: str = flag("200,100", "FIRST,COUNT: the steps --profile-dir profiles")
    draft_tls_ca: str = flag("", "CA (PEM) to verify the draft service: turns on TLS to the draft")
    draft_tls_cert: str = flag("", "client certificate (PEM) for mTLS to the draft")
    draft_tls_key: str = flag("", "client key (PEM) for mTLS to the draft")
    draft_tls_server_name: str = flag("", "override the TLS server name checked on the draft's certificate")
    draft_auth_token_file: str = flag("", "bearer token sent to the draft service")

    def validate(self) -> None:
        super().validate()
        if not 0 <= self.num_speculative_tokens <= self.max_speculative_tokens:
            raise ValueError("--num-speculative-tokens: must be in [0, --max-speculative-tokens]")
        if self.max_speculative_tokens > 64:
            raise ValueError("--max-speculative-tokens: must be <= 64")
        if self.max_queued_requests < 0:
            raise ValueError("--max-queued-requests: must be >= 0")
        if self.admit_wait_steps < 0:
            raise ValueError("--admit-wait-steps: must be >= 0 (0: admit at once)")
        if not 0 <= self.admit_group <= 1:
            raise ValueError("--admit-group: must be in [0, 1]")
        if self.max_stream_backlog < 1:
            raise ValueError("--max-stream-backlog: must be >= 1")
        if self.prefill_graph_tokens < 0:
            raise ValueError("--prefill-graph-tokens: must be >= 0 (0: off)")
        if self.stream_interval < 1:
            raise ValueError("--stream-interval: must be >= 1")
        if self.stream_messages_per_step < 0:
            raise ValueError("--stream-messages-per-step: must be >= 0 (0: no limit)")
        if self.draft_local and self.draft_address:
            raise ValueError("--draft-local: give either --draft-local or --draft-address, not both")
        if self.batch_invariant and self.tp_size != 1:
            raise ValueError("--batch-invariant: needs --tp-size 1")
        if self.draft_local and self.tp_size != 1:
            raise ValueError("--draft-local: needs --tp-size 1 (run a draft service beside a TP target)")
        if self.profile_dir:
            parse_window(self.profile_steps)
        if self.draft_timeout <= 0:
            raise ValueError("--draft-timeout: must be > 0")
