"""The spans of one request's life in the engine, children of its server span.

Made after the fact with the engine's `time.monotonic()` stamps (`MonotonicClock`), so no span
stays open across steps:

    queue        arrival -> first scheduling, or -> its end when it never ran (refused, shed,
                 cancelled or out of time while queued): where it stood at arrival (position,
                 requests ahead by tier, the batch it waited to join), the engine steps that ran
                 while it waited, how the wait ended (`sitsd.queue.outcome`)
    prefill      one per prompt chunk (a step), linked to that step's `engine.step` span
    decode       one per stretch of decoding: a stretch's first token -> its last; a
                 preemption ends a stretch, so preempted time is never decode time; the steps
                 that computed it (`sitsd.step.indexes`)
    preemption   preempted -> scheduled again (or -> its end): why (blocks, tier, swap) and for
                 whom (`sitsd.preemption.for_request_id`, `.for_tier`)
    migration    a weight swap recomputed its KV under new weights

and the server span's own attributes: the GenAI request, response and usage attributes, the
tier, the request id and how the request ended (`sitsd.finish_reason`: refused, shed,
deadline, cancelled, error, ...). When a span is made, what it times and what the metrics
record are `telemetry.py`'s.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import Token

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span, SpanContext
from opentelemetry.util.types import AttributeValue

from sitsd.engine.admission import QueuePlace, Refusal
from sitsd.engine.request import Request
from sitsd.observability.tracing import MonotonicClock, trace_id_hex
from sitsd.outputs import Preemption
from sitsd.types import TIER_ORDER, EndReason, FinishReason

Attributes = dict[str, AttributeValue]


class RequestTrace:
    """The spans of one traced request (its server span records); see the module docstring."""

    def __init__(self, tracer: trace.Tracer, clock: MonotonicClock, span: Span) -> None:
        self._tracer = tracer
        self._clock = clock
        self.span = span  # the request's server span
        self.parent = trace.set_span_in_context(span)  # context holding `span`
        self.link = [Link(span.get_span_context())]  # reused by every step that serves it
        self.exemplar = {"trace_id": trace_id_hex(span)}  # for the latency histograms

    @staticmethod
    def of(tracer: trace.Tracer, clock: MonotonicClock, request: Request) -> RequestTrace | None:
        """The request's trace when its trace context is a recording span, else None."""
        span = request.trace_context
        if isinstance(span, Span) and span.is_recording():
            return RequestTrace(tracer, clock, span)
        return None

    # ------------------------------------------------------------------------ the spans

    def child(
        self,
        name: str,
        start: float,
        end: float,
        attributes: Mapping[str, AttributeValue],
        links: list[Link] | None = None,
    ) -> None:
        """A child span `name` of the server span, from `start` to `end` (monotonic s)."""
        span = self._tracer.start_span(
            name,
            context=self.parent,
            start_time=self._clock.ns(start),
            attributes=attributes,
            links=links,
        )
        span.end(end_time=self._clock.ns(max(start, end)))

    def queue(self, start: float, end: float, wait: QueueWait) -> None:
        self.child("queue", start, end, wait.attributes())

    def prefill(
        self,
        start: float,
        end: float,
        chunk: Mapping[str, AttributeValue],
        step: SpanContext | None,
    ) -> None:
        self.child("prefill", start, end, chunk, None if step is None else [Link(step)])

    def decode(self, start: float, end: float, num_tokens: int, step_indexes: list[int]) -> None:
        attributes: Attributes = {
            "gen_ai.usage.output_tokens": num_tokens,  # this stretch's tokens
            "sitsd.step.indexes": step_indexes,
        }
        self.child("decode", start, end, attributes)

    def preemption(
        self, start: float, end: float, preemption: Preemption, num_preemptions: int
    ) -> None:
        attributes: Attributes = {
            "sitsd.preemption.reason": preemption.reason.value,
            "sitsd.preemption.for_request_id": preemption.for_req_id,
            "sitsd.preemption.for_tier": preemption.for_tier,
            "sitsd.num_preemptions": num_preemptions,
        }
        self.child("preemption", start, end, attributes)

    # ------------------------------------------------------------- the server span itself

    def describe(self, request: Request, model: str) -> None:
        """The request's GenAI request attributes, tier and ids on its server span."""
        params = request.params
        self.span.set_attributes(
            {
                "gen_ai.request.model": model,
                "gen_ai.response.model": model,
                "gen_ai.request.max_tokens": params.max_tokens,
                "gen_ai.request.temperature": params.temperature,
                "gen_ai.request.top_p": params.top_p,
                "gen_ai.request.top_k": params.top_k,
                "gen_ai.response.id": request.req_id,
                "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                "sitsd.request_id": request.req_id,
                "sitsd.tier": request.tier.value,
                "sitsd.weights_version": request.weights_version,
            }
        )

    def finished(
        self, request: Request, end: EndReason, extra: Mapping[str, AttributeValue]
    ) -> None:
        """How the request ended, on its server span (if the call has not ended first): the
        client's finish reason as GenAI has it, what happened as `sitsd.finish_reason`."""
        if not self.span.is_recording():  # the RPC may have ended first (cancel)
            return
        cached = max(request.num_cached_tokens, 0)
        answered = request.finish_reason or FinishReason.ABORT  # refused: never finished
        attributes: Attributes = {
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": cached,
            "gen_ai.response.finish_reasons": [answered.value],
            "sitsd.finish_reason": end.value,
            "sitsd.prefix_cache.hit_tokens": cached,
            "sitsd.num_preemptions": request.num_preemptions,
            "sitsd.weights_version": request.weights_version,
            **extra,
        }
        first = request.first_token_time
        if first is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = first - request.arrival_time
        if request.first_scheduled_time is not None:
            attributes["sitsd.queue_time_s"] = request.first_scheduled_time - request.arrival_time
        self.span.set_attributes(attributes)

    def attach(self) -> Token[otel_context.Context]:
        """Make the server span current (log records get its ids); `otel_context.detach` it."""
        return otel_context.attach(self.parent)


class QueueWait:
    """What a request waited for in the queue, as its `queue` span tells it."""

    def __init__(self, place: QueuePlace, first_step: int) -> None:
        """Args:
        place: where it stood when it arrived.
        first_step: the index of the first engine step that could have served it.
        """
        self.place = place
        self.first_step = first_step
        self.outcome = "scheduled"  # or how it ended while queued (an `EndReason` value)
        self.last_step = first_step - 1  # the last step that ran while it waited
        self.refusal: Refusal | None = None

    def attributes(self) -> Attributes:
        place = self.place
        attributes: Attributes = {
            "sitsd.queue.outcome": self.outcome,
            "sitsd.queue.position": place.position,
            "sitsd.queue.num_running": place.num_running,
            "sitsd.queue.num_steps_waited": max(0, self.last_step - self.first_step + 1),
        }
        for tier in TIER_ORDER:
            attributes[f"sitsd.queue.ahead.{tier.value}"] = place.num_ahead.get(tier, 0)
        if self.last_step >= self.first_step:
            attributes["sitsd.queue.first_step_index"] = self.first_step
            attributes["sitsd.queue.last_step_index"] = self.last_step
        if self.refusal is not None:
            attributes["sitsd.queue.expected_wait_s"] = self.refusal.expected_wait_s
            attributes["sitsd.queue.max_wait_s"] = self.refusal.limit_s
            attributes["sitsd.queue.refusal"] = self.refusal.message
        return attributes
