"""EngineCore commits: a SwapCommand between two steps, its events, and deltas that carry the
weights version that computed their tokens (sync runner and overlapping runner)."""

from __future__ import annotations

import queue
import random
import threading
import time

import pytest
import torch

from sitsd.config import SchedulerConfig
from sitsd.engine.core import EngineCore
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.messages import AddRequest, EngineCall, InPlaceCopy, SwapCommand
from sitsd.engine.observer import NullObserver, StepRecord
from sitsd.engine.pacing import PacingSettings
from sitsd.engine.scheduler import Scheduler
from sitsd.types import SamplingParams
from tests.engine.fakes import FakeRunner, next_token
from tests.engine.test_core import Collector, wait_for
from tests.engine.test_detokenizer import ByteTokenizer

BLOCK = 4
V0, V1 = "fake@0", "fake@1"


class Steps(NullObserver):
    """Records every step the engine ran (engine thread)."""

    def __init__(self):
        self.records: list[StepRecord] = []

    def on_step(self, step):
        self.records.append(step)


def make_core(overlaps: bool | str, num_slots: int = 2, slow_s: float = 0.0,
              observer=None, fixed_tokens: int = 8, num_blocks: int = 64,
              sink_for=None):  # fmt: skip
    """`overlaps`: False (a runner that computes in launch), True (one that overlaps), or
    "ahead" (it overlaps, and steps are scheduled ahead: asynchronous scheduling).
    `sink_for(runner)`: the sink to use (default: a `Collector`)."""
    tok = ByteTokenizer()
    ahead = overlaps == "ahead"
    runner = FakeRunner(BLOCK, vocab_size=256, overlaps=bool(overlaps), num_slots=num_slots)
    if slow_s:  # steps that take time, so requests are in flight when the command comes
        execute = runner.execute
        runner.execute = lambda so: (time.sleep(slow_s), execute(so))[1]
    kv = KVCacheManager(num_blocks, BLOCK)
    cfg = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs",
                          async_scheduling=ahead)  # fmt: skip
    sched = Scheduler(cfg, kv, 256, pacing=PacingSettings(fixed_tokens=fixed_tokens))
    core = EngineCore(sched, runner, tok, "fake", observer=observer)
    sink = sink_for(runner) if sink_for is not None else Collector()
    core.start(sink)
    return core, runner, sink


@pytest.fixture(
    params=[False, True, "ahead"], ids=["sync-runner", "overlapping-runner", "async-scheduling"]
)
def overlaps(request):
    return request.param


class Events:
    def __init__(self):
        self.q = queue.Queue()

    def __call__(self, event):
        self.q.put((event, threading.current_thread().name))

    def until_done(self, timeout=10.0):
        events = []
        while True:
            event, thread = self.q.get(timeout=timeout)
            assert thread == "sitsd-engine"  # reported from the engine thread
            events.append(event)
            if event.kind in ("committed", "failed"):
                return events


def add(core, req_id, prompt, max_tokens):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    core.submit(AddRequest(req_id, list(prompt), params, None, None, time.monotonic()))


def migrate_while_streaming(core, runner, prompts, max_tokens, min_tokens,
                            policy="migrate") -> Events:  # fmt: skip
    """Stream `prompts` (`max_tokens` each); once every one has more than `min_tokens` tokens,
    load V1 into the standby slot and commit it with `policy`; the commit's events."""
    for r, p in prompts.items():
        add(core, r, p, max_tokens)
    assert wait_for(lambda: all(len(runner.tokens.get(r, ())) > min_tokens for r in prompts))
    runner.slots.load(V1)
    events = Events()
    core.submit(SwapCommand(V1, policy, events))
    return events


def token_versions(deltas, prompts) -> dict[str, list[str]]:
    """Each stream's tokens' versions, once every streamed token is checked to be what the
    version its delta names computes."""
    out = {}
    for r, p in prompts.items():
        prev = p[-1]
        versions = out[r] = []
        for d in deltas[r]:
            for token in d.new_token_ids:
                assert token == next_token(prev, d.weights_version, 256), (r, len(versions))
                prev = token
                versions.append(d.weights_version)
    return out


