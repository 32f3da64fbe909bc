"""Engine telemetry: an `EngineObserver` that turns engine events into metrics, spans and logs.

Per request (on the engine thread, parented to the request's server span when it is traced):

    queue        arrival -> first scheduling            sitsd_request_queue_time_seconds
    prefill      one span per prefill chunk (a step)    sitsd_request_prefill_time_seconds
    preemption   preempted -> rescheduled               sitsd_num_preemptions_total
    decode       first token -> last token              sitsd_request_decode_time_seconds
    (first token: sitsd_time_to_first_token_seconds; each next one: inter-token latency;
     at the end: e2e latency, finish reason, the GenAI usage attributes and one log line)

Per step: one `engine.step` span linked to the spans of the requests it served, and the batch
size, token count and duration histograms. Cost is kept per step, not per token: engine spans
are created after the fact with explicit times, metric children are resolved once per tier,
exemplar labels once per request, and the span exporter works on its own thread.

What the metrics are is `metrics.py`'s; server spans and error classes are
`sitsd.api.telemetry`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, Span

from sitsd.engine.observer import StepRecord
from sitsd.engine.request import Request
from sitsd.observability.metrics import Metrics
from sitsd.observability.tracing import MonotonicClock, trace_id_hex
from sitsd.outputs import EngineStatus
from sitsd.types import FinishReason, Tier

log = logging.getLogger("sitsd.requests")

_EMPTY_CONTEXT = otel_context.Context()  # parent of root spans (steps), whatever is current
_SUCCESS = (FinishReason.STOP, FinishReason.LENGTH)


class _TierMetrics:
    """The metric children of one (model, tier), resolved once."""

    def __init__(self, m: Metrics, tier: str) -> None:
        labels = (m.model, tier)
        self.ttft = m.time_to_first_token.labels(*labels)
        self.itl = m.inter_token_latency.labels(*labels)
        self.e2e = m.e2e_request_latency.labels(*labels)
        self.queue = m.request_queue_time.labels(*labels)
        self.prefill = m.request_prefill_time.labels(*labels)
        self.decode = m.request_decode_time.labels(*labels)
        self.prompt_tokens = m.prompt_tokens.labels(*labels)
        self.generation_tokens = m.generation_tokens.labels(*labels)
        self.prefix_queries = m.prefix_cache_queries.labels(*labels)
        self.prefix_hits = m.prefix_cache_hits.labels(*labels)
        self.preemptions = m.preemptions.labels(*labels)
        self.running = m.num_requests_running.labels(*labels)
        self.waiting = m.num_requests_waiting.labels(*labels)
        self.finished = {r: m.requests_finished.labels(*labels, r.value) for r in FinishReason}


@dataclass(slots=True, eq=False)
class _Live:
    """What telemetry keeps of one live request."""

    request: Request
    tier: _TierMetrics
    span: Span | None = None  # the request's server span, when traced
    parent: otel_context.Context | None = None  # context holding `span`
    link: list[Link] = field(default_factory=list)  # [Link to span], reused by every step
    exemplar: dict[str, str] | None = None  # {"trace_id": ...} for latency histograms
    running: bool = False
    admitted: bool = False  # scheduled at least once
    recomputing: bool = False  # preempted and not yet sampling again
    preempted_at: float | None = None
    last_token_time: float | None = None
    num_prefill_chunks: int = 0


class EngineTelemetry:
    """Implements `sitsd.engine.observer.EngineObserver` with metrics, spans and logs."""

    def __init__(
        self, metrics: Metrics, tracer: trace.Tracer | None = None, *, step_spans: bool = True
    ) -> None:
        """Args:
        metrics: where to record; its `model` label is bound when the engine starts.
        tracer: makes the engine spans; None or a no-op tracer = metrics and logs only.
        step_spans: make one `engine.step` span per step (linked to its requests).
        """
        self.metrics = metrics
        self.tracer = tracer or trace.NoOpTracer()
        self.step_spans = step_spans and not isinstance(self.tracer, trace.NoOpTracer)
        self.clock = MonotonicClock()
        self._live: dict[str, _Live] = {}
        self._tiers: dict[Tier, _TierMetrics] = {}
        self._step_metrics: tuple[Any, Any, Any] | None = None
        self._kv_usage: Any | None = None
        self._last_tiers: tuple = ()  # (tier, cap, ttft p99, itl p99) last exported
        self.model = metrics.model

    # ----------------------------------------------------------------------- engine hooks

    def on_engine_started(self, model: str, weights_version: str) -> None:
        self.model = model
        self.metrics.bind_model(model)
        self.metrics.set_weights_version(weights_version)
        m = self.metrics
        self._tiers = {tier: _TierMetrics(m, tier.value) for tier in Tier}
        self._step_metrics = (
            m.batch_size.labels(model),
            m.step_tokens.labels(model),
            m.step_duration.labels(model),
        )
        self._kv_usage = m.kv_cache_usage.labels(model)
        for tier in self._tiers.values():  # every tier shows, at zero, from the start
            tier.running.set(0)
            tier.waiting.set(0)

    def on_request_added(self, request: Request) -> None:
        tier = self._tiers[request.tier]
        live = _Live(request, tier)
        span = request.trace_context
        if isinstance(span, Span) and span.is_recording():
            live.span = span
            live.parent = trace.set_span_in_context(span)
            live.link = [Link(span.get_span_context())]
            live.exemplar = {"trace_id": trace_id_hex(span)}
            params = request.params
            span.set_attributes(
                {
                    "gen_ai.request.model": self.model,
                    "gen_ai.response.model": self.model,
                    "gen_ai.request.max_tokens": params.max_tokens,
                    "gen_ai.request.temperature": params.temperature,
                    "gen_ai.request.top_p": params.top_p,
                    "gen_ai.request.top_k": params.top_k,
                    "gen_ai.response.id": request.req_id,
                    "gen_ai.usage.input_tokens": request.num_prompt_tokens,
                    "sitsd.tier": request.tier.value,
                    "sitsd.weights_version": request.weights_version,
                }
            )
        self._live[request.req_id] = live
        tier.waiting.inc()

    def on_request_preempted(self, request: Request, now: float) -> None:
        live = self._live.get(request.req_id)
        if live is None:
            return
        if live.running:
            live.running = False
            live.tier.running.dec()
            live.tier.waiting.inc()
        live.preempted_at = now
        live.recomputing = True
        live.tier.preemptions.inc()

    def on_step(self, step: StepRecord) -> None:
        sched_out = step.sched_out
        scheduled = sched_out.num_scheduled_tokens
        for new in sched_out.new_reqs:
            live = self._live.get(new.req_id)
            if live is not None:
                self._on_scheduled(live, step.start)
        links: list[Link] = []
        num_prefill_tokens = 0
        for req_id, num_tokens in scheduled.items():
            live = self._live.get(req_id)
            if live is None:
                continue
            links += live.link
            if num_tokens > 1 or live.last_token_time is None or live.recomputing:
                num_prefill_tokens += num_tokens
                self._prefill_chunk(live, num_tokens, step)
        for update in step.updates:
            live = self._live.get(update.request.req_id)
            if live is not None:
                self._on_tokens(live, update.request, len(update.new_token_ids))
        if self._step_metrics is not None:
            batch_size, step_tokens, step_duration = self._step_metrics
            batch_size.observe(len(scheduled))
            step_tokens.observe(sched_out.total_num_scheduled_tokens)
            step_duration.observe(step.end - step.start)
        if self.step_spans:
            self._step_span(step, links, num_prefill_tokens)

    def on_request_finished(self, request: Request, now: float) -> None:
        live = self._live.pop(request.req_id, None)
        if live is None:
            return
        tier = live.tier
        (tier.running if live.running else tier.waiting).dec()
        reason = request.finish_reason or FinishReason.ABORT
        tier.finished[reason].inc()
        succeeded = reason in _SUCCESS
        first, last = request.first_token_time, request.last_token_time
        if succeeded:
            tier.e2e.observe(now - request.arrival_time, live.exemplar)
            if first is not None and last is not None:
                tier.decode.observe(last - first, live.exemplar)
        if live.span is not None:
            self._finish_span(live, request, reason, now)
        self._log_finished(live, request, reason, now)

    def on_status(self, status: EngineStatus) -> None:
        if status.num_blocks_total and self._kv_usage is not None:
            self._kv_usage.set(status.num_blocks_used / status.num_blocks_total)
        tiers = tuple((t.tier, t.batch_cap, t.ttft_p99_s, t.itl_p99_s) for t in status.tiers)
        if tiers != self._last_tiers:  # the gauges change only when the scheduler's view does
            self._last_tiers = tiers
            for tier, cap, ttft_p99, itl_p99 in tiers:
                self.metrics.set_tier_batch_cap(tier, cap)
                if ttft_p99 is not None:
                    self.metrics.set_tier_p99_estimate(tier, "ttft", ttft_p99)
                if itl_p99 is not None:
                    self.metrics.set_tier_p99_estimate(tier, "itl", itl_p99)

    # -------------------------------------------------------------------------- hot-swap

    def on_request_migrated(
        self, request: Request, start: float, end: float, from_version: str, to_version: str
    ) -> None:
        """Engine hook: a swap recomputed the request's KV under new weights."""
        self.record_migration(request, start, end, from_version, to_version)

    def record_migration(
        self, request: Request, start: float, end: float, from_version: str, to_version: str
    ) -> None:
        """A `migration` span on `request` (its KV recomputed under new weights), engine thread."""
        live = self._live.get(request.req_id)
        if live is None or live.parent is None:
            return
        span = self.tracer.start_span(
            "migration",
            context=live.parent,
            start_time=self.clock.ns(start),
            attributes={
                "sitsd.weights_version.from": from_version,
                "sitsd.weights_version.to": to_version,
            },
        )
        span.end(end_time=self.clock.ns(end))

    # ----------------------------------------------------------------------------- helpers

    def _on_scheduled(self, live: _Live, step_start: float) -> None:
        """The request entered the batch: first admission, or back after a preemption."""
        request = live.request
        if not live.running:
            live.running = True
            live.tier.waiting.dec()
            live.tier.running.inc()
        if not live.admitted:
            live.admitted = True
            scheduled_at = request.first_scheduled_time or step_start
            live.tier.queue.observe(scheduled_at - request.arrival_time, live.exemplar)
            live.tier.prompt_tokens.inc(request.num_prompt_tokens)
            live.tier.prefix_queries.inc(request.num_prompt_tokens)
            live.tier.prefix_hits.inc(max(request.num_cached_tokens, 0))
            self._child_span(live, "queue", request.arrival_time, scheduled_at, None)
        elif live.preempted_at is not None:
            self._child_span(
                live,
                "preemption",
                live.preempted_at,
                step_start,
                {"sitsd.num_preemptions": request.num_preemptions},
            )
            live.preempted_at = None

    def _prefill_chunk(self, live: _Live, num_tokens: int, step: StepRecord) -> None:
        live.num_prefill_chunks += 1
        if live.parent is not None:
            request = live.request
            self._child_span(
                live,
                "prefill",
                step.start,
                step.end,
                {
                    "sitsd.chunk.index": live.num_prefill_chunks - 1,
                    "sitsd.chunk.num_tokens": num_tokens,
                    "sitsd.chunk.first_token": request.num_computed_tokens - num_tokens,
                    "sitsd.recompute": live.recomputing,
                },
            )

    def _on_tokens(self, live: _Live, request: Request, num_new: int) -> None:
        now = request.last_token_time
        tier = live.tier
        tier.generation_tokens.inc(num_new)
        if live.last_token_time is None:
            if request.first_token_time is not None:
                tier.ttft.observe(request.first_token_time - request.arrival_time, live.exemplar)
                if request.first_scheduled_time is not None:
                    tier.prefill.observe(
                        request.first_token_time - request.first_scheduled_time, live.exemplar
                    )
        elif now is not None:
            tier.itl.observe(now - live.last_token_time, live.exemplar)
        live.last_token_time = now
        live.recomputing = False

    def _child_span(
        self,
        live: _Live,
        name: str,
        start: float,
        end: float,
        attributes: dict[str, Any] | None,
    ) -> None:
        if live.parent is None:
            return
        span = self.tracer.start_span(
            name, context=live.parent, start_time=self.clock.ns(start), attributes=attributes
        )
        span.end(end_time=self.clock.ns(end))

    def _step_span(self, step: StepRecord, links: list[Link], num_prefill_tokens: int) -> None:
        sched_out = step.sched_out
        span = self.tracer.start_span(
            "engine.step",
            context=_EMPTY_CONTEXT,
            start_time=self.clock.ns(step.start),
            links=links,
            attributes={
                "sitsd.batch_size": len(sched_out.num_scheduled_tokens),
                "sitsd.num_tokens": sched_out.total_num_scheduled_tokens,
                "sitsd.num_prefill_tokens": num_prefill_tokens,
                "sitsd.num_new_requests": len(sched_out.new_reqs),
                "sitsd.num_preempted": len(sched_out.preempted_req_ids),
                "sitsd.model": self.model,
            },
        )
        span.end(end_time=self.clock.ns(step.end))

    def _finish_span(self, live: _Live, request: Request, reason: FinishReason, now: float) -> None:
        first, last = request.first_token_time, request.last_token_time
        if first is not None and last is not None:
            self._child_span(
                live,
                "decode",
                first,
                last,
                {"gen_ai.usage.output_tokens": request.num_output_tokens},
            )
        span = live.span
        if span is None or not span.is_recording():  # the RPC may have ended first (cancel)
            return
        attributes: dict[str, Any] = {
            "gen_ai.usage.output_tokens": request.num_output_tokens,
            "gen_ai.usage.cache_read.input_tokens": max(request.num_cached_tokens, 0),
            "gen_ai.response.finish_reasons": [reason.value],
            "sitsd.prefix_cache.hit_tokens": max(request.num_cached_tokens, 0),
            "sitsd.num_preemptions": request.num_preemptions,
            "sitsd.num_prefill_chunks": live.num_prefill_chunks,
            "sitsd.weights_version": request.weights_version,
        }
        if first is not None:
            attributes["gen_ai.response.time_to_first_chunk"] = first - request.arrival_time
        if request.first_scheduled_time is not None:
            attributes["sitsd.queue_time_s"] = request.first_scheduled_time - request.arrival_time
        span.set_attributes(attributes)

    def _log_finished(
        self, live: _Live, request: Request, reason: FinishReason, now: float
    ) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        first = request.first_token_time
        extra = {
            "req_id": request.req_id,
            "tier": request.tier.value,
            "finish_reason": reason.value,
            "prompt_tokens": request.num_prompt_tokens,
            "output_tokens": request.num_output_tokens,
            "cached_tokens": max(request.num_cached_tokens, 0),
            "num_preemptions": request.num_preemptions,
            "e2e_s": round(now - request.arrival_time, 6),
            "weights_version": request.weights_version,
        }
        if first is not None:  # no None values: OTLP attributes cannot hold them
            extra["ttft_s"] = round(first - request.arrival_time, 6)
        # Log inside the request's span context: trace_id/span_id land on the record.
        token = otel_context.attach(live.parent) if live.parent is not None else None
        try:
            log.info("request finished", extra=extra)
        finally:
            if token is not None:
                otel_context.detach(token)
