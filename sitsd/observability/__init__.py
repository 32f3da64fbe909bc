"""Observability: Prometheus metrics, OpenTelemetry traces, structured logs.

- `metrics`: every metric, defined once, in a registry owned by a `Metrics` object; `/metrics`.
- `telemetry`: the engine observer (queue/prefill/decode/preemption spans, step spans, SLO
  histograms, one log line per request).
- `tracing`, `logs`: providers and exporters (OTLP/gRPC), the structlog JSON formatter.
- `swap`: weight swaps as traces of their own (for the hot-swap code).
- `stack`: builds all of it from `ObservabilityConfig` for the daemon.

The engine knows only its hook (`sitsd.engine.observer`) and the request's trace context; the
gRPC interceptor that records server spans and RPC counters is the API's
(`sitsd.api.telemetry`), built by the daemon from `Observability.metrics` and `.tracer`. What the
metrics and spans are is decided here.
"""

from sitsd.observability.metrics import Metrics, MetricsServer
from sitsd.observability.stack import Observability
from sitsd.observability.telemetry import EngineTelemetry

__all__ = ["EngineTelemetry", "Metrics", "MetricsServer", "Observability"]
