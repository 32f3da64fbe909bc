"""Engine telemetry on the real engine core (fake runner): spans, links, metrics, exemplars."""

from __future__ import annotations

import queue
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from sitsd.config import SchedulerConfig, TiersConfig
from sitsd.engine.admission import QueuePlace
from sitsd.engine.core import EngineCore
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.messages import AbortRequest, AddRequest, EngineCall
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.observability.metrics import Metrics
from sitsd.observability.telemetry import EngineTelemetry
from sitsd.types import RequestDelta, SamplingParams, Tier
from tests.engine.fakes import FakeRunner
from tests.engine.test_detokenizer import ByteTokenizer

BLOCK = 4
TIMEOUT = 10.0
MODEL = "fake-model"


@dataclass
class Rig:
    core: EngineCore
    metrics: Metrics
    spans: InMemorySpanExporter
    provider: TracerProvider
    deltas: queue.Queue[RequestDelta]

    def add(self, req_id: str, prompt: list[int], tier: Tier | None = None, traced=True, **params):
        span = self.provider.get_tracer("test").start_span(f"rpc {req_id}") if traced else None
        self.core.submit(
            AddRequest(
                req_id,
                prompt,
                SamplingParams(**params),
                tier,
                None,
                time.monotonic(),
                trace_context=span,
            )
        )
        return span

    def until_finished(self, req_ids: set[str]) -> dict[str, list[RequestDelta]]:
        out: dict[str, list[RequestDelta]] = {}
        deadline = time.monotonic() + TIMEOUT
        while req_ids - {r for r, ds in out.items() if ds[-1].finished}:
            d = self.deltas.get(timeout=max(0.01, deadline - time.monotonic()))
            out.setdefault(d.req_id, []).append(d)
        return out

    def value(self, name: str, **labels: str) -> float:
        found = self.metrics.registry.get_sample_value(name, {"model": MODEL, **labels})
        return 0.0 if found is None else found

    def finished_spans(self) -> list[ReadableSpan]:
        return list(self.spans.get_finished_spans())

    def start(self) -> None:
        """Start the engine thread; return once it has run a call between two steps, so its
        start-up hook (the model bound to the metrics, every series at zero, the weights
        version set) is done and a test that reads series before any request sees them."""
        self.core.start(lambda ds: [self.deltas.put(d) for d in ds])
        started = threading.Event()
        self.core.submit(EngineCall(lambda: None, lambda result, exc: started.set()))
        assert started.wait(TIMEOUT), "the engine thread ran no call"


def make_rig(
    num_blocks: int = 64,
    budget: int = 32,
    max_num_seqs: int = 4,
    *,
    policy: str = "tiers",
    tiers: TiersConfig | None = None,
    provider: TracerProvider | None = None,
    start: bool = True,
) -> Rig:
    """The real engine core with telemetry over a fake runner; `start` False: the test
    submits first and starts the loop itself (`rig.start()`), so one turn takes them all."""
    tok = ByteTokenizer()
    tok.eos_token_ids = (0,)
    kv = KVCacheManager(num_blocks, BLOCK)
    config = SchedulerConfig(
        max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy
    )
    sched = Scheduler(config, kv, 256, tiers=tiers)
    spans = InMemorySpanExporter()
    if provider is None:
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(spans))
    metrics = Metrics()
    telemetry = EngineTelemetry(metrics, provider.get_tracer("sitsd"))
    core = EngineCore(sched, FakeRunner(BLOCK, vocab_size=256), tok, MODEL, observer=telemetry)
    rig = Rig(core, metrics, spans, provider, queue.Queue())
    if start:
        rig.start()
    return rig


@pytest.fixture
def rig() -> Iterator[Rig]:
    rig = make_rig()
    yield rig
    rig.core.stop()


def prompt(n: int) -> list[int]:
    # Tokens 1..200: never the EOS (0), and the fake model's continuation stays off it too.
    return [random.randint(1, 200) for _ in range(n)]