def assert_tokens_carry_their_versions(deltas, prompts):
    """Every streamed token is what the version its delta names computes, and each stream
    switches from V0 to V1 once."""
    for versions in token_versions(deltas, prompts).values():
        cut = versions.index(V1)
        assert versions == [V0] * cut + [V1] * (len(versions) - cut)


def test_migrate_commit_reports_progress_and_deltas_carry_the_version_of_their_tokens(overlaps):
    core, runner, sink = make_core(overlaps, slow_s=0.002)
    try:
        prompts = {f"r{i}": bytes(range(10 + i, 30 + i)) for i in range(3)}
        events = migrate_while_streaming(core, runner, prompts, 40, 22)
        done = events.until_done()
        assert done[0].kind == "migrating"
        assert done[-1].kind == "committed"
        assert done[-1].num_migrating == 3
        assert done[-1].pause_s >= done[-1].flip_s > 0
        assert 0 < done[-1].typical_gap_s < 0.1  # busy steps ran before the commit
        deltas = sink.until_finished(set(prompts))
        assert_tokens_carry_their_versions(deltas, prompts)
        assert wait_for(lambda: core.status().num_blocks_used == 0)
        status = core.status()
        assert (status.weights_version, status.slot_versions, status.swapping) == (
            V1,
            (V0, V1),
            False,
        )
    finally:
        core.stop()


def test_a_restart_takes_requests_back_a_few_a_step_and_deltas_carry_their_versions(overlaps):
    # Scheduled ahead, a request's token from the step launched ahead would come back after
    # it was taken back, tagged with its new version: requests are taken back in turn.
    core, runner, sink = make_core(overlaps, slow_s=0.002, fixed_tokens=8)
    try:
        prompts = {f"r{i}": bytes(range(10 + i, 30 + i)) for i in range(3)}
        events = migrate_while_streaming(core, runner, prompts, 60, 22, policy="restart")
        done = events.until_done()
        committed = done[-1]
        assert (committed.kind, committed.policy, committed.num_restarted) == (
            "committed",
            "restart",
            3,
        )
        deltas = sink.until_finished(set(prompts))
        assert_tokens_carry_their_versions(deltas, prompts)
        assert wait_for(lambda: core.status().num_blocks_used == 0)
    finally:
        core.stop()


def test_a_migration_runs_its_steps_ahead_but_for_the_catch_up_and_the_flip(rng):
    # Asynchronous scheduling: shadows catch up over many steps scheduled ahead (the fake
    # runner asserts no shadow reads a token the host has not seen, and every KV read is its
    # own version's); only the last two steps of the migration run in turn.
    steps = Steps()
    core, runner, sink = make_core("ahead", slow_s=0.001, observer=steps, fixed_tokens=12,
                                   num_blocks=256)  # fmt: skip
    try:
        prompts = {f"r{i}": bytes(rng.randrange(1, 250) for _ in range(rng.randrange(20, 40)))
                   for i in range(4)}  # fmt: skip
        events = migrate_while_streaming(core, runner, prompts, 150, 60)
        done = events.until_done()
        assert done[-1].kind == "committed"
        assert done[-1].num_migrating == 4
        deltas = sink.until_finished(set(prompts))
    finally:
        core.stop()
    first = next(i for i, r in enumerate(steps.records)
                 if any(n.shadow_of for n in r.sched_out.new_reqs))  # fmt: skip
    flip = next(i for i, r in enumerate(steps.records) if r.sched_out.committed_version)
    migrating = steps.records[first : flip + 1]
    assert len(migrating) > 20, "shadows of 80-100 tokens, 12 tokens a step, 4 added a step"
    in_turn = [r.index for r in migrating if not r.sched_out.applied_ahead]
    assert len(in_turn) <= 3, f"steps {in_turn} of {len(migrating)} ran in turn"
    assert_tokens_carry_their_versions(deltas, prompts)


