"""Every Prometheus metric sitsd exports, defined once, in a registry owned by `Metrics`.

Names are `sitsd_*` without colons (colons belong to recording rules). Labels: `model` on all,
`tier` where a request's tier applies. The latency histograms' buckets hold every tier target
(TTFT 0.08 / 0.2 / 0.5 s, queue timeouts 0.12 / 0.25 / 0.5 s), so a latency SLI read at a bucket
boundary is exact. Latency histograms carry exemplars with the request's `trace_id` (served
only in the OpenMetrics format, which Prometheus asks for).

Every label set a counter or histogram can take is created at 0 once the model is bound
(`bind_model`), so `increase()` sees the first swap and the first error of each class: the
swap outcomes, stages and version events below, the engine's per-tier series
(`telemetry.py`), and the API calls the front ends declare (`declare_calls`) with every error
class in `ERROR_CLASSES`.

What is observed when is `telemetry.py`'s (engine), `sitsd.api.telemetry`'s (RPCs) and
`sitsd.http`'s (HTTP requests) business; this module also holds the small APIs that later
subsystems call: the swap recorder's metrics (`record_swap_stage`, `record_swap`), the weights
version, and the tier scheduler's gauges (`set_tier_batch_cap`, `set_tier_p99_estimate`).
`MetricsServer` serves `/metrics` (and 404 elsewhere).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    Info,
    disable_created_metrics,
    generate_latest,
    make_wsgi_app,
)
from prometheus_client.exposition import ThreadingWSGIServer, _get_best_family
from prometheus_client.openmetrics.exposition import generate_latest as generate_openmetrics

log = logging.getLogger(__name__)

# Tier latency targets (the SITS table) and queue timeouts are bucket boundaries on purpose.
# fmt: off
TTFT_BUCKETS = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
)
ITL_BUCKETS = (
    0.005, 0.01, 0.025, 0.04, 0.05, 0.075, 0.08, 0.1, 0.12, 0.15, 0.2, 0.25, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 10.0,
)
REQUEST_BUCKETS = (
    0.05, 0.08, 0.1, 0.12, 0.2, 0.25, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 60.0, 120.0, 240.0, 480.0, 960.0,
)
STEP_BUCKETS = (
    0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.12, 0.2, 0.25, 0.5, 1.0, 2.5, 5.0,
)
# fmt: on
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 256, 512)
STEP_TOKEN_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
SWAP_BUCKETS = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 300.0)

MODEL_TIER = ("model", "tier")

# The label values known in advance (each series exists, at 0, from the start).
ERROR_CLASSES = (
    "invalid_argument", "not_found", "resource_exhausted", "deadline", "cancelled",
    "unavailable", "unauthenticated", "aborted", "unimplemented", "internal",
)  # fmt: skip
SWAP_OUTCOMES = ("staged", "committed", "rejected", "failed", "rolled_back")
SWAP_STAGES = ("receive", "verify", "validate", "stage", "canary", "commit", "pause")
VERSION_EVENTS = ("detected", "rejected", "staged", "committed", "failed")
PUSH_TRANSPORTS = ("grpc", "ipc", "dist")
PUSH_OUTCOMES = ("committed", "staged", "rejected", "refused", "failed")
WSGIApp = Callable[[dict[str, Any], Any], Iterable[bytes]]


class Metrics:
    """sitsd's metrics in a `CollectorRegistry` of their own: one per daemon (or per test)."""

    def __init__(self, model: str = "") -> None:
        """Args: model: the served model's name (the `model` label); see `bind_model`."""
        self.model = model
        # No `_created` series: Prometheus ingests them only behind a feature flag, and they
        # were half of every scrape, whose rendering holds the interpreter that the engine's
        # steps wait for (28 ms of rendering on a CPU, 9 ms without them; on an H200 the
        # steps next to a scrape took 15-30 ms, 3-6x their median). The library has one
        # switch for its whole process: every `Metrics` sets it the same way.
        disable_created_metrics()
        self.registry = CollectorRegistry(auto_describe=True)
        self._init_request_latencies(self.registry)
        self._init_request_counters(self.registry)
        self._init_engine_state(self.registry)
        self._init_swap(self.registry)
        self._init_tier_scheduler(self.registry)
        self._calls: list[tuple[str, str, str]] = []  # declared (method, tier, protocol)
        self._step: tuple[Histogram, Histogram, Histogram] | None = None  # this model's
        self._create_zero_series()

    def _init_request_latencies(self, r: CollectorRegistry) -> None:
        """Metrics: request latencies."""
        self.time_to_first_token = Histogram(
            "sitsd_time_to_first_token_seconds",
            "Time from arrival at the API to the first generated token (queue + prefill).",
            MODEL_TIER,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.inter_token_latency = Histogram(
            "sitsd_inter_token_latency_seconds",
            "Time between two consecutive output tokens of one request.",
            MODEL_TIER,
            registry=r,
            buckets=ITL_BUCKETS,
        )
        self.e2e_request_latency = Histogram(
            "sitsd_e2e_request_latency_seconds",
            "Time from arrival to the last token, of requests that finished (stop or length).",
            MODEL_TIER,
            registry=r,
            buckets=REQUEST_BUCKETS,
        )
        self.request_queue_time = Histogram(
            "sitsd_request_queue_time_seconds",
            "Time from arrival to first scheduling (the queue wait).",
            MODEL_TIER,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.request_prefill_time = Histogram(
            "sitsd_request_prefill_time_seconds",
            "Time from first scheduling to the first token (prefill, all chunks).",
            MODEL_TIER,
            registry=r,
            buckets=TTFT_BUCKETS,
        )
        self.request_decode_time = Histogram(
            "sitsd_request_decode_time_seconds",
            "Time from the first token to the last, of requests that finished.",
            MODEL_TIER,
            registry=r,
            buckets=REQUEST_BUCKETS,
        )

    def _init_request_counters(self, r: CollectorRegistry) -> None:
        """Metrics: request counters."""
        self.prompt_tokens = Counter(
            "sitsd_prompt_tokens", "Prompt tokens of admitted requests.", MODEL_TIER, registry=r
        )
        self.generation_tokens = Counter(
            "sitsd_generation_tokens", "Generated (output) tokens.", MODEL_TIER, registry=r
        )
        self.prefix_cache_queries = Counter(
            "sitsd_prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (at first admission).",
            MODEL_TIER,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "sitsd_prefix_cache_hits",
            "Prompt tokens found in the prefix cache (at first admission).",
            MODEL_TIER,
            registry=r,
        )
        self.preemptions = Counter(
            "sitsd_num_preemptions",
            "Requests preempted (blocks taken back, recomputed later), by reason (blocks: a "
            "running request needed them; tier: a higher tier took the slot; swap: a weight "
            "swap restarted it).",
            (*MODEL_TIER, "reason"),
            registry=r,
        )
        self.requests_finished = Counter(
            "sitsd_requests_finished",
            "Requests the engine ended, by what happened (stop, length, refused, shed, "
            "deadline, cancelled, shutdown, error).",
            (*MODEL_TIER, "finish_reason"),
            registry=r,
        )
        self.requests = Counter(
            "sitsd_requests",
            "API calls handled by sitsd, gRPC RPCs and HTTP requests (protocol), the "
            "denominator of availability SLIs.",
            (*MODEL_TIER, "method", "protocol"),
            registry=r,
        )
        self.request_errors = Counter(
            "sitsd_request_errors",
            "Failed API calls by error class (invalid_argument, resource_exhausted, deadline, "
            "cancelled, unavailable, internal, ...).",
            (*MODEL_TIER, "method", "protocol", "error_class"),
            registry=r,
        )

    def _init_engine_state(self, r: CollectorRegistry) -> None:
        """Metrics: engine state."""
        self.num_requests_running = Gauge(
            "sitsd_num_requests_running", "Requests in the running batch.", MODEL_TIER, registry=r
        )
        self.num_requests_waiting = Gauge(
            "sitsd_num_requests_waiting",
            "Requests queued (new or preempted).",
            MODEL_TIER,
            registry=r,
        )
        self.kv_cache_usage = Gauge(
            "sitsd_kv_cache_usage_perc",
            "Fraction of KV cache blocks in use (0-1).",
            ("model",),
            registry=r,
        )
        self.batch_size = Histogram(
            "sitsd_batch_size",
            "Requests computed in one engine step.",
            ("model",),
            registry=r,
            buckets=BATCH_SIZE_BUCKETS,
        )
        self.step_tokens = Histogram(
            "sitsd_step_tokens",
            "Tokens computed in one engine step (prefill chunks + decodes).",
            ("model",),
            registry=r,
            buckets=STEP_TOKEN_BUCKETS,
        )
        self.step_duration = Histogram(
            "sitsd_step_duration_seconds",
            "Duration of one engine step (schedule, execute, update).",
            ("model",),
            registry=r,
            buckets=STEP_BUCKETS,
        )
        self.event_loop_lag = Histogram(
            "sitsd_event_loop_lag_seconds",
            "How late the daemon's asyncio loop, which streams every token, woke a timer.",
            registry=r,
            buckets=STEP_BUCKETS,
        )

    def _init_swap(self, r: CollectorRegistry) -> None:
        """Metrics: weights and hot-swap."""
        self.weights_version = Info(
            "sitsd_weights_version",
            "The weights version serving requests.",
            ("model",),
            registry=r,
        )
        self.swap_stage_duration = Histogram(
            "sitsd_swap_stage_duration_seconds",
            "Duration of one stage of a weight swap (stage, validate, canary, commit, ...).",
            ("model", "stage"),
            registry=r,
            buckets=SWAP_BUCKETS,
        )
        self.swaps = Counter(
            "sitsd_swaps",
            "Weight swaps by outcome (committed, rejected, failed, rolled_back).",
            ("model", "outcome"),
            registry=r,
        )
        self.weight_updates = Counter(
            "sitsd_weight_updates",
            "Weight pushes from trainers by transport (grpc, ipc, dist) and outcome (committed, "
            "staged, rejected, refused, failed).",
            ("model", "transport", "outcome"),
            registry=r,
        )
        self.weight_update_bytes = Counter(
            "sitsd_weight_update_bytes",
            "Bytes of tensors received from trainers' pushes, by transport.",
            ("model", "transport"),
            registry=r,
        )
        self.last_weight_update = Gauge(
            "sitsd_last_weight_update_seconds",
            "The last weight push's time per stage (receive, validate, canary, commit, total).",
            ("model", "stage"),
            registry=r,
        )
        self.version_events = Counter(
            "sitsd_weight_versions",
            "Weight versions seen in the watched directory, by event (detected, rejected, "
            "staged, committed, failed).",
            ("model", "event"),
            registry=r,
        )

    def _init_tier_scheduler(self, r: CollectorRegistry) -> None:
        """Metrics: tier scheduler (set by it later)."""
        self.tier_batch_cap = Gauge(
            "sitsd_tier_batch_cap",
            "Batch cap the tier scheduler set for a tier.",
            MODEL_TIER,
            registry=r,
        )
        self.tier_p99_estimate = Gauge(
            "sitsd_tier_p99_estimate_seconds",
            "The tier scheduler's streaming P99 estimate for a tier (kind: ttft, itl).",
            (*MODEL_TIER, "kind"),
            registry=r,
        )

    def bind_model(self, model: str) -> None:
        """Label everything recorded from now on with `model` (known once the model loads);
        every label set known in advance is created at 0 for it."""
        self.model = model
        self._create_zero_series()

    def declare_calls(self, protocol: str, methods: Iterable[str], tiers: Iterable[str]) -> None:
        """The API calls a front end counts (`count_rpc`): each (method, tier) is created at
        0, with every error class, once the model is bound."""
        tiers = tuple(tiers)
        declared = [(method, tier, protocol) for method in methods for tier in tiers]
        self._calls += declared
        if self.model:
            self._create_call_series(declared)

    def _create_zero_series(self) -> None:
        if not self.model:  # before the model loads: nothing labelled `model=""`
            return
        model = self.model
        for outcome in SWAP_OUTCOMES:
            self.swaps.labels(model, outcome)
        for stage in SWAP_STAGES:
            self.swap_stage_duration.labels(model, stage)
        for event in VERSION_EVENTS:
            self.version_events.labels(model, event)
        for transport in PUSH_TRANSPORTS:
            self.weight_update_bytes.labels(model, transport)
            for outcome in PUSH_OUTCOMES:
                self.weight_updates.labels(model, transport, outcome)
        self.kv_cache_usage.labels(model)
        self._step = (
            self.batch_size.labels(model),
            self.step_tokens.labels(model),
            self.step_duration.labels(model),
        )  # resolved once: observed every step
        self._create_call_series(self._calls)

    def _create_call_series(self, calls: Iterable[tuple[str, str, str]]) -> None:
        for method, tier, protocol in calls:
            self.requests.labels(self.model, tier, method, protocol)
            for error_class in ERROR_CLASSES:
                self.request_errors.labels(self.model, tier, method, protocol, error_class)

    # ------------------------------------------------------------ APIs for other subsystems

    def set_weights_version(self, version: str) -> None:
        """Publish the weights version now serving (at start-up and after each swap)."""
        self.weights_version.labels(self.model).info({"version": version})

    def observe_step(self, batch_size: int, num_tokens: int, seconds: float) -> None:
        """One engine step: its requests, its tokens and its duration."""
        if self._step is None:
            return  # no model bound yet: no engine runs
        batch, tokens, duration = self._step
        batch.observe(batch_size)
        tokens.observe(num_tokens)
        duration.observe(seconds)

    def set_kv_cache_usage(self, fraction: float) -> None:
        """The fraction of KV cache blocks in use."""
        self.kv_cache_usage.labels(self.model).set(fraction)

    def record_swap_stage(self, stage: str, seconds: float) -> None:
        """Record that one stage of a weight swap took `seconds`."""
        self.swap_stage_duration.labels(self.model, stage).observe(seconds)

    def record_swap(self, outcome: str) -> None:
        """Count a finished weight swap by its outcome."""
        self.swaps.labels(self.model, outcome).inc()

    def record_weight_update(
        self, transport: str, outcome: str, num_bytes: int, stage_seconds: dict[str, float]
    ) -> None:
        """Count a finished weight push; its stages' times become the last update's."""
        self.weight_updates.labels(self.model, transport, outcome).inc()
        self.weight_update_bytes.labels(self.model, transport).inc(num_bytes)
        for stage, seconds in stage_seconds.items():
            self.last_weight_update.labels(self.model, stage).set(seconds)

    def record_version_event(self, event: str) -> None:
        """Count what the watcher did with a version it saw."""
        self.version_events.labels(self.model, event).inc()

    def set_tier_batch_cap(self, tier: str, cap: int) -> None:
        """For the tier scheduler: the batch cap it now applies to `tier`."""
        self.tier_batch_cap.labels(self.model, tier).set(cap)

    def set_tier_p99_estimate(self, tier: str, kind: str, seconds: float) -> None:
        """For the tier scheduler: its live P99 estimate of `kind` (ttft, itl) for `tier`."""
        self.tier_p99_estimate.labels(self.model, tier, kind).set(seconds)

    def count_rpc(
        self, method: str, tier: str, error_class: str | None, protocol: str = "grpc"
    ) -> None:
        """Count one finished API call ("grpc" or "http"), and its error class if it failed."""
        self.requests.labels(self.model, tier, method, protocol).inc()
        if error_class is not None:
            self.request_errors.labels(self.model, tier, method, protocol, error_class).inc()

    # ---------------------------------------------------------------------- exposition

    def exposition(self, openmetrics: bool = False) -> bytes:
        """The registry as Prometheus text (no exemplars) or OpenMetrics (with exemplars)."""
        if openmetrics:
            return generate_openmetrics(self.registry)
        return generate_latest(self.registry)


class MetricsServer:
    """`/metrics` over HTTP on its own thread; Prometheus gets OpenMetrics when it asks.

    Every other path is 404: a client pointed at this port by mistake (an OpenAI client asking
    for `/v1/models`) must fail plainly, not parse the Prometheus text as an answer.
    """

    def __init__(self, metrics: Metrics, host: str, port: int) -> None:
        """Bind `host:port` (port 0 = a free one) and serve.

        Raises:
            OSError: the address cannot be bound.
        """

        class Server(ThreadingWSGIServer):
            """A class of its own: the address family is set on it for this host."""

        Server.address_family, address = _get_best_family(host, port)
        app = _metrics_only(make_wsgi_app(metrics.registry))
        self._httpd: WSGIServer = make_server(
            address, port, app, Server, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._httpd.serve_forever, name="sitsd-metrics", daemon=True
        )
        self._thread.start()
        self.host = host
        self.port: int = self._httpd.server_port

    def close(self) -> None:
        """Stop serving and release the port."""
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)


def _metrics_only(app: WSGIApp) -> WSGIApp:
    """`app` on `/metrics`; 404 on every other path."""

    def serve(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO", "") in ("/metrics", "/metrics/"):
            return app(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [b"404: this port serves only /metrics\n"]

    return serve


class _QuietHandler(WSGIRequestHandler):
    """No access log line per scrape on stderr."""

    def log_message(self, format: str, *args: Any) -> None:
        pass
