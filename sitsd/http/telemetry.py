"""HTTP requests in the daemon's telemetry: a server span each, counted and logged like RPCs.

For every `/v1/*` request `HttpTelemetry.start` continues the caller's W3C `traceparent` /
`tracestate` and starts a SERVER span `POST /v1/chat/completions` (GenAI attributes, the
route); the handlers hand it to the engine as the request's trace context, so the engine's
spans become its children exactly as for gRPC. `finish` counts the request in
`sitsd_requests_total{protocol="http"}` (and its error class in `sitsd_request_errors_total`;
both generation routes are created at 0 for every tier and error class), logs a failure
inside the span and ends it. Which status a failure gets is
`sitsd.http.errors`'; the metrics are `sitsd.observability.metrics`'.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from sitsd.http.errors import HttpError
from sitsd.observability.metrics import Metrics
from sitsd.types import TIER_ORDER, Tier

log = logging.getLogger("sitsd.http")

DEFAULT_TIER = Tier.SILVER.value  # the engine's default for requests that name no tier
GENERATION_ROUTES = ("/v1/completions", "/v1/chat/completions")

# Failures that are the client's doing, logged at INFO; the others at WARNING.
CLIENT_ERROR_CLASSES = frozenset({"invalid_argument", "not_found", "cancelled", "unauthenticated"})


class HttpTelemetry:
    """Server spans, request counters and failure logs of the HTTP front end."""

    def __init__(self, metrics: Metrics | None, tracer: trace.Tracer | None = None) -> None:
        self._metrics = metrics
        self._tracer = tracer or trace.NoOpTracer()
        self._propagator = TraceContextTextMapPropagator()
        if metrics is not None:
            metrics.declare_calls("http", GENERATION_ROUTES, [t.value for t in TIER_ORDER])

    def start(self, route: str, headers: Mapping[str, str], operation: str) -> RequestSpan:
        """The span of one request to `route`, ended by `RequestSpan.finish`."""
        carrier = {k: headers[k] for k in ("traceparent", "tracestate") if k in headers}
        span = self._tracer.start_span(
            f"POST {route}",
            context=self._propagator.extract(carrier),
            kind=SpanKind.SERVER,
            attributes={
                "http.request.method": "POST",
                "http.route": route,
                "gen_ai.operation.name": operation,
                "gen_ai.provider.name": "sitsd",
            },
        )
        return RequestSpan(self, span, route)

    def count(self, route: str, tier: str, error: HttpError | None) -> None:
        """Count a finished request; `tier` "" is the engine's default, as for gRPC."""
        tier = tier or DEFAULT_TIER
        if self._metrics is not None:
            error_class = None if error is None else error.error_class
            self._metrics.count_rpc(route, tier, error_class, protocol="http")


class RequestSpan:
    """One request's span, ended (and the request counted) by `finish`.

    It is never made current across awaits: a streamed answer finishes in another task than
    the one that started it, and OTel context tokens cannot cross tasks.
    """

    def __init__(self, owner: HttpTelemetry, span: Span, route: str) -> None:
        self._owner = owner
        self.span = span
        self._route = route
        self._finished = False

    @property
    def trace_context(self) -> Span | None:
        """What the engine continues: the span when it records, else None."""
        return self.span if self.span.is_recording() else None

    def finish(self, tier: str, error: HttpError | None) -> None:
        """Count the request, log its failure (inside the span) and end the span. Idempotent."""
        if self._finished:
            return
        self._finished = True
        span = self.span
        token = otel_context.attach(trace.set_span_in_context(span))  # log lines get its ids
        try:
            self._owner.count(self._route, tier, error)
            span.set_attribute("http.response.status_code", 200 if error is None else error.status)
            if error is not None:
                span.set_attribute("error.type", error.error_class)
                if error.error_class in ("cancelled", "deadline"):  # the engine hears it later
                    span.set_attribute("sitsd.finish_reason", error.error_class)
                client = error.error_class in CLIENT_ERROR_CLASSES
                if not client:
                    span.set_status(Status(StatusCode.ERROR, error.message))
                log.log(
                    logging.INFO if client else logging.WARNING,
                    "http request failed",
                    extra={
                        "route": self._route,
                        "status": error.status,
                        "error_class": error.error_class,
                        "error_message": error.message,
                        "tier": tier,
                    },
                )
            span.end()
        finally:
            otel_context.detach(token)
