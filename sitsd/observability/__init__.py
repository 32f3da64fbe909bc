"""Observability: Prometheus metrics, OpenTelemetry traces, structured logs.

- `metrics`: every metric, defined once, in a registry owned by a `Metrics` object; `/metrics`.
- `telemetry`: the engine observer (queue/prefill/decode/preemption spans, step spans, SLO
  histograms, one log line per request).
- `rpc`: the gRPC interceptor (server spans from `traceparent`, error classes, RPC counters).
- `tracing`, `logs`: providers and exporters (OTLP/gRPC), the structlog JSON formatter.
- `swap`: weight swaps as traces of their own (for the hot-swap code).
- `stack`: builds all of it from `ObservabilityConfig` for the daemon.

The engine and the API know only the hooks (`sitsd.engine.observer`, an extra interceptor, and
the request's trace context); everything recorded is decided here.
"""

from sitsd.observability.metrics import Metrics, MetricsServer
from sitsd.observability.stack import Observability
from sitsd.observability.telemetry import EngineTelemetry

__all__ = ["EngineTelemetry", "Metrics", "MetricsServer", "Observability"]
