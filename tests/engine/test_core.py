"""EngineCore: the step loop on its thread, with a fake runner and a byte tokenizer."""

from __future__ import annotations

import queue
import time

import pytest

from sitsd.config import SchedulerConfig
from sitsd.engine.core import EngineCore
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.messages import AbortRequest, AddRequest
from sitsd.engine.scheduler import Scheduler
from sitsd.types import AbortCause, FinishReason, RequestDelta, SamplingParams, Tier
from tests.engine.fakes import FakeRunner
from tests.engine.test_detokenizer import ByteTokenizer

BLOCK = 4
TIMEOUT = 10.0


class Collector:
    def __init__(self) -> None:
        self.q: queue.Queue[RequestDelta] = queue.Queue()

    def __call__(self, deltas: list[RequestDelta]) -> None:
        for d in deltas:
            self.q.put(d)

    def until_finished(self, req_ids: set[str]) -> dict[str, list[RequestDelta]]:
        out: dict[str, list[RequestDelta]] = {}
        pending = set(req_ids)
        deadline = time.monotonic() + TIMEOUT
        while pending:
            d = self.q.get(timeout=max(0.01, deadline - time.monotonic()))
            out.setdefault(d.req_id, []).append(d)
            if d.finished:
                pending.discard(d.req_id)
        return out


@pytest.fixture(
    params=[(False, False), (True, False), (True, True)],
    ids=["sync-runner", "overlapping-runner", "async-scheduling"],
)
def engine(request):
    """The core with a runner that computes in `launch` (CPU), one that overlaps (CUDA), and
    one step scheduled ahead of the last one's output (asynchronous scheduling)."""
    overlaps, ahead = request.param
    tok = ByteTokenizer()
    tok.eos_token_ids = (0,)
    runner = FakeRunner(BLOCK, vocab_size=256, overlaps=overlaps)
    kv = KVCacheManager(32, BLOCK)
    config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32, async_scheduling=ahead)
    sched = Scheduler(config, kv, 128)
    core = EngineCore(sched, runner, tok, "fake-model")
    sink = Collector()
    core.start(sink)
    yield core, runner, sink
    core.stop()


def add(core, req_id, prompt, **params):
    core.submit(
        AddRequest(req_id, list(prompt), SamplingParams(**params), None, None, time.monotonic())
    )


def text_of(deltas):
    return "".join(d.text for d in deltas)


def test_streams_text_and_finishes_with_usage(engine):
    core, _, sink = engine
    add(core, "a", b"ab", max_tokens=5)  # the fake model continues c, d, e, f, g
    deltas = sink.until_finished({"a"})["a"]
    assert text_of(deltas) == "cdefg"
    last = deltas[-1]
    assert last.finish_reason is FinishReason.LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 5)
    assert all(d.weights_version == "fake@0" for d in deltas)


def test_stop_string_finishes_the_request_and_frees_its_blocks(engine):
    core, _, sink = engine
    add(core, "a", b"a", max_tokens=20, stop=("ef",))
    deltas = sink.until_finished({"a"})["a"]
    assert text_of(deltas) == "bcd"
    assert deltas[-1].finish_reason is FinishReason.STOP
    assert wait_for(lambda: core.status().num_blocks_used == 0)


def test_abort_finishes_with_abort_and_frees_blocks(engine):
    core, _, sink = engine
    add(core, "a", b"a", max_tokens=100, ignore_eos=True)
    core.submit(AbortRequest("a", "cancelled by the client"))
    deltas = sink.until_finished({"a"})["a"]
    assert deltas[-1].finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)
    assert wait_for(lambda: core.status().num_blocks_used == 0)


def test_passed_deadline_aborts_the_request(engine):
    core, _, sink = engine
    core.submit(
        AddRequest(
            "late",
            [1, 2],
            SamplingParams(max_tokens=100),
            None,
            time.monotonic() - 1,
            time.monotonic(),
        )
    )
    (last,) = [d for d in sink.until_finished({"late"})["late"] if d.finished]
    assert last.finish_reason is FinishReason.ABORT
    assert "deadline" in last.error
    assert wait_for(lambda: core.status().num_blocks_used == 0)


def test_failed_step_fails_its_requests_and_the_engine_keeps_serving(engine):
    core, runner, sink = engine
    runner.fail_next = True
    add(core, "doomed", b"x", max_tokens=3)
    (last,) = [d for d in sink.until_finished({"doomed"})["doomed"] if d.finished]
    assert last.finish_reason is FinishReason.ERROR
    assert "injected model failure" in last.error
    add(core, "fine", b"a", max_tokens=3)
    assert text_of(sink.until_finished({"fine"})["fine"]) == "bcd"
    assert wait_for(lambda: core.status().num_blocks_used == 0)


def test_concurrent_requests_each_get_their_own_stream(engine):
    core, _, sink = engine
    for i in range(6):
        add(core, f"r{i}", bytes([ord("a") + i]), max_tokens=4)
    out = sink.until_finished({f"r{i}" for i in range(6)})
    for i in range(6):
        start = ord("a") + i
        assert text_of(out[f"r{i}"]) == "".join(chr(start + k) for k in range(1, 5))
    status = core.status()
    assert status.num_steps > 0
    assert status.model == "fake-model"