def children_of(spans: list[ReadableSpan], parent) -> list[ReadableSpan]:
    sid = parent.get_span_context().span_id
    return [s for s in spans if s.parent is not None and s.parent.span_id == sid]


def test_request_span_gets_queue_prefill_chunks_and_decode_children():
    rig = make_rig(budget=8)
    try:
        num_prompt = random.randint(17, 24)  # three chunks of at most 8 tokens
        span = rig.add("a", prompt(num_prompt), max_tokens=5, ignore_eos=True)
        rig.until_finished({"a"})
    finally:
        rig.core.stop()
    span.end()
    spans = rig.finished_spans()
    children = children_of(spans, span)
    names = [s.name for s in sorted(children, key=lambda s: s.start_time)]
    assert names[0] == "queue"
    assert names[-1] == "decode"
    chunks = [s for s in children if s.name == "prefill"]
    assert len(chunks) == -(-num_prompt // 8)
    assert sum(s.attributes["sitsd.chunk.num_tokens"] for s in chunks) == num_prompt
    assert sorted(s.attributes["sitsd.chunk.first_token"] for s in chunks) == list(
        range(0, num_prompt, 8)
    )
    for child in children:
        assert child.context.trace_id == span.get_span_context().trace_id
        assert child.start_time <= child.end_time
    (decode,) = [s for s in children if s.name == "decode"]
    assert decode.attributes["gen_ai.usage.output_tokens"] == 5
    (server,) = [s for s in spans if s.name == "rpc a"]
    attrs = server.attributes
    assert attrs["gen_ai.usage.input_tokens"] == num_prompt
    assert attrs["gen_ai.usage.output_tokens"] == 5
    assert attrs["gen_ai.response.finish_reasons"] == ("length",)
    assert attrs["gen_ai.request.max_tokens"] == 5
    assert attrs["gen_ai.request.model"] == MODEL
    assert attrs["sitsd.tier"] == "silver"
    assert attrs["sitsd.weights_version"] == "fake@0"
    assert attrs["sitsd.num_prefill_chunks"] == len(chunks)


def test_step_spans_link_to_the_requests_they_served(rig):
    ids = [f"r{i}" for i in range(3)]
    request_spans = {
        r: rig.add(r, prompt(random.randint(3, 9)), max_tokens=4, ignore_eos=True) for r in ids
    }
    rig.until_finished(set(ids))
    steps = [s for s in rig.finished_spans() if s.name == "engine.step"]
    assert steps, "no engine.step span"
    linked: set[int] = set()
    for step in steps:
        assert step.parent is None  # a root span: steps serve many traces
        assert step.attributes["sitsd.batch_size"] == len(step.links)
        assert step.attributes["sitsd.num_tokens"] >= len(step.links)
        linked |= {link.context.span_id for link in step.links}
    assert linked == {s.get_span_context().span_id for s in request_spans.values()}
    # Every token step of every request is a step it is linked from: 4 tokens -> >= 4 steps.
    for span in request_spans.values():
        sid = span.get_span_context().span_id
        assert sum(any(lk.context.span_id == sid for lk in s.links) for s in steps) >= 4
    assert rig.value("sitsd_batch_size_count") == len(steps)
    assert rig.value("sitsd_step_tokens_sum") == sum(
        s.attributes["sitsd.num_tokens"] for s in steps
    )


def test_preemption_gets_a_span_a_count_and_recompute_chunks():
    # 8 blocks of 4 tokens: two requests growing to 8 + 14 tokens each cannot both fit.
    rig = make_rig(num_blocks=8, budget=64)
    try:
        spans = {r: rig.add(r, prompt(8), max_tokens=14, ignore_eos=True) for r in ("x", "y")}
        rig.until_finished({"x", "y"})
        num_preemptions = rig.core.status().num_preemptions
    finally:
        rig.core.stop()
    assert num_preemptions > 0
    labels = {"tier": "silver", "reason": "blocks"}
    assert rig.value("sitsd_num_preemptions_total", **labels) == num_preemptions
    finished = rig.finished_spans()
    preemption_spans = [s for s in finished if s.name == "preemption"]
    assert len(preemption_spans) == num_preemptions
    recomputes = [s for s in finished if s.name == "prefill" and s.attributes["sitsd.recompute"]]
    assert recomputes
    victims = {s.parent.span_id for s in preemption_spans}
    assert victims <= {s.get_span_context().span_id for s in spans.values()}
    assert {s.parent.span_id for s in recomputes} == victims


def test_latency_histograms_count_requests_and_tokens_with_trace_id_exemplars(rig):
    n, m = random.randint(2, 4), random.randint(3, 6)
    spans = {f"r{i}": rig.add(f"r{i}", prompt(5), max_tokens=m, ignore_eos=True) for i in range(n)}
    rig.until_finished(set(spans))
    silver = {"tier": "silver"}
    assert rig.value("sitsd_time_to_first_token_seconds_count", **silver) == n
    assert rig.value("sitsd_inter_token_latency_seconds_count", **silver) == n * (m - 1)
    assert rig.value("sitsd_e2e_request_latency_seconds_count", **silver) == n
    assert rig.value("sitsd_request_queue_time_seconds_count", **silver) == n
    assert rig.value("sitsd_request_prefill_time_seconds_count", **silver) == n
    assert rig.value("sitsd_request_decode_time_seconds_count", **silver) == n
    assert rig.value("sitsd_generation_tokens_total", **silver) == n * m
    assert rig.value("sitsd_prompt_tokens_total", **silver) == n * 5
    assert rig.value("sitsd_prefix_cache_queries_total", **silver) == n * 5
    assert rig.value("sitsd_requests_finished_total", finish_reason="length", **silver) == n
    text = rig.metrics.exposition(openmetrics=True).decode()
    trace_ids = {format(s.get_span_context().trace_id, "032x") for s in spans.values()}
    ttft_exemplars = {
        line.split('trace_id="')[1][:32]
        for line in text.splitlines()
        if line.startswith("sitsd_time_to_first_token_seconds_bucket") and "trace_id" in line
    }
    assert ttft_exemplars
    assert ttft_exemplars <= trace_ids


def test_tier_labels_follow_the_request_and_gauges_return_to_zero(rig):
    rig.add("g", prompt(4), tier=Tier.GOLD, max_tokens=3, ignore_eos=True)
    rig.add("b", prompt(4), tier=Tier.BRONZE, max_tokens=200, ignore_eos=True)
    rig.until_finished({"g"})
    rig.core.submit(AbortRequest("b", "cancelled by the client"))
    rig.until_finished({"b"})
    assert rig.value("sitsd_requests_finished_total", tier="gold", finish_reason="length") == 1
    cancelled = {"tier": "bronze", "finish_reason": "cancelled"}
    assert rig.value("sitsd_requests_finished_total", **cancelled) == 1
    assert rig.value("sitsd_time_to_first_token_seconds_count", tier="gold") == 1
    assert rig.value("sitsd_e2e_request_latency_seconds_count", tier="bronze") == 0  # aborted
    assert wait_for(lambda: rig.value("sitsd_kv_cache_usage_perc") == 0.0)
    for tier in Tier:
        assert rig.value("sitsd_num_requests_running", tier=tier.value) == 0
        assert rig.value("sitsd_num_requests_waiting", tier=tier.value) == 0


def test_running_and_waiting_gauges_count_live_requests_by_tier():
    rig = make_rig(max_num_seqs=1)
    try:
        for r in ("first", "second"):
            rig.add(r, prompt(3), tier=Tier.GOLD, max_tokens=250, ignore_eos=True)
        assert wait_for(lambda: rig.value("sitsd_num_requests_running", tier="gold") == 1)
        assert rig.value("sitsd_num_requests_waiting", tier="gold") == 1
        assert rig.value("sitsd_kv_cache_usage_perc") > 0
        for r in ("first", "second"):
            rig.core.submit(AbortRequest(r, "cancelled by the client"))
        rig.until_finished({"first", "second"})
    finally:
        rig.core.stop()
    assert rig.value("sitsd_num_requests_running", tier="gold") == 0
    assert rig.value("sitsd_num_requests_waiting", tier="gold") == 0


def test_untraced_requests_are_measured_without_spans(rig):
    rig.add("plain", prompt(4), traced=False, max_tokens=3, ignore_eos=True)
    rig.until_finished({"plain"})
    assert rig.value("sitsd_time_to_first_token_seconds_count", tier="silver") == 1
    names = {s.name for s in rig.finished_spans()}
    assert names <= {"engine.step"}  # steps are traced; the request has no children
    text = rig.metrics.exposition(openmetrics=True).decode()
    assert "trace_id" not in text


def test_weights_version_info_is_set_when_the_engine_starts(rig):
    assert rig.value("sitsd_weights_version_info", version="fake@0") == 1


class Exploding:
    def __getattr__(self, name):
        def hook(*args):
            raise RuntimeError(f"{name} exploded")

        return hook


def test_a_failing_observer_never_costs_a_request():
    tok = ByteTokenizer()
    tok.eos_token_ids = (0,)
    sched = Scheduler(SchedulerConfig(), KVCacheManager(32, BLOCK), 128)
    core = EngineCore(sched, FakeRunner(BLOCK, vocab_size=256), tok, MODEL, observer=Exploding())
    deltas: queue.Queue[RequestDelta] = queue.Queue()
    core.start(lambda ds: [deltas.put(d) for d in ds])
    try:
        core.submit(
            AddRequest("a", [1, 2], SamplingParams(max_tokens=4), None, None, time.monotonic())
        )
        got = []
        while not (got and got[-1].finished):
            got.append(deltas.get(timeout=TIMEOUT))
    finally:
        core.stop()
    assert got[-1].finish_reason.value == "length"
    assert sum(len(d.new_token_ids) for d in got) == 4


def wait_for(predicate, timeout: float = TIMEOUT) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


def test_a_migration_is_a_child_span_of_the_live_request():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    telemetry = EngineTelemetry(Metrics(), provider.get_tracer("sitsd"))
    telemetry.on_engine_started(MODEL, "m@1")
    server = provider.get_tracer("t").start_span("rpc")
    request = Request(
        req_id="r",
        prompt_token_ids=prompt(4),
        params=SamplingParams(),
        seed=0,
        tier=Tier.GOLD,
        arrival_time=time.monotonic(),
        trace_context=server,
        weights_version="m@1",
    )
    telemetry.on_request_added(request, QueuePlace.behind([], 0))
    start = time.monotonic()
    telemetry.record_migration(request, start, start + 0.25, "m@1", "m@2")
    (migration,) = spans.get_finished_spans()
    assert migration.name == "migration"
    assert migration.parent.span_id == server.get_span_context().span_id
    assert migration.end_time - migration.start_time == pytest.approx(0.25e9, abs=1e3)
    assert migration.attributes["sitsd.weights_version.to"] == "m@2"


def test_tier_batch_caps_and_p99_estimates_are_exported_from_the_scheduler(rig):
    status = rig.core.status()
    assert status.tiers, "the tiers policy reports each tier"
    assert wait_for(lambda: rig.value("sitsd_tier_batch_cap", tier="gold") > 0)
    for tier in status.tiers:
        assert rig.value("sitsd_tier_batch_cap", tier=tier.tier) == tier.batch_cap

    # The scheduler refreshes its P99s once per control interval while it schedules work.
    def gold_estimate() -> float:
        return rig.value("sitsd_tier_p99_estimate_seconds", tier="gold", kind="ttft")

    deadline = time.monotonic() + TIMEOUT
    n = 0
    while gold_estimate() == 0 and time.monotonic() < deadline:
        req_id = f"g{n}"
        rig.core.submit(AddRequest(req_id, prompt(5), SamplingParams(max_tokens=3), Tier.GOLD,
                                   None, time.monotonic()))  # fmt: skip
        rig.until_finished({req_id})
        n += 1
    assert gold_estimate() > 0
