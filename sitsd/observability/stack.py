"""The daemon's observability stack: build metrics, traces and logs from the config, and stop them.

`Observability.create(config)` makes, in order: the metrics registry (`Metrics`), the OTel
resource, the tracer provider and the logger provider (both exporting OTLP/gRPC when
`otlp_endpoint` is set), and the engine telemetry. The daemon then calls `setup_logging()`,
`start_metrics_server()`, builds the gRPC telemetry interceptor (`sitsd.api.telemetry`) from
`metrics` and `tracer`, hands `telemetry` to the engine, and calls `shutdown()` last, which
flushes what is still batched.

What each part records is its own module's business (`metrics`, `telemetry`, `logs`, and
`sitsd.api.telemetry` for RPCs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from sitsd.config import ObservabilityConfig
from sitsd.observability.logs import build_logger_provider, setup_logging
from sitsd.observability.metrics import Metrics, MetricsServer
from sitsd.observability.slow_steps import SlowStepLog
from sitsd.observability.swap import SwapTrace
from sitsd.observability.telemetry import EngineTelemetry
from sitsd.observability.tracing import build_resource, build_tracer_provider, tracer_of

log = logging.getLogger(__name__)


@dataclass
class Observability:
    """Everything the daemon records with, created once per daemon and passed around."""

    config: ObservabilityConfig
    metrics: Metrics
    tracer_provider: TracerProvider | None
    tracer: trace.Tracer
    logger_provider: Any | None  # opentelemetry.sdk._logs.LoggerProvider
    telemetry: EngineTelemetry
    metrics_server: MetricsServer | None = field(default=None)

    @classmethod
    def create(cls, config: ObservabilityConfig) -> Observability:
        """Build the stack (no thread started, no port bound yet)."""
        resource = build_resource(config)
        metrics = Metrics()
        provider = build_tracer_provider(config, resource)
        tracer = tracer_of(provider)
        logger_provider = None
        if config.otlp_endpoint:
            logger_provider = build_logger_provider(
                resource, config.otlp_endpoint, config.otlp_insecure, dict(config.otlp_headers)
            )
        slow_steps = SlowStepLog(factor=config.slow_step_factor,
                                 min_s=config.slow_step_ms / 1e3,
                                 warn_every_s=config.stall_warn_every_s)  # fmt: skip
        telemetry = EngineTelemetry(
            metrics, tracer, step_spans=config.step_spans, slow_steps=slow_steps
        )
        return cls(config, metrics, provider, tracer, logger_provider, telemetry)

    def setup_logging(self) -> None:
        """Send logs to stdout (structlog) and, with an OTLP endpoint, to the collector."""
        setup_logging(self.config.log_level, self.config.log_format, self.logger_provider)

    def start_metrics_server(self, default_host: str) -> MetricsServer | None:
        """Serve /metrics (None when metrics are off).

        Raises:
            OSError: the metrics address cannot be bound.
        """
        if not self.config.metrics_enabled:
            return None
        host = self.config.metrics_host or default_host
        self.metrics_server = MetricsServer(self.metrics, host, self.config.metrics_port)
        shown = f"[{host}]" if ":" in host else host
        log.info("metrics on http://%s:%d/metrics", shown, self.metrics_server.port)
        return self.metrics_server

    def swap_trace(self, from_version: str, to_version: str) -> SwapTrace:
        """A trace (and metrics) for one weight swap; see `sitsd.observability.swap`."""
        return SwapTrace(
            self.tracer, self.metrics, from_version=from_version, to_version=to_version
        )

    def shutdown(self) -> None:
        """Stop serving metrics and flush the spans and logs still batched."""
        if self.metrics_server is not None:
            self.metrics_server.close()
            self.metrics_server = None
        if self.tracer_provider is not None:
            self.tracer_provider.shutdown()
        if self.logger_provider is not None:
            # Records logged after this point go to stdout only.
            root = logging.getLogger()
            root.handlers[:] = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
            self.logger_provider.shutdown()