class TokenTimeline(Collector):
    """A sink that checks, each time a step's tokens reach the engine thread, that every token
    of the steps before it was delivered by then: no token waits for another step."""

    def __init__(self, runner: FakeRunner):
        super().__init__()
        self.delivered: dict[str, int] = {}
        self.computed: dict[str, int] = {}  # as of the last step's result
        self.late: list[tuple[str, int, int]] = []  # (request, delivered, computed before)
        launch = runner.launch

        def launch_and_check(so):
            done = launch(so)
            result = done.result

            def checked_result():
                out = result()
                for req_id, before in self.computed.items():
                    if self.delivered.get(req_id, 0) < before:
                        self.late.append((req_id, self.delivered.get(req_id, 0), before))
                for req_id, tokens in zip(out.req_ids, out.sampled_token_ids):
                    if tokens:
                        self.computed[req_id] = self.computed.get(req_id, 0) + len(tokens)
                return out

            done.result = checked_result
            return done

        runner.launch = launch_and_check

    def __call__(self, deltas):
        for d in deltas:
            self.delivered[d.req_id] = self.delivered.get(d.req_id, 0) + len(d.new_token_ids)
        super().__call__(deltas)


class CommitMark(Events):
    """Events, and how many steps had run when the commit was reported (engine thread)."""

    def __init__(self, steps: Steps):
        super().__init__()
        self.steps = steps
        self.at_step: int | None = None

    def __call__(self, event):
        if event.kind == "committed":
            self.at_step = len(self.steps.records)
        super().__call__(event)


@pytest.mark.parametrize("policy", ["drain", "restart-in-place", "restart"])
def test_scheduled_ahead_a_commit_holds_back_no_token_and_the_steps_after_it_run_ahead(policy):
    # The step launched ahead is finished for the commit: its tokens go out at once, not
    # after the next step's (every stream's gap was two steps there). The step whose start
    # measures the pause runs ahead, as every later one: only the one launched onto the idle
    # device after the commit has no step scheduled over it (it ran in turn before, and the
    # next one again found no step ahead: two gaps of host plus device time). A restart that
    # takes requests back a few a step does so in steps scheduled ahead too (it ran them in
    # turn: on a GPU, host and device time one after the other in every one of its steps),
    # and every token still carries the version that computed it.
    steps = Steps()
    core, runner, sink = make_core("ahead", num_slots=1 if policy == "restart-in-place" else 2,
                                   slow_s=0.002, observer=steps,
                                   sink_for=TokenTimeline)  # fmt: skip
    try:
        prompts = {f"r{i}": bytes(range(10 + i, 30 + i)) for i in range(3)}
        for r, p in prompts.items():
            add(core, r, p, 60)
        assert wait_for(lambda: all(len(runner.tokens.get(r, ())) > len(p) + 15
                                    for r, p in prompts.items()))  # fmt: skip
        events = CommitMark(steps)
        if policy in ("drain", "restart"):
            runner.slots.load(V1)
            core.submit(SwapCommand(V1, policy, events))
        else:
            in_place = InPlaceCopy({"model.norm.weight": torch.ones(4)}, 1024)
            core.submit(SwapCommand(V1, "restart", events, in_place=in_place))
        done = events.until_done()
        assert done[-1].kind == "committed"
        deltas = sink.until_finished(set(prompts))
    finally:
        core.stop()
    assert sink.late == []
    assert events.at_step is not None
    after = steps.records[events.at_step - 1 : -1]  # the step before the flip's; not the last
    not_ahead = [r.index for r in after if not r.sched_out.applied_ahead]
    assert len(after) > 10
    assert len(not_ahead) <= 1, (not_ahead, len(after))
    if policy == "drain":  # the streams stay on V0
        assert {v for vs in token_versions(deltas, prompts).values() for v in vs} == {V0}
    else:
        assert_tokens_carry_their_versions(deltas, prompts)


class Preemptions(NullObserver):
    def __init__(self):
        self.num = 0

    def on_request_preempted(self, request, now, preemption):
        self.num += 1


