"""Prometheus metrics for the draft and target services.

One `ServiceMetrics` per service process. Every series carries `role` (target|draft) and
`model` labels (constant per process) so one dashboard and one set of rules serve both
services and several models. The label is `role`, not `service`: a Prometheus Operator
scrape attaches the target labels `service`, `pod`, `namespace`, `job`, `instance`,
`container` and `endpoint`, and an application label of the same name would be renamed
`exported_<name>` (RESERVED_LABELS; tests/test_prometheus_live.py scrapes through that
relabelling). Conventions (checked by `promtool check metrics` in
tests): prefix `specsplit_`, base units, `_total` only on counters, no colons, no
per-request labels. docs/metrics.md lists every series and who increments it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import (
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

PREFIX = "specsplit_"

# No `<name>_created` series beside every counter and histogram: one more series per child that no rule
# or panel reads (the process start time is in process_start_time_seconds).
disable_created_metrics()

# Per-step latencies: a GPU verify step or TPOT can sit well under a millisecond, a CPU
# demo step takes tens to hundreds of ms. 1-2-5 steps keep each bucket within 2.5x, so
# histogram_quantile stays within about a bucket's width at both speeds with 15 buckets.
STEP_BUCKETS = (
    0.0001, 0.0002, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0,
)  # fmt: skip
# Per-request latencies (TTFT, end to end, queue): from a millisecond to a long CPU generation.
REQUEST_BUCKETS = (
    0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 300.0,
)  # fmt: skip

GRPC_DIRECTIONS = ("sent", "received")
# gRPC status codes (lower-case names) that are the service's failure, not the client's: the error-ratio
# rule counts these. Their children exist from start-up, so rate() sees a first error.
SERVER_ERROR_CODES = (
    "internal", "unavailable", "resource_exhausted", "deadline_exceeded", "unknown", "data_loss", "aborted",
)  # fmt: skip
# Labels a scrape attaches to every series (Prometheus: job, instance; a Prometheus Operator
# ServiceMonitor/PodMonitor: namespace, service, pod, container, endpoint). No exported label may
# use one of these names.
RESERVED_LABELS = ("job", "instance", "namespace", "service", "pod", "container", "endpoint")

CommStats = Callable[[], dict[tuple[str, str], tuple[int, int]]]


class TPCommCollector(Collector):
    """Exports the TP collective counters kept by common.distributed at scrape time.

    comm_stats() returns {(op, site): (calls, bytes)} for this process; reading it at
    scrape time keeps the hot path free of any Prometheus call.
    """

    def __init__(self, role: str, model: str, comm_stats: CommStats | None):
        self.role, self.model, self.comm_stats = role, model, comm_stats

    def collect(self) -> Iterator[CounterMetricFamily]:
        labels = ["role", "model", "op", "site"]
        calls = CounterMetricFamily(
            PREFIX + "tp_comm_calls", "Tensor-parallel collective calls, by op and call site.", labels=labels
        )
        nbytes = CounterMetricFamily(
            PREFIX + "tp_comm_bytes",
            "Tensor-parallel collective payload bytes sent by this rank, by op and call site.",
            labels=labels,
        )
        stats = self.comm_stats() if self.comm_stats is not None else {}
        for (op, site), (n_calls, n_bytes) in sorted(stats.items()):
            calls.add_metric([self.role, self.model, op, site], n_calls)
            nbytes.add_metric([self.role, self.model, op, site], n_bytes)
        yield calls
        yield nbytes


@dataclass(frozen=True)
class MetricSpec:
    """One metric family of ServiceMetrics: the attribute that holds it, its type, name (after PREFIX) and
    help, its labels beyond role and model, and a histogram's buckets. An attribute holds the family's
    (role, model) child, or the family itself where it has labels of its own (ServiceMetrics._child)."""

    attr: str
    kind: type[Histogram] | type[Counter] | type[Gauge]
    name: str
    doc: str
    labels: tuple[str, ...] = ()
    buckets: tuple[float, ...] = ()


# Every series of ServiceMetrics but the info and TP collector ones. Dashboards and alert rules
# (deploy/observability) and docs/metrics.md name these: a name, help or label here is an interface.
METRICS = (
    # Latency histograms.
    MetricSpec(
        "tpot",
        Histogram,
        "time_per_output_token_seconds",
        "Per request: decode time / (output tokens - 1), observed when the request finishes.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "inter_token_latency",
        Histogram,
        "inter_token_latency_seconds",
        "Time between consecutive streamed chunks of a request.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "ttft",
        Histogram,
        "time_to_first_token_seconds",
        "Request arrival to first streamed token.",
        buckets=REQUEST_BUCKETS,
    ),
    MetricSpec(
        "e2e_latency",
        Histogram,
        "e2e_request_latency_seconds",
        "Request arrival to final response.",
        buckets=REQUEST_BUCKETS,
    ),
    MetricSpec(
        "queue_time",
        Histogram,
        "queue_time_seconds",
        "Request arrival to admission into the running batch.",
        buckets=REQUEST_BUCKETS,
    ),
    MetricSpec(
        "draft_step",
        Histogram,
        "draft_step_seconds",
        "One draft proposal step for the batch (k positions); for a round chained to the target's "
        "verify (--draft-local), its GPU time (no host waits for it).",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "draft_handle",
        Histogram,
        "draft_handle_seconds",
        "A Speculate message in the draft: from the servicer reading it to its answer being handed "
        "to gRPC (checks, verdicts, the draft round, the answer built); the target's round trip "
        "less this is the transport, the thread hand-offs and any wait behind a branch round.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "draft_ahead_step",
        Histogram,
        "draft_ahead_step_seconds",
        "One draft-ahead round (k+1 positions guessed past a proposal) while the target verifies.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "verify_step",
        Histogram,
        "verify_step_seconds",
        "One target verify step for the batch (k+1 positions).",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "step_gpu",
        Histogram,
        "step_gpu_seconds",
        "GPU time of one target step (verify forward and rejection kernel), from CUDA events.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "step_host",
        Histogram,
        "step_host_seconds",
        "Host time of one target step: wall time not spent waiting for the GPU or the draft.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "step_gpu_gap",
        Histogram,
        "step_gpu_gap_seconds",
        "GPU time between two target steps with none of their work queued: from the end of one step's "
        "GPU work (its verify, and the draft round chained to it with --draft-local) to the start of "
        "the next step's verify, on the target's stream (CUDA events). With the draft in the target "
        "and its rounds chained, the step's wall time minus the GPU's busy time. Steps after a "
        "prefill are not observed.",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "step_gpu_queue",
        Histogram,
        "step_gpu_queue_seconds",
        "Time one target step's GPU work waited behind other work on the GPU (a colocated draft).",
        buckets=STEP_BUCKETS,
    ),
    MetricSpec(
        "step_k",
        Histogram,
        "spec_step_tokens",
        "Draft tokens asked per request in one target step (the speculation policy's k; 0 = plain).",
        buckets=(0, 1, 2, 3, 4, 5, 6, 8, 12, 16),
    ),
    MetricSpec(
        "round_trip",
        Histogram,
        "draft_round_trip_seconds",
        "Target sends a draft request to the proposal arriving back, seen from the target.",
        buckets=STEP_BUCKETS,
    ),
    # Speculation counters (target side sees verdicts; draft side sees draft-ahead).
    MetricSpec(
        "drafts", Counter, "spec_drafts_total", "Speculation rounds: one per request per verify step."
    ),
    MetricSpec("draft_tokens", Counter, "spec_draft_tokens_total", "Draft tokens proposed to the verifier."),
    MetricSpec(
        "accepted_tokens", Counter, "spec_accepted_tokens_total", "Draft tokens accepted by the verifier."
    ),
    MetricSpec(
        "_accepted_per_position",
        Counter,
        "spec_accepted_tokens_per_position_total",
        "Draft tokens accepted at each draft position (0 = first drafted token).",
        labels=("position",),
    ),
    MetricSpec(
        "draft_ahead_hits",
        Counter,
        "draft_ahead_hits_total",
        "Draft-ahead proposals used because the verdict matched the guess (or one of the branches).",
    ),
    MetricSpec(
        "draft_chained_rows",
        Counter,
        "draft_chained_rows_total",
        "Requests whose draft round ran from the target's verify output on the GPU, launched before "
        "the target's verdict reached the draft (--draft-local, --draft-chain).",
    ),
    MetricSpec(
        "draft_ahead_misses",
        Counter,
        "draft_ahead_misses_total",
        "Draft-ahead proposals dropped because the verdict differed.",
    ),
    MetricSpec(
        "pipelined_steps",
        Counter,
        "spec_pipelined_steps_total",
        "Target steps verified without waiting for the draft's answer: on its branches (the verdict "
        "picked one for every request, or for at least half when going on beat waiting), or, with the "
        "draft in the target, on the round chained to the last verify.",
    ),
    MetricSpec(
        "fallback_steps",
        Counter,
        "spec_fallback_steps_total",
        "Target steps run as plain decoding (k=0) because the draft failed.",
    ),
    MetricSpec(
        "serving_captures",
        Counter,
        "serving_captures_total",
        "CUDA graph captures (and the kernel compiles inside them) that a step paid at serving time.",
    ),
    MetricSpec(
        "draft_eager_rounds",
        Counter,
        "draft_eager_rounds_total",
        "Draft rounds run eagerly: no CUDA graph of their shape or one drafting more positions yet.",
    ),
    MetricSpec(
        "draft_reconnects", Counter, "draft_reconnects_total", "Reconnect attempts from target to draft."
    ),
    MetricSpec("generated_tokens", Counter, "generation_tokens_total", "Output tokens streamed to clients."),
    MetricSpec("prompt_tokens", Counter, "prompt_tokens_total", "Prompt tokens of admitted requests."),
    MetricSpec(
        "_finished",
        Counter,
        "requests_finished_total",
        "Requests finished, by reason (stop, length, abort...).",
        labels=("reason",),
    ),
    MetricSpec(
        "_errors",
        Counter,
        "request_errors_total",
        "Requests failed, by gRPC status code name.",
        labels=("code",),
    ),
    MetricSpec(
        "_grpc_bytes",
        Counter,
        "grpc_payload_bytes_total",
        "Serialized gRPC message bytes, by direction (sent|received) and message kind.",
        labels=("direction", "kind"),
    ),
    MetricSpec(
        "_grpc_messages",
        Counter,
        "grpc_messages_total",
        "gRPC messages, by direction (sent|received) and message kind.",
        labels=("direction", "kind"),
    ),
    # Gauges.
    MetricSpec("running", Gauge, "running_requests", "Requests in the running batch."),
    MetricSpec("waiting", Gauge, "waiting_requests", "Requests admitted to the queue, not yet running."),
    MetricSpec("batch_size", Gauge, "batch_size", "Requests in the last executed step."),
    MetricSpec("kv_slots_used", Gauge, "kv_slots_used", "KV cache slots held by requests."),
    # A gauge may not end in _total (promtool lint), hence _capacity for the attribute kv_slots_total.
    MetricSpec("kv_slots_total", Gauge, "kv_slots_capacity", "KV cache slots available in total."),
    MetricSpec(
        "draft_replicas", Gauge, "draft_replicas", "Draft replicas the target knows (resolved addresses)."
    ),
    MetricSpec(
        "draft_replicas_connected",
        Gauge,
        "draft_replicas_connected",
        "Draft replicas the target holds a healthy stream to.",
    ),
    # /metrics is served from process start, before the model loads: alerts on a pod's other gauges
    # (draft_connected, slots) are gated on this, and a pod stuck at 0 has its own alert.
    MetricSpec(
        "ready",
        Gauge,
        "ready",
        "1 once the model is loaded and requests are served; 0 while loading or draining.",
    ),
    MetricSpec(
        "draft_connected",
        Gauge,
        "draft_connected",
        "1 while the target holds a healthy stream to the draft service, else 0.",
    ),
    MetricSpec(
        "_not_drafting",
        Gauge,
        "not_drafting",
        "1 for the reason the target's last step drafted nothing though its requests allowed it "
        "(e.g. the adaptive policy: draft cost exceeds expected gain); all 0 while it drafts.",
        labels=("reason",),
    ),
    MetricSpec(
        "_tls_expiry",
        Gauge,
        "tls_certificate_expiry_timestamp_seconds",
        "Expiry (Unix time) of the certificate the service holds from a TLS flag (`certificate`: tls_cert, "
        "tls_client_ca, draft_tls_cert, draft_tls_ca; a bundle's earliest); follows a renewal on disk "
        "without a restart (common/tls.py).",
        labels=("certificate",),
    ),
)


class ServiceMetrics:
    """All metrics of one service process, children pre-labelled with role and model.

    Pass a fresh CollectorRegistry to have several instances in one process (tests);
    two instances on the same registry raise ValueError (duplicated timeseries).
    """

    def __init__(
        self,
        role: str,
        model: str,
        registry: CollectorRegistry = REGISTRY,
        comm_stats: CommStats | None = None,
    ):
        if not role or not model:
            raise ValueError(f"ServiceMetrics needs non-empty role and model, got {role=!r} {model=!r}")
        self.role, self.model = role, model
        self._children: dict[tuple, object] = {}  # _child: labelled children made once
        for spec in METRICS:
            setattr(self, spec.attr, self._family(spec, registry))
        self._info = Info(
            PREFIX + "service",
            "Static facts about this service process.",
            ("role", "model"),
            registry=registry,
        )
        self._info.labels(role, model).info({})

        for code in SERVER_ERROR_CODES:
            self.request_error(code)
        registry.register(TPCommCollector(role, model, comm_stats))
        self._not_drafting_reason = ""

    def _family(self, spec: MetricSpec, registry: CollectorRegistry):
        """A METRICS row's family on `registry`: its (role, model) child unless it has labels of its own."""
        buckets = {"buckets": spec.buckets} if spec.buckets else {}
        family = spec.kind(
            PREFIX + spec.name, spec.doc, ("role", "model", *spec.labels), registry=registry, **buckets
        )
        return family if spec.labels else family.labels(self.role, self.model)

    # Labelled children are looked up per step and per message (accepted-at-position, the gRPC message
    # counters): prometheus_client's labels() validates and hashes its arguments on every call, 11 % of
    # the scheduler thread's time in a B=1 speculative step (bench/host_path.py under py-spy). A child
    # never changes once made, so each is made once and kept here.
    def _child(self, family, *labels: str):
        """`family`'s child labelled role, model, *labels."""
        child = self._children.get((family, labels))
        if child is None:
            child = self._children[family, labels] = family.labels(self.role, self.model, *labels)
        return child

    def set_not_drafting(self, reason: str) -> None:
        """The reason the last step drafted nothing ("": it drafted); a series per reason seen, one at 1."""
        if reason == self._not_drafting_reason:
            return
        if self._not_drafting_reason:
            self._child(self._not_drafting, self._not_drafting_reason).set(0)
        if reason:
            self._child(self._not_drafting, reason).set(1)
        self._not_drafting_reason = reason

    def accepted_at_position(self, position: int):
        """Counter child for draft position `position`, 0-based (0 = first drafted token)."""
        if isinstance(position, bool) or not isinstance(position, int) or position < 0:
            raise ValueError(f"position must be an int >= 0 (0-based draft position), got {position!r}")
        return self._child(self._accepted_per_position, str(position))

    def finished(self, reason: str):
        return self._child(self._finished, _label("reason", reason))

    def request_error(self, code: str):
        return self._child(self._errors, _label("code", code))

    def grpc_bytes(self, direction: str, kind: str):
        return self._child(self._grpc_bytes, _direction(direction), _label("kind", kind))

    def grpc_messages(self, direction: str, kind: str):
        return self._child(self._grpc_messages, _direction(direction), _label("kind", kind))

    def count_grpc_message(self, direction: str, kind: str, nbytes: int) -> None:
        """Counts one message and its serialized size (message.ByteSize())."""
        self.grpc_messages(direction, kind).inc()
        self.grpc_bytes(direction, kind).inc(nbytes)

    def observe_tpot(self, decode_seconds: float, output_tokens: int) -> None:
        """TPOT of a finished request: decode time over the tokens after the first one.

        Requests with fewer than two output tokens have no TPOT and are not observed.
        """
        if output_tokens >= 2:
            self.tpot.observe(decode_seconds / (output_tokens - 1))

    def set_tls_expiry(self, flag: str, expiry: float) -> None:
        """common.tls.ExpirySink: `flag` is the TLS flag (--tls-cert), the label its name (tls_cert)."""
        self._child(self._tls_expiry, flag.lstrip("-").replace("-", "_")).set(expiry)

    def set_info(self, **facts: object) -> None:
        """Sets specsplit_service_info labels, e.g. tp_size=2, device="cuda", dtype="bfloat16"."""
        self._info.labels(self.role, self.model).info({k: str(v) for k, v in facts.items()})


def _label(field: str, value: str) -> str:
    if not isinstance(value, str) or not value:
        raise ValueError(f"metric label {field!r} must be a non-empty string, got {value!r}")
    return value


def _direction(direction: str) -> str:
    if direction not in GRPC_DIRECTIONS:
        raise ValueError(f"gRPC direction must be one of {GRPC_DIRECTIONS}, got {direction!r}")
    return direction


def start_metrics_server(port: int, addr: str = "0.0.0.0", registry: CollectorRegistry = REGISTRY) -> int:
    """Serves /metrics over HTTP on a daemon thread; returns the bound port (port 0 picks a free one)."""
    server, _thread = start_http_server(port, addr=addr, registry=registry)
    return server.server_port


def announce_metrics_port(port: int) -> None:
    """The service's own /metrics port on stdout as soon as it serves (before the model loads), for
    launchers that let it pick one (specsplit.launch passes --metrics-port 0)."""
    print(f"SPECSPLIT_METRICS port={port}", flush=True)
