"""Weight swaps as telemetry: each swap is a trace of its own, each stage a span and a metric.

The hot-swap code (another subsystem, later) drives it:

    swap = SwapTrace(tracer, metrics, from_version="m@1", to_version="m@2")
    with swap.stage("stage"):      # load into the standby slot
        ...
    with swap.stage("validate"):
        ...
    swap.finish("committed")       # or rejected / failed / rolled_back

A stage records `sitsd_swap_stage_duration_seconds{stage}` and a child span; `finish` counts
`sitsd_swaps_total{outcome}` and, on a commit, publishes the new weights version. What a stage
does is the swap code's business.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Span, Status, StatusCode

from sitsd.observability.metrics import Metrics

COMMITTED = "committed"


class SwapTrace:
    """One weight swap: a root span `weights.swap` with one child span per stage."""

    def __init__(
        self, tracer: trace.Tracer, metrics: Metrics, *, from_version: str, to_version: str
    ) -> None:
        self.metrics = metrics
        self.to_version = to_version
        self._tracer = tracer
        self.span: Span = tracer.start_span(
            "weights.swap",
            context=otel_context.Context(),  # a trace of its own, whatever is current
            attributes={
                "sitsd.model": metrics.model,
                "sitsd.weights_version.from": from_version,
                "sitsd.weights_version.to": to_version,
            },
        )
        self._context = trace.set_span_in_context(self.span)
        self.stage_seconds: dict[str, float] = {}

    @contextmanager
    def stage(self, name: str) -> Iterator[Span]:
        """Time one stage; an exception marks its span failed and propagates."""
        span = self._tracer.start_span(f"swap.{name}", context=self._context)
        started = time.monotonic()
        try:
            yield span
        except BaseException as exc:
            span.record_exception(exc)
            span.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
            raise
        finally:
            seconds = time.monotonic() - started
            span.end()
            self.stage_seconds[name] = seconds
            self.metrics.record_swap_stage(name, seconds)

    def finish(self, outcome: str, error: str = "") -> None:
        """End the swap with `outcome` (committed, rejected, failed, rolled_back)."""
        self.span.set_attribute("sitsd.swap.outcome", outcome)
        if error:
            self.span.set_status(Status(StatusCode.ERROR, error))
        self.span.end()
        self.metrics.record_swap(outcome)
        if outcome == COMMITTED:
            self.metrics.set_weights_version(self.to_version)
