"""OpenTelemetry tracing: the tracer provider, the OTLP exporter, and span helpers.

`build_tracer_provider` makes a `TracerProvider` that batches spans to an OTLP/gRPC endpoint;
it is an object the daemon owns and passes around, never installed as the global provider, so
tests and benchmarks can run several side by side. Its sampler keeps `--trace-sample-ratio` of
the traces, and a root span that links to sampled spans (an engine step, linked to the requests
it served) is sampled with them (`FollowLinksSampler`), so a sampled request keeps every step.
`MonotonicClock` turns the engine's `time.monotonic()` stamps into the epoch nanoseconds spans
need, so engine spans are made after the fact with explicit start and end times (cheaper than
keeping spans open across steps).

Which spans exist is decided by `telemetry.py` (engine), `sitsd.api.telemetry` (server spans)
and `swap.py` (swap traces); the resource and exporter settings come from `ObservabilityConfig`.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import (
    Decision,
    ParentBased,
    Sampler,
    SamplingResult,
    TraceIdRatioBased,
)
from opentelemetry.trace import Link, Span, SpanKind
from opentelemetry.trace.span import TraceState
from opentelemetry.util.types import Attributes

from sitsd import __version__
from sitsd.config import ObservabilityConfig

INSTRUMENTATION_NAME = "sitsd"


def build_resource(config: ObservabilityConfig) -> Resource:
    """The OTel resource of this process: service name, version, instance, and the extras.

    `Resource(...)`, not `Resource.create(...)`: the latter reads `OTEL_*` variables itself, and
    only `sitsd.cli` reads the environment (it put them into `config` already).
    """
    attributes: dict[str, str] = {
        "service.name": config.service_name,
        "service.version": __version__,
        "service.instance.id": f"{socket.gethostname()}:{os.getpid()}",
        "telemetry.sdk.language": "python",
        "telemetry.sdk.name": "opentelemetry",
    }
    attributes.update(dict(config.resource_attributes))
    return Resource(attributes)


def otlp_span_exporter(config: ObservabilityConfig) -> SpanExporter:
    """The OTLP/gRPC span exporter for `config.otlp_endpoint`."""
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter(
        endpoint=config.otlp_endpoint,
        insecure=config.otlp_insecure,
        headers=dict(config.otlp_headers) or None,
    )


def build_tracer_provider(
    config: ObservabilityConfig, resource: Resource, exporter: SpanExporter | None = None
) -> TracerProvider | None:
    """A provider batching spans to `exporter` (default: OTLP to `config.otlp_endpoint`).

    Returns None when there is nowhere to export to: the daemon then traces nothing.
    """
    if exporter is None:
        if not config.otlp_endpoint:
            return None
        exporter = otlp_span_exporter(config)
    sampler = ParentBased(FollowLinksSampler(TraceIdRatioBased(config.trace_sample_ratio)))
    provider = TracerProvider(resource=resource, sampler=sampler)
    provider.add_span_processor(BatchSpanProcessor(exporter))
    return provider


class FollowLinksSampler(Sampler):
    """Samples a span that links to a sampled span; asks `root` about the others."""

    def __init__(self, root: Sampler) -> None:
        self._root = root

    def should_sample(
        self,
        parent_context: Context | None,
        trace_id: int,
        name: str,
        kind: SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[Link] | None = None,
        trace_state: TraceState | None = None,
    ) -> SamplingResult:
        if links and any(link.context.trace_flags.sampled for link in links):
            return SamplingResult(Decision.RECORD_AND_SAMPLE, attributes, trace_state)
        return self._root.should_sample(
            parent_context, trace_id, name, kind, attributes, links, trace_state
        )

    def get_description(self) -> str:
        return f"FollowLinks{{{self._root.get_description()}}}"


def tracer_of(provider: TracerProvider | None) -> trace.Tracer:
    """sitsd's tracer from `provider`; a no-op tracer when there is none."""
    if provider is None:
        return trace.NoOpTracer()
    return provider.get_tracer(INSTRUMENTATION_NAME, __version__)


def current_request_span() -> Span | None:
    """The recording span of the RPC being served (set by `sitsd.api.telemetry`), or None.

    The API hands it to the engine as the request's trace context: engine spans become its
    children and the request's telemetry lands on it.
    """
    span = trace.get_current_span()
    return span if span.is_recording() else None


def trace_id_hex(span: Span) -> str:
    """The 32-hex-digit trace id of `span` (as Jaeger, Loki and exemplars write it)."""
    return format(span.get_span_context().trace_id, "032x")


class MonotonicClock:
    """Converts `time.monotonic()` seconds to epoch nanoseconds (the offset is taken once)."""

    def __init__(self) -> None:
        self.offset_ns = time.time_ns() - time.monotonic_ns()

    def ns(self, monotonic_s: float) -> int:
        return int(monotonic_s * 1e9) + self.offset_ns