def test_stop_aborts_live_requests(engine):
    core, _, sink = engine
    add(core, "long", b"a", max_tokens=120, ignore_eos=True)
    core.stop()
    deltas = sink.until_finished({"long"})["long"]
    assert deltas[-1].finish_reason in (FinishReason.ABORT, FinishReason.LENGTH)


def wait_for(predicate, timeout=TIMEOUT):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.005)
    return predicate()


class SimulatedTimeRunner(FakeRunner):
    """Each step takes `step_s` seconds of the scheduler's simulated clock."""

    def __init__(self, clock: list[float], step_s: float) -> None:
        super().__init__(BLOCK, vocab_size=256)
        self.clock, self.step_s = clock, step_s

    def execute(self, so):
        self.clock[0] += self.step_s
        return super().execute(so)


def test_admission_control_refuses_at_once_on_both_threads_when_the_batch_cannot_free_up():
    # One batch slot, held by a gold request with ~500 steps to go at 1 s per (simulated) step:
    # nothing else can start within its tier's queue limit.
    clock = [0.0]
    tok = ByteTokenizer()
    tok.eos_token_ids = (0,)
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32)
    sched = Scheduler(cfg, KVCacheManager(64, BLOCK), 1024, clock=lambda: clock[0])
    core = EngineCore(sched, SimulatedTimeRunner(clock, 1.0), tok, "fake-model")
    sink = Collector()
    core.start(sink)
    try:
        core.submit(
            AddRequest(
                "hog",
                [1, 2],
                SamplingParams(max_tokens=500, ignore_eos=True),
                Tier.GOLD,
                None,
                time.monotonic(),
            )
        )
        assert wait_for(lambda: core.status().num_steps >= 2)
        # The API thread's check, against the last step's snapshot:
        early = AddRequest("early", [1, 2], SamplingParams(), Tier.BRONZE, None, time.monotonic())
        refusal = core.admission_refusal(early)
        assert refusal is not None
        assert "bronze tier's 500 ms" in refusal.message
        assert refusal.expected_wait_s > refusal.limit_s == 0.5
        # The engine thread's check, for a request that reached it anyway:
        core.submit(
            AddRequest(
                "late", [1, 2], SamplingParams(max_tokens=4), Tier.SILVER, None, time.monotonic()
            )
        )
        (last,) = sink.until_finished({"late"})["late"]
        assert last.finish_reason is FinishReason.ABORT
        assert last.abort_cause is AbortCause.OVERLOADED
        assert "silver tier's 250 ms" in last.error
        refused = {"gold": 0, "silver": 1, "bronze": 1}
        assert wait_for(lambda: {t.tier: t.num_refused for t in core.status().tiers} == refused)
        assert [t.num_running for t in core.status().tiers] == [1, 0, 0]
    finally:
        core.stop()


def test_fcfs_policy_never_refuses_for_queue_wait():
    clock = [0.0]
    tok = ByteTokenizer()
    tok.eos_token_ids = (0,)
    cfg = SchedulerConfig(max_num_seqs=1, max_num_batched_tokens=32, policy="fcfs")
    sched = Scheduler(cfg, KVCacheManager(64, BLOCK), 1024, clock=lambda: clock[0])
    core = EngineCore(sched, SimulatedTimeRunner(clock, 1.0), tok, "fake-model")
    core.start(Collector())
    try:
        core.submit(AddRequest("hog", [1], SamplingParams(max_tokens=500), Tier.GOLD, None, 0.0))
        assert wait_for(lambda: core.status().num_steps >= 2)
        late = AddRequest("late", [1], SamplingParams(), Tier.BRONZE, None, time.monotonic())
        assert core.admission_refusal(late) is None
        assert core.status().scheduling_policy == "fcfs"
    finally:
        core.stop()


def test_an_overlapping_runner_detokenizes_a_step_while_the_next_one_runs():
    tok = ByteTokenizer()
    runner = FakeRunner(BLOCK, vocab_size=256, overlaps=True)
    sched = Scheduler(
        SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=32), KVCacheManager(32, BLOCK), 128
    )
    core = EngineCore(sched, runner, tok, "fake-model")
    events: list[str] = []
    launch, to_delta = runner.launch, core.output._to_delta

    def traced_launch(so):
        done = launch(so)
        events.append("launch")
        result = done.result
        done.result = lambda: (events.append("result"), result())[1]
        return done

    runner.launch = traced_launch
    core.output._to_delta = lambda update: (events.append("detok"), to_delta(update))[1]
    sink = Collector()
    core.start(sink)
    try:
        add(core, "a", b"ab", max_tokens=6)
        sink.until_finished({"a"})
    finally:
        core.stop()
    # The step with the prompt samples the first token; each later launch comes before the
    # previous step's tokens are detokenized, and its result is awaited after them.
    text = " ".join(events)
    assert text.startswith("launch result launch detok result launch detok result"), text
    assert events.count("detok") == 6
