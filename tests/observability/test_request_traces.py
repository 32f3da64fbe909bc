"""Every request's trace, however it ends, on the real engine core (fake runner): refused, shed,
cancelled, out of time, failed or preempted requests keep their queue span, tier, ids and a
finish reason that says what happened; preemptions say why and for whom and are never decode
time; queue spans say whom a request waited behind; sampled requests keep every step."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sitsd.config import ObservabilityConfig, TierConfig, TiersConfig
from sitsd.engine.async_engine import AsyncEngine
from sitsd.engine.errors import OverloadedError
from sitsd.engine.messages import AbortRequest, AddRequest
from sitsd.observability.tracing import build_resource, build_tracer_provider
from sitsd.outputs import ModelInfo
from sitsd.types import AbortCause, EndReason, FinishReason, SamplingParams, Tier
from tests.observability.test_telemetry import MODEL, Rig, children_of, make_rig, prompt, wait_for

PATIENT = TierConfig(1.0, 1.0, max_queue_wait_s=600.0)
# Nothing is refused and nothing waits too long, but bronze: shed once it waited 1 ms.
SHEDS_BRONZE = TiersConfig(
    gold=PATIENT,
    silver=PATIENT,
    bronze=TierConfig(1.0, 1.0, max_queue_wait_s=0.001),
    admission_control=False,
)
# Admission control on: bronze is refused as soon as anything is ahead of it.
REFUSES_BRONZE = TiersConfig(
    gold=PATIENT, silver=PATIENT, bronze=TierConfig(1.0, 1.0, max_queue_wait_s=1e-9)
)


def submit(rig: Rig, req_id: str, tier: Tier, deadline: float | None = None, **params):
    """Add a traced request; its server span (a stand-in for the RPC's)."""
    span = rig.provider.get_tracer("test").start_span(f"rpc {req_id}")
    params = {"ignore_eos": True, "max_tokens": 8, **params}
    arrival = time.monotonic()
    rig.core.submit(
        AddRequest(req_id, prompt(6), SamplingParams(**params), tier, deadline, arrival, span)
    )
    return span


def server_span(rig: Rig, span) -> ReadableSpan:
    span.end()
    (found,) = [s for s in rig.finished_spans() if s.context.span_id == span.context.span_id]
    return found


def named(spans: list[ReadableSpan], name: str) -> list[ReadableSpan]:
    return sorted((s for s in spans if s.name == name), key=lambda s: s.start_time)


def finished(rig: Rig, tier: str, reason: str) -> float:
    return rig.value("sitsd_requests_finished_total", tier=tier, finish_reason=reason)


def hog(rig: Rig, max_tokens: int = 240) -> None:
    """A gold request that holds the one batch slot for `max_tokens` steps."""
    rig.core.submit(
        AddRequest("hog", prompt(3), SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                   Tier.GOLD, None, time.monotonic())
    )  # fmt: skip


@pytest.fixture
def rig() -> Iterator[Rig]:
    rig = make_rig()
    yield rig
    rig.core.stop()


# ------------------------------------------------------------------------------ item 15


def test_a_request_refused_on_the_engine_thread_has_its_queue_span_tier_ids_and_reason():
    rig = make_rig(max_num_seqs=1, tiers=REFUSES_BRONZE)
    try:
        hog(rig)
        assert wait_for(lambda: rig.core.status().num_running == 1)
        span = submit(rig, "refused-1", Tier.BRONZE)
        (last,) = rig.until_finished({"refused-1"})["refused-1"]
    finally:
        rig.core.stop()
    assert last.finish_reason is FinishReason.ABORT  # what the client gets is unchanged
    assert last.abort_cause is AbortCause.OVERLOADED
    server = server_span(rig, span)
    assert server.attributes["sitsd.tier"] == "bronze"
    assert server.attributes["gen_ai.request.model"] == MODEL
    assert server.attributes["sitsd.request_id"] == "refused-1"
    assert server.attributes["gen_ai.response.id"] == "refused-1"
    assert server.attributes["sitsd.finish_reason"] == "refused"
    (queue,) = children_of(rig.finished_spans(), span)
    assert queue.name == "queue"
    assert queue.attributes["sitsd.queue.outcome"] == "refused"
    assert queue.attributes["sitsd.queue.num_running"] == 1
    assert (
        queue.attributes["sitsd.queue.expected_wait_s"] > queue.attributes["sitsd.queue.max_wait_s"]
    )
    assert "bronze tier's" in queue.attributes["sitsd.queue.refusal"]
    assert finished(rig, "bronze", "refused") == 1


def test_a_request_refused_on_the_api_thread_is_traced_and_counted_too():
    rig = make_rig(max_num_seqs=1, tiers=REFUSES_BRONZE)
    loop = asyncio.new_event_loop()
    try:
        info = ModelInfo(MODEL, 256, 256, "llama", "float32", "cpu", "/fake")
        engine = AsyncEngine(rig.core, info)
        engine.bind(loop)  # accepts requests; nothing is delivered in this test
        hog(rig)
        assert wait_for(lambda: rig.core.status().num_steps >= 2)  # a step time is known
        span = rig.provider.get_tracer("test").start_span("rpc early")
        with pytest.raises(OverloadedError, match="bronze tier's"):
            engine.add_request(prompt(5), SamplingParams(max_tokens=4), req_id="early-1",
                               tier=Tier.BRONZE, trace_context=span)  # fmt: skip
    finally:
        rig.core.stop()
        loop.close()
    server = server_span(rig, span)
    assert server.attributes["sitsd.finish_reason"] == "refused"
    assert server.attributes["sitsd.request_id"] == "early-1"
    assert server.attributes["sitsd.tier"] == "bronze"
    (queue,) = children_of(rig.finished_spans(), span)
    assert queue.attributes["sitsd.queue.outcome"] == "refused"
    assert finished(rig, "bronze", "refused") == 1
    assert {t.tier: t.num_refused for t in rig.core.status().tiers}["bronze"] == 1


def test_a_shed_request_has_its_queue_span_and_finish_reason_shed():
    rig = make_rig(max_num_seqs=1, tiers=SHEDS_BRONZE)
    try:
        hog(rig)
        assert wait_for(lambda: rig.core.status().num_running == 1)
        span = submit(rig, "shed-1", Tier.BRONZE)
        (last,) = rig.until_finished({"shed-1"})["shed-1"]
    finally:
        rig.core.stop()
    assert last.finish_reason is FinishReason.ABORT
    assert last.abort_cause is AbortCause.OVERLOADED  # RESOURCE_EXHAUSTED, as before
    server = server_span(rig, span)
    assert server.attributes["sitsd.finish_reason"] == "shed"
    assert server.attributes["sitsd.tier"] == "bronze"
    assert server.attributes["gen_ai.response.finish_reasons"] == ("abort",)
    (queue,) = children_of(rig.finished_spans(), span)
    assert queue.name == "queue"
    assert queue.attributes["sitsd.queue.outcome"] == "shed"
    assert queue.attributes["sitsd.queue.num_running"] == 1
    assert queue.end_time - queue.start_time >= 1e6  # it waited past bronze's 1 ms
    assert finished(rig, "bronze", "shed") == 1
    assert finished(rig, "bronze", "abort") == 0


def test_a_request_cancelled_or_out_of_time_in_the_queue_says_which():
    rig = make_rig(max_num_seqs=1, tiers=SHEDS_BRONZE)
    try:
        hog(rig)
        assert wait_for(lambda: rig.core.status().num_running == 1)
        cancelled = submit(rig, "cancelled-1", Tier.SILVER)
        late = submit(rig, "late-1", Tier.SILVER, deadline=time.monotonic() + 0.002)
        rig.core.submit(AbortRequest("cancelled-1", "cancelled by the client"))
        deltas = rig.until_finished({"cancelled-1", "late-1"})
    finally:
        rig.core.stop()
    assert deltas["late-1"][-1].abort_cause is AbortCause.DEADLINE
    for span, reason in ((cancelled, "cancelled"), (late, "deadline")):
        assert server_span(rig, span).attributes["sitsd.finish_reason"] == reason
        (queue,) = children_of(rig.finished_spans(), span)
        assert queue.attributes["sitsd.queue.outcome"] == reason
        assert finished(rig, "silver", reason) == 1


def test_a_failed_step_and_a_shutdown_end_requests_as_error_and_shutdown():
    rig = make_rig()
    try:
        failing = submit(rig, "fails", Tier.GOLD)
        rig.core.runner.fail_next = True
        rig.until_finished({"fails"})
        stopped = submit(rig, "stopped", Tier.GOLD, max_tokens=250)
        assert wait_for(lambda: rig.core.status().num_running == 1)
    finally:
        rig.core.stop()
    assert server_span(rig, failing).attributes["sitsd.finish_reason"] == "error"
    assert server_span(rig, stopped).attributes["sitsd.finish_reason"] == "shutdown"
    assert finished(rig, "gold", "error") == finished(rig, "gold", "shutdown") == 1


def test_every_finish_reason_is_a_series_at_zero_from_the_start(rig):
    for tier in Tier:
        for reason in EndReason:
            labels = {"model": MODEL, "tier": tier.value, "finish_reason": reason.value}
            assert (
                rig.metrics.registry.get_sample_value("sitsd_requests_finished_total", labels) == 0
            )


# ------------------------------------------------------------------------------ item 17


def test_a_block_preemption_says_why_and_for_whom_and_is_never_decode_time():
    # 8 blocks of 4 tokens: two requests growing to 8 + 14 tokens each cannot both fit.
    rig = make_rig(num_blocks=8, budget=64)
    try:
        spans = {r: submit(rig, r, Tier.SILVER, max_tokens=14) for r in ("x", "y")}
        rig.until_finished({"x", "y"})
    finally:
        rig.core.stop()
    finished_spans = rig.finished_spans()
    for span in spans.values():
        server_span(rig, span)
        kids = children_of(rig.finished_spans(), span)
        decodes, preemptions = named(kids, "decode"), named(kids, "preemption")
        assert sum(d.attributes["gen_ai.usage.output_tokens"] for d in decodes) == 14
        for p in preemptions:
            assert p.attributes["sitsd.preemption.reason"] == "blocks"
            assert p.attributes["sitsd.preemption.for_request_id"] in spans
            assert p.attributes["sitsd.preemption.for_tier"] == "silver"
            for d in decodes:  # preempted time is never decode time
                assert d.end_time <= p.start_time or d.start_time >= p.end_time
        assert len(decodes) == len(preemptions) + 1
    assert named(finished_spans, "preemption"), "no preemption happened"
    decode_s = sum(
        (d.end_time - d.start_time) / 1e9
        for s in spans.values() for d in named(children_of(rig.finished_spans(), s), "decode")
    )  # fmt: skip
    histogram = rig.value("sitsd_request_decode_time_seconds_sum", tier="silver")
    assert histogram == pytest.approx(decode_s, abs=1e-6)
    assert rig.value("sitsd_num_preemptions_total", tier="silver", reason="blocks") == len(
        named(finished_spans, "preemption")
    )


def test_a_tier_preemption_names_the_gold_request_it_made_room_for():
    tiers = TiersConfig(gold=PATIENT, silver=PATIENT, bronze=PATIENT, admission_control=False)
    rig = make_rig(max_num_seqs=1, tiers=tiers)
    try:
        bronze = submit(rig, "bronze-1", Tier.BRONZE, max_tokens=200)
        assert wait_for(lambda: rig.core.status().num_running == 1)
        gold = f"gold-{random.randrange(1000)}"
        submit(rig, gold, Tier.GOLD, max_tokens=4)
        rig.until_finished({gold})
        rig.core.submit(AbortRequest("bronze-1", "cancelled by the client"))
        rig.until_finished({"bronze-1"})
    finally:
        rig.core.stop()
    server_span(rig, bronze)
    (preemption,) = named(children_of(rig.finished_spans(), bronze), "preemption")
    assert preemption.attributes["sitsd.preemption.reason"] == "tier"
    assert preemption.attributes["sitsd.preemption.for_request_id"] == gold
    assert preemption.attributes["sitsd.preemption.for_tier"] == "gold"
    assert rig.value("sitsd_num_preemptions_total", tier="bronze", reason="tier") == 1


# ------------------------------------------------------------------------------ item 18


def test_queue_spans_say_whom_a_request_waited_behind_and_which_steps_ran_meanwhile():
    rig = make_rig(max_num_seqs=1, policy="fcfs", start=False)
    tiers = [random.choice(list(Tier)) for _ in range(3)]
    spans = [submit(rig, f"q{i}", tier, max_tokens=5) for i, tier in enumerate(tiers)]
    rig.start()  # one turn takes all three: they queue in this order, nothing running yet
    try:
        rig.until_finished({"q0", "q1", "q2"})
    finally:
        rig.core.stop()
    for i, span in enumerate(spans):
        server_span(rig, span)
        kids = children_of(rig.finished_spans(), span)
        (queue,) = named(kids, "queue")
        attrs = queue.attributes
        assert attrs["sitsd.queue.outcome"] == "scheduled"
        assert attrs["sitsd.queue.position"] == i
        assert attrs["sitsd.queue.num_running"] == 0
        for tier in Tier:
            assert attrs[f"sitsd.queue.ahead.{tier.value}"] == tiers[:i].count(tier)
        first_step = named(kids, "prefill")[0].attributes["sitsd.step.index"]
        if i == 0:
            assert attrs["sitsd.queue.num_steps_waited"] == 0
            continue
        # One batch slot: it waited while the ones ahead ran, 5 tokens each.
        assert attrs["sitsd.queue.last_step_index"] == first_step - 1
        assert attrs["sitsd.queue.first_step_index"] == 1
        assert attrs["sitsd.queue.num_steps_waited"] == first_step - 1 >= 5 * i


def test_a_request_and_its_steps_name_each_other(rig):
    spans = {f"r{i}": submit(rig, f"r{i}", Tier.SILVER, max_tokens=random.randint(3, 7))
             for i in range(3)}  # fmt: skip
    rig.until_finished(set(spans))
    steps = named(rig.finished_spans(), "engine.step")
    for span in spans.values():
        server = server_span(rig, span)
        kids = children_of(rig.finished_spans(), span)
        listed = {p.attributes["sitsd.step.index"] for p in named(kids, "prefill")}
        for decode in named(kids, "decode"):
            listed |= set(decode.attributes["sitsd.step.indexes"])
        sid = span.context.span_id
        linking = {s.attributes["sitsd.step.index"] for s in steps
                   if any(lk.context.span_id == sid for lk in s.links)}  # fmt: skip
        assert listed == linking
        assert server.attributes["sitsd.num_steps"] == len(listed)
        for prefill in named(kids, "prefill"):  # and the chunk links to its step
            (link,) = prefill.links
            (step,) = [s for s in steps if s.context.span_id == link.context.span_id]
            assert step.attributes["sitsd.step.index"] == prefill.attributes["sitsd.step.index"]


def test_with_a_sample_ratio_a_sampled_request_keeps_every_step():
    exporter = InMemorySpanExporter()
    config = ObservabilityConfig(trace_sample_ratio=0.5)
    provider = build_tracer_provider(config, build_resource(config), exporter)
    rig = make_rig(provider=provider)
    try:
        ids = [f"s{i}" for i in range(24)]
        spans = {}
        for req_id in ids:
            spans[req_id] = submit(rig, req_id, Tier.SILVER, max_tokens=random.randint(4, 8))
            rig.until_finished({req_id})  # one at a time: no step serves two requests
    finally:
        rig.core.stop()
    for span in spans.values():
        span.end()
    provider.force_flush()
    finished_spans = exporter.get_finished_spans()
    steps = [s for s in finished_spans if s.name == "engine.step"]
    sampled = [r for r, s in spans.items() if s.get_span_context().trace_flags.sampled]
    assert 0 < len(sampled) < len(ids)  # 24 requests at 0.5: both kinds (1 - 2^-23)
    for req_id, span in spans.items():
        sid = span.get_span_context().span_id
        linked = [s for s in steps if any(lk.context.span_id == sid for lk in s.links)]
        if req_id not in sampled:
            assert linked == []
            continue
        (server,) = [s for s in finished_spans if s.context.span_id == sid]
        assert len(linked) == server.attributes["sitsd.num_steps"] >= 4
    provider.shutdown()
