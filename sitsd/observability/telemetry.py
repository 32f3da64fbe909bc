"""Engine telemetry: an `EngineObserver` that turns engine events into metrics, spans and logs.

Per request (on the engine thread; spans are children of the request's server span when it is
traced, `request_trace.py` says what each holds):

    queue        arrival -> first scheduling, or its end   sitsd_request_queue_time_seconds
    prefill      one span per prompt chunk (a step)        sitsd_request_prefill_time_seconds
    decode       each stretch of decoding                  sitsd_request_decode_time_seconds
    preemption   preempted -> rescheduled                  sitsd_num_preemptions_total{reason}
    (first token: sitsd_time_to_first_token_seconds; each next one: inter-token latency;
     at the end: e2e latency, sitsd_requests_finished_total{finish_reason} with what happened
     (an `EndReason`: stop, length, refused, shed, deadline, cancelled, shutdown, error), the
     GenAI usage attributes and one log line)

Decode time is the sum of the decode stretches: time spent preempted (and recomputing) is the
preemption's, never decode time. A request admission control refuses gets its queue span,
its finish reason and its log line too (`on_request_refused`, which may run on the API's
thread: it touches no per-request state).

Per step: one `engine.step` span, numbered (`sitsd.step.index`, which the request spans name)
and linked to the spans of the traced requests it served; made only when it serves one and
sampled with them (`tracing.FollowLinksSampler`); and the batch size, token count and duration
histograms. Cost is kept per step, not per token: engine spans are created after the fact with
explicit times, metric children are resolved once per tier, exemplar labels once per request,
and the span exporter works on its own thread.

What the metrics are is `metrics.py`'s; server spans and error classes are
`sitsd.api.telemetry`'s.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace import Link, SpanContext

from sitsd.engine.admission import QueuePlace, Refusal
from sitsd.engine.observer import StepRecord
from sitsd.engine.request import Request
from sitsd.observability.metrics import Metrics
from sitsd.observability.request_trace import QueueWait, RequestTrace
from sitsd.observability.slow_steps import SlowStepLog
from sitsd.observability.tracing import MonotonicClock
from sitsd.outputs import EngineStatus, Preemption, PreemptionReason
from sitsd.types import EndReason, FinishReason, Tier

log = logging.getLogger("sitsd.requests")

_EMPTY_CONTEXT = otel_context.Context()  # parent of root spans (steps), whatever is current
_SUCCESS = (EndReason.STOP, EndReason.LENGTH)
# A request finished without `end_reason` (none today) counts as what its finish reason says.
_END_OF = {
    FinishReason.STOP: EndReason.STOP,
    FinishReason.LENGTH: EndReason.LENGTH,
    FinishReason.ABORT: EndReason.CANCELLED,
    FinishReason.ERROR: EndReason.ERROR,
}


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
        self.preemptions = {r: m.preemptions.labels(*labels, r) for r in PreemptionReason}
        self.running = m.num_requests_running.labels(*labels)
        self.waiting = m.num_requests_waiting.labels(*labels)
        self.finished = {r: m.requests_finished.labels(*labels, r) for r in EndReason}


@dataclass(slots=True, eq=False)
class _Live:
    """What telemetry keeps of one live request."""

    request: Request
    tier: _TierMetrics
    wait: QueueWait  # where it queued, until it first runs
    trace: RequestTrace | None = None  # its spans, when it is traced
    running: bool = False
    admitted: bool = False  # scheduled at least once
    recomputing: bool = False  # preempted and not yet sampling again
    preempted: tuple[float, Preemption] | None = None  # since when, and why
    last_token_time: float | None = None
    stretch_start: float | None = None  # first token of the decode stretch under way
    stretch_tokens: int = 0  # tokens of that stretch
    stretch_steps: list[int] = field(default_factory=list)  # steps that decoded in it
    decode_s: float = 0.0  # the finished decode stretches
    num_prefill_chunks: int = 0
    num_steps: int = 0  # steps that computed its tokens

    @property
    def exemplar(self) -> dict[str, str] | None:
        return None if self.trace is None else self.trace.exemplar


class EngineTelemetry:
    """Implements `sitsd.engine.observer.EngineObserver` with metrics, spans and logs."""

    def __init__(
        self,
        metrics: Metrics,
        tracer: trace.Tracer | None = None,
        *,
        step_spans: bool = True,
        slow_steps: SlowStepLog | None = None,
    ) -> None:
        """Args:
        metrics: where to record; its `model` label is bound when the engine starts.
        tracer: makes the engine spans; None or a no-op tracer = metrics and logs only.
        step_spans: make one `engine.step` span per step (linked to its requests).
        slow_steps: which steps are logged as slow (default: `SlowStepLog`'s defaults).
        """
        self.metrics = metrics
        self.tracer = tracer or trace.NoOpTracer()
        self.step_spans = step_spans and not isinstance(self.tracer, trace.NoOpTracer)
        self.clock = MonotonicClock()
        self._live: dict[str, _Live] = {}
        self._tiers: dict[Tier, _TierMetrics] = {}
        self._last_step = 0  # index of the last step observed
        self._last_tiers: tuple[tuple[str, int, float | None, float | None], ...] = ()
        self.model = metrics.model
        self.slow_steps = slow_steps or SlowStepLog()  # a step far past the recent ones: logged

    # ----------------------------------------------------------------------- engine hooks

    def on_engine_started(self, model: str, weights_version: str) -> None:
        self.model = model
        self.metrics.bind_model(model)
        self.metrics.set_weights_version(weights_version)
        self._tiers = {tier: _TierMetrics(self.metrics, tier.value) for tier in Tier}
        for tier in self._tiers.values():  # every tier shows, at zero, from the start
            tier.running.set(0)
            tier.waiting.set(0)

    def on_request_added(self, request: Request, place: QueuePlace) -> None:
        tier = self._tiers[request.tier]
        request_trace = RequestTrace.of(self.tracer, self.clock, request)
        if request_trace is not None:
            request_trace.describe(request, self.model)
        wait = QueueWait(place, first_step=self._last_step + 1)
        self._live[request.req_id] = _Live(request, tier, wait, request_trace)
        tier.waiting.inc()

    def on_request_refused(self, request: Request, now: float, refusal: Refusal) -> None:
        """Maybe on the API's thread (the early check): reads no per-request state."""
        tier = self._tiers.get(request.tier)
        if tier is None:  # the engine has not started
            return
        tier.finished[EndReason.REFUSED].inc()
        request_trace = RequestTrace.of(self.tracer, self.clock, request)
        if request_trace is not None:
            request_trace.describe(request, self.model)
            wait = QueueWait(refusal.place, first_step=self._last_step + 1)
            wait.outcome, wait.refusal = EndReason.REFUSED.value, refusal
            request_trace.queue(request.arrival_time, now, wait)
            request_trace.finished(request, EndReason.REFUSED, {"error.type": "refused"})
        self._log_finished(request, request_trace, EndReason.REFUSED, now)

    def on_request_preempted(self, request: Request, now: float, preemption: Preemption) -> None:
        live = self._live.get(request.req_id)
        if live is None:
            return
        if live.running:
            live.running = False
            live.tier.running.dec()
            live.tier.waiting.inc()
        self._end_stretch(live)
        live.preempted = (now, preemption)
        live.recomputing = True
        live.tier.preemptions[preemption.reason].inc()

    def on_step(self, step: StepRecord) -> None:
        self._last_step = step.index
        sched_out = step.sched_out
        for new in sched_out.new_reqs:
            live = self._live.get(new.req_id)
            if live is not None:
                self._on_scheduled(live, step)
        served: list[tuple[_Live, int, bool]] = []  # (request, tokens, prompt tokens?)
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            live = self._live.get(req_id)
            if live is not None:
                served.append((live, num_tokens, _is_prefill(live, num_tokens)))
        num_prefill_tokens = sum(n for _, n, prefill in served if prefill)
        step_span = self._step_span(step, [live for live, _, _ in served], num_prefill_tokens)
        for live, num_tokens, prefill in served:
            live.num_steps += 1
            if prefill:
                self._prefill_chunk(live, num_tokens, step, step_span)
            else:
                live.stretch_steps.append(step.index)
        for update in step.updates:
            live = self._live.get(update.request.req_id)
            if live is not None:
                self._on_tokens(live, update.request, len(update.new_token_ids))
        self.metrics.observe_step(
            len(sched_out.num_scheduled_tokens),
            sched_out.total_num_scheduled_tokens,
            step.end - step.start,
        )
        self.slow_steps.observe(step)

    def on_request_finished(self, request: Request, now: float) -> None:
        live = self._live.pop(request.req_id, None)
        if live is None:
            return
        tier = live.tier
        (tier.running if live.running else tier.waiting).dec()
        end = request.end_reason or _END_OF[request.finish_reason or FinishReason.ABORT]
        tier.finished[end].inc()
        self._end_stretch(live)
        if end in _SUCCESS:
            tier.e2e.observe(now - request.arrival_time, live.exemplar)
            if request.first_token_time is not None:
                tier.decode.observe(live.decode_s, live.exemplar)
        request_trace = live.trace
        if request_trace is not None:
            if not live.admitted:  # it ended in the queue
                live.wait.outcome, live.wait.last_step = end.value, self._last_step
                request_trace.queue(request.arrival_time, now, live.wait)
            elif live.preempted is not None:  # it ended preempted
                since, preemption = live.preempted
                request_trace.preemption(since, now, preemption, request.num_preemptions)
            extra = {"sitsd.num_prefill_chunks": live.num_prefill_chunks,
                     "sitsd.num_steps": live.num_steps}  # fmt: skip
            request_trace.finished(request, end, extra)
        self._log_finished(request, request_trace, end, now)

    def on_status(self, status: EngineStatus) -> None:
        if status.num_blocks_total:
            self.metrics.set_kv_cache_usage(status.num_blocks_used / status.num_blocks_total)
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
        if live is None or live.trace is None:
            return
        versions = {"sitsd.weights_version.from": from_version,
                    "sitsd.weights_version.to": to_version}  # fmt: skip
        live.trace.child("migration", start, end, versions)

    # ----------------------------------------------------------------------------- helpers

    def _on_scheduled(self, live: _Live, step: StepRecord) -> None:
        """The request entered the batch: first admission, or back after a preemption."""
        request = live.request
        if not live.running:
            live.running = True
            live.tier.waiting.dec()
            live.tier.running.inc()
        if not live.admitted:
            live.admitted = True
            scheduled_at = request.first_scheduled_time or step.start
            live.tier.queue.observe(scheduled_at - request.arrival_time, live.exemplar)
            live.tier.prompt_tokens.inc(request.num_prompt_tokens)
            live.tier.prefix_queries.inc(request.num_prompt_tokens)
            live.tier.prefix_hits.inc(max(request.num_cached_tokens, 0))
            if live.trace is not None:
                live.wait.last_step = step.index - 1
                live.trace.queue(request.arrival_time, scheduled_at, live.wait)
        elif live.preempted is not None:
            since, preemption = live.preempted
            if live.trace is not None:
                live.trace.preemption(since, step.start, preemption, request.num_preemptions)
            live.preempted = None

    def _prefill_chunk(
        self, live: _Live, num_tokens: int, step: StepRecord, step_span: SpanContext | None
    ) -> None:
        live.num_prefill_chunks += 1
        if live.trace is not None:
            chunk = {
                "sitsd.chunk.index": live.num_prefill_chunks - 1,
                "sitsd.chunk.num_tokens": num_tokens,
                "sitsd.chunk.first_token": live.request.num_computed_tokens - num_tokens,
                "sitsd.recompute": live.recomputing,
                "sitsd.step.index": step.index,
            }
            live.trace.prefill(step.start, step.end, chunk, step_span)

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
        if live.stretch_start is None:  # its first token, or its first since a preemption
            live.stretch_start, live.stretch_tokens, live.stretch_steps = now, 0, []
        live.stretch_tokens += num_new
        live.last_token_time = now
        live.recomputing = False

    def _end_stretch(self, live: _Live) -> None:
        """The decode stretch under way ends (a preemption, the request's end)."""
        start, last = live.stretch_start, live.last_token_time
        live.stretch_start = None
        if start is None or last is None:
            return
        live.decode_s += last - start
        if live.trace is not None:
            live.trace.decode(start, last, live.stretch_tokens, live.stretch_steps)
        live.stretch_steps = []

    def _step_span(
        self, step: StepRecord, served: list[_Live], num_prefill_tokens: int
    ) -> SpanContext | None:
        """The step's span, when it serves a traced request; its context if it is sampled."""
        links: list[Link] = [
            link for live in served if live.trace is not None for link in live.trace.link
        ]
        if not self.step_spans or not links:
            return None
        sched_out = step.sched_out
        span = self.tracer.start_span(
            "engine.step",
            context=_EMPTY_CONTEXT,
            start_time=self.clock.ns(step.start),
            links=links,
            attributes={
                "sitsd.step.index": step.index,
                "sitsd.batch_size": len(sched_out.num_scheduled_tokens),
                "sitsd.num_tokens": sched_out.total_num_scheduled_tokens,
                "sitsd.num_prefill_tokens": num_prefill_tokens,
                "sitsd.num_new_requests": len(sched_out.new_reqs),
                "sitsd.num_preempted": len(sched_out.preemptions),
                "sitsd.model": self.model,
            },
        )
        span.end(end_time=self.clock.ns(step.end))
        context = span.get_span_context()
        return context if context.trace_flags.sampled else None

    def _log_finished(
        self, request: Request, request_trace: RequestTrace | None, end: EndReason, now: float
    ) -> None:
        if not log.isEnabledFor(logging.INFO):
            return
        first = request.first_token_time
        extra = {
            "req_id": request.req_id,
            "tier": request.tier.value,
            "finish_reason": end.value,
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
        token = request_trace.attach() if request_trace is not None else None
        try:
            log.info("request finished", extra=extra)
        finally:
            if token is not None:
                otel_context.detach(token)


def _is_prefill(live: _Live, num_tokens: int) -> bool:
    """This step computes prompt tokens of the request (a chunk, or a recompute)."""
    return num_tokens > 1 or live.last_token_time is None or live.recomputing