@pytest.mark.parametrize("policy", ["migrate", "restart"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_a_request_preempted_while_its_token_is_in_flight_keeps_that_tokens_version(policy, seed):
    # Scheduled ahead, with too few blocks for the requests and their shadows: requests are
    # preempted while the step launched ahead samples their next token, and the swap gives
    # them the new version as they go (a migrating one loses its shadow, one a restart had
    # still to take back is recomputed on the new version). That token was computed on the
    # old version and must say so (it said the new one: every seed of the migrate case).
    rng = random.Random(seed)
    preemptions = Preemptions()
    core, runner, sink = make_core("ahead", slow_s=0.0005, num_blocks=48, fixed_tokens=12,
                                   observer=preemptions)  # fmt: skip
    try:
        prompts = {f"r{i}": bytes(rng.randrange(1, 250) for _ in range(rng.randrange(10, 30)))
                   for i in range(4)}  # fmt: skip
        events = migrate_while_streaming(core, runner, prompts, 50, 8, policy=policy)
        assert events.until_done()[-1].kind == "committed"
        deltas = sink.until_finished(set(prompts))
        assert_tokens_carry_their_versions(deltas, prompts)
        assert wait_for(lambda: core.status().num_blocks_used == 0)
    finally:
        core.stop()
    assert preemptions.num > 0, "the blocks were meant to run out"


def test_a_step_failing_mid_migration_ahead_fails_its_requests_and_leaks_no_block():
    # Shadows count their chunks when scheduled: a step that fails must take its shadows
    # (with their requests) down, and the engine serves on.
    core, runner, sink = make_core("ahead", slow_s=0.001, fixed_tokens=4, num_blocks=256)
    try:
        prompts = {f"r{i}": bytes(random.randrange(1, 250) for _ in range(30)) for i in range(3)}
        events = migrate_while_streaming(core, runner, prompts, 200, 50)
        assert wait_for(lambda: core.scheduler.swaps.migration is not None)
        runner.fail_next = True
        deltas = sink.until_finished(set(prompts))
        assert all(deltas[r][-1].error for r in prompts), "the failed step's requests failed"
        assert events.until_done()[-1].kind == "committed"  # nothing left to migrate
        assert wait_for(lambda: core.status().num_blocks_used == 0)
        add(core, "after", b"hello there", 12)  # the engine serves on, on the new version
        (last,) = [d for d in sink.until_finished({"after"})["after"] if d.finished]
        assert not last.error
        assert last.weights_version == V1
    finally:
        core.stop()


def test_commit_of_a_version_in_no_slot_fails_and_changes_nothing(overlaps):
    core, _, _ = make_core(overlaps)
    try:
        events = Events()
        core.submit(SwapCommand("fake@7", "migrate", events))
        (event,) = events.until_done()
        assert event.kind == "failed"
        assert "not in a weight slot" in event.message
        assert core.status().weights_version == V0
    finally:
        core.stop()


def test_with_one_slot_the_commit_copies_in_place_and_recomputes_requests(overlaps):
    core, runner, sink = make_core(overlaps, num_slots=1, slow_s=0.002)
    try:
        add(core, "a", b"abcdefgh", 40)
        assert wait_for(lambda: len(runner.tokens.get("a", ())) > 12)
        tensors = {"model.norm.weight": torch.ones(4)}
        events = Events()
        core.submit(SwapCommand(V1, "migrate", events, in_place=InPlaceCopy(tensors, 1024)))
        (event,) = events.until_done()
        assert event.kind == "committed"
        assert event.policy == "restart"  # one slot: the old weights are gone
        assert event.num_restarted == 1
        # Copied over the only slot, on the engine thread, while it held no version.
        assert runner.slots.copies == [("sitsd-engine", 0, [None], ["model.norm.weight"], 1024)]
        deltas = sink.until_finished({"a"})["a"]
        assert deltas[-1].weights_version == V1
        assert core.status().slot_versions == (V1,)
    finally:
        core.stop()


def test_an_engine_call_runs_on_the_engine_thread_and_replies():
    core, _, _ = make_core(False)
    try:
        replies = queue.Queue()
        core.submit(EngineCall(lambda: (threading.current_thread().name, core.num_steps),
                               lambda result, exc: replies.put((result, exc))))  # fmt: skip
        core.submit(EngineCall(lambda: 1 / 0, lambda result, exc: replies.put((result, exc))))
        (name, _), exc = replies.get(timeout=10)
        assert (name, exc) == ("sitsd-engine", None)
        result, exc = replies.get(timeout=10)
        assert result is None
        assert isinstance(exc, ZeroDivisionError)
    finally:
        core.stop()


def test_a_call_on_the_standby_slot_finishes_the_step_ahead_only_if_that_step_reads_it():
    # Finishing the step launched ahead leaves the device idle while the host schedules the
    # next: on an H200, steps of 9-13 ms (0 ms waiting for the device) at the start of every
    # weight push, where steady ones take 5. A call that takes the standby slot's version
    # away waits only for a step that reads that version.
    core, runner, _ = make_core("ahead", slow_s=0.002)

    def in_flight(waits_for) -> bool:
        """Whether the step launched ahead was still in flight when the call ran."""
        replies = queue.Queue()
        core.submit(EngineCall(lambda: any(runner.unseen.values()),
                               lambda result, exc: replies.put((result, exc)),
                               waits_for))  # fmt: skip
        result, exc = replies.get(timeout=10)
        assert exc is None
        return result

    try:
        add(core, "old", b"abcdefgh", 100_000)
        assert wait_for(lambda: len(runner.tokens.get("old", ())) > 10)
        runner.slots.load(V1)  # the standby slot: no step reads it
        assert in_flight("standby")  # the step ahead reads V0 only: it runs on
        assert not in_flight("any")
        events = Events()
        core.submit(SwapCommand(V1, "drain", events))
        assert events.until_done()[-1].kind == "committed"
        # "old" drains on V0, in the standby slot now: the step ahead reads it.
        assert not in_flight("standby")
        assert in_flight("none")
    finally:
        core.stop()


@pytest.mark.parametrize("mode", [True, "ahead"], ids=["in-turn", "ahead"])
def test_each_step_record_holds_how_long_the_engine_waited_for_the_device(mode):
    # A runner whose launched steps take `device_s` to deliver their tokens: the engine thread
    # waits that long in `result()` for each, and the record says so (the slow-step log splits
    # a long step's period into that wait and the host's own work). Its launches take
    # `launch_s` of the host's time, and its updates `update_s`: the record's host parts
    # count them where they were spent.
    device_s = random.uniform(0.005, 0.015)
    launch_s, update_s = random.uniform(0.002, 0.004), random.uniform(0.002, 0.004)
    steps = Steps()
    core, runner, sink = make_core(mode, observer=steps)
    launch = runner.launch
    update = core.scheduler.update_from_output
    core.scheduler.update_from_output = lambda so, out: (time.sleep(update_s), update(so, out))[1]

    def slow_device(so):
        time.sleep(launch_s)
        done = launch(so)
        tokens_of = done.result
        done.result = lambda: (time.sleep(device_s), tokens_of())[1]
        return done

    runner.launch = slow_device
    try:
        add(core, "r0", b"the prompt", 12)
        sink.until_finished({"r0"})
    finally:
        core.stop()
    busy = [r for r in steps.records if r.sched_out.total_num_scheduled_tokens]
    assert len(busy) >= 12
    for r in busy:
        assert device_s <= r.wait_s <= r.end - r.start + device_s, (r.index, r.wait_s)
        assert r.host.update_s >= update_s, (r.index, r.host)
        assert r.host.schedule_s > 0
    # In turn a record's launch is its own step's; scheduled ahead, the next one's (the last
    # step's turn launched nothing).
    launched = busy if mode is True else busy[:-1]
    assert all(r.host.launch_s >= launch_s for r in launched), [r.host for r in launched]
