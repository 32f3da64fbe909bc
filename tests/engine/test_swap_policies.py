"""Swap policies in the scheduler, with the fake runner: which version computes which token,
block accounting, and no forward pass mixing versions (the fake runner asserts it on every read).

The fake model samples `last + 1 + N` under version `fake@N`, so a token tells its version.
"""

from __future__ import annotations

import itertools
import random

import pytest

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.pacing import PacingSettings
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.types import FinishReason, SamplingParams, Tier
from tests.engine.fakes import FakeRunner, next_token

BLOCK = 4
V0, V1, V2 = "fake@0", "fake@1", "fake@2"


class Engine:
    """A scheduler and the fake runner, stepped by hand; `swap` does what a commit does."""

    def __init__(self, num_blocks=256, max_num_seqs=8, budget=64, policy="fcfs", migrate=64,
                 drain_hold_s=0.0):  # fmt: skip
        self.kv = KVCacheManager(num_blocks, BLOCK)
        cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                              policy=policy)  # fmt: skip
        self.now = 0.0
        pacing = PacingSettings(fixed_tokens=migrate, drain_hold_s=drain_hold_s)
        self.sched = Scheduler(cfg, self.kv, 512, clock=lambda: self.now, pacing=pacing)
        self.runner = FakeRunner(BLOCK)
        self.tokens: dict[str, list[tuple[int, str]]] = {}  # req_id -> (token, version)
        self.finished: dict[str, FinishReason] = {}
        self.num_steps = 0

    def add(self, req_id, prompt, max_tokens=20, tier=Tier.SILVER):
        self.sched.add_request(Request(
            req_id=req_id, prompt_token_ids=list(prompt),
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True), seed=0, tier=tier,
            arrival_time=0.0, weights_version=self.runner.slots.active_version,
        ))  # fmt: skip
        self.tokens[req_id] = []

    def step(self):
        so = self.sched.schedule()
        updates = self.sched.update_from_output(so, self.runner.execute(so))
        for u in updates:
            self.tokens[u.request.req_id] += [(t, u.weights_version) for t in u.new_token_ids]
            if u.finish_reason is not None:
                self.finished[u.request.req_id] = u.finish_reason
        self.num_steps += 1
        return so

    def run(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("did not finish")

    def swap(self, version, policy):
        slots = self.runner.slots
        if slots.index_of(version) is None:
            in_use = self.sched.swaps.num_on_version(slots.standby_version or "")
            assert in_use == 0, "standby in use"
            slots.load(version)
        slots.activate(version)
        return self.sched.swaps.switch(version, policy)

    def assert_all_free(self):
        assert not self.sched.has_work()
        assert self.kv.num_used_blocks == 0
        assert self.kv.pool.num_free_blocks == self.kv.num_blocks
        assert self.sched.swaps.migration is None


def prompt(n=None):
    return [random.randrange(1, 900) for _ in range(n or random.randrange(3, 30))]


def consistent(tokens, prompt_ids):
    """Every token is `next_token(previous, its version)`: the version really computed it."""
    prev = prompt_ids[-1]
    for token, version in tokens:
        assert token == next_token(prev, version, 1000), (token, version)
        prev = token


def test_drain_leaves_started_requests_on_the_old_version_and_starts_new_ones_on_the_new():
    e = Engine()
    old = {f"old{i}": prompt() for i in range(3)}
    for r, p in old.items():
        e.add(r, p)
    for _ in range(4):
        e.step()
    switch = e.swap(V1, "drain")
    assert (switch.from_version, switch.num_draining) == (V0, 3)
    new = {f"new{i}": prompt() for i in range(3)}
    for r, p in new.items():
        e.add(r, p)
    e.step()
    assert e.sched.swaps.num_on_version(V0) == 3
    e.run()
    assert e.runner.max_versions_in_step == 2  # both slots served in the same steps
    for r, p in old.items():
        assert {v for _, v in e.tokens[r]} == {V0}
        consistent(e.tokens[r], p)
    for r, p in new.items():
        assert {v for _, v in e.tokens[r]} == {V1}
        consistent(e.tokens[r], p)
    assert e.sched.swaps.num_on_version(V0) == 0
    e.assert_all_free()


@pytest.mark.parametrize("policy", ["fcfs", "tiers"])
def test_a_drain_holds_new_requests_until_the_old_ones_finish_so_no_step_reads_both(policy):
    eng = Engine(policy=policy, drain_hold_s=5.0)
    old = {f"old{i}": prompt() for i in range(3)}
    for r, p in old.items():
        eng.add(r, p, max_tokens=random.randrange(8, 20))
    for _ in range(3):
        eng.step()
    eng.swap(V1, "drain")
    new = {f"new{i}": prompt() for i in range(3)}
    for r, p in new.items():
        eng.add(r, p, max_tokens=10)
    eng.run()
    assert eng.runner.max_versions_in_step == 1, "a step served both versions"
    for r, p in {**old, **new}.items():
        assert eng.finished[r] is FinishReason.LENGTH
        assert {v for _, v in eng.tokens[r]} == {V1 if r.startswith("new") else V0}
        consistent(eng.tokens[r], p)
    eng.assert_all_free()


def test_a_drain_holds_new_requests_no_longer_than_its_hold():
    eng = Engine(drain_hold_s=1.0)
    eng.add("old", prompt(), max_tokens=400)
    eng.step()
    eng.swap(V1, "drain")
    eng.add("new", prompt(), max_tokens=5)
    for _ in range(5):
        eng.step()
    assert not eng.tokens["new"], "held while the old request drains"
    eng.now = 1.0  # the hold is over: the new request runs next to the draining one
    for _ in range(10):
        eng.step()
    assert eng.finished["new"] is FinishReason.LENGTH
    assert "old" not in eng.finished
    assert eng.runner.max_versions_in_step == 2


def test_drain_keeps_a_preempted_old_request_on_the_old_version():
    e = Engine(num_blocks=12)
    e.add("a", prompt(12), max_tokens=16)
    e.add("b", prompt(12), max_tokens=16)
    for _ in range(3):
        e.step()
    e.swap(V1, "drain")
    e.run()  # 12 blocks cannot hold both to the end: one is preempted and recomputed
    assert e.sched.num_preemptions > 0
    for r in ("a", "b"):
        assert {v for _, v in e.tokens[r]} == {V0}
    e.assert_all_free()


def test_restart_takes_requests_back_a_few_a_step_in_order_onto_the_new_version():
    e = Engine(migrate=48)  # each step may recompute 48 tokens of the restarted contexts
    prompts = {f"r{i}": prompt(random.randrange(20, 30)) for i in range(4)}
    for r, p in prompts.items():
        e.add(r, p)
    for _ in range(5):
        e.step()
    before = {r: len(t) for r, t in e.tokens.items()}
    switch = e.swap(V1, "restart")
    assert switch.num_restarted == 4
    taken = []  # per step: the requests it took back
    while e.sched.swaps.rolling:
        contexts = {r: e.sched.requests[r].num_tokens for r in prompts if r in e.sched.requests}
        so = e.step()
        taken.append([r for r in prompts if r in so.preempted_req_ids])
        # Each one's whole context fits the step's room: its stream waits one step.
        assert sum(contexts[r] for r in taken[-1]) <= 48
        assert len(taken) < 100, "the restart never took them all back"
    assert [r for step in taken for r in step] == list(prompts), "in batch order, each once"
    assert sum(1 for step in taken if step) > 1, "a few a step, not all at once"
    e.run()
    for r, p in prompts.items():
        versions = [v for _, v in e.tokens[r]]
        cut = versions.index(V1)
        assert cut >= before[r]
        assert versions == [V0] * cut + [V1] * (20 - cut)
        consistent(e.tokens[r], p)
    e.assert_all_free()


def test_a_restart_whose_old_weights_are_gone_takes_every_request_back_at_once():
    e = Engine()
    prompts = {f"r{i}": prompt() for i in range(4)}
    for r, p in prompts.items():
        e.add(r, p)
    for _ in range(5):
        e.step()
    before = {r: len(t) for r, t in e.tokens.items()}
    e.runner.slots.load(V1)
    e.runner.slots.activate(V1)
    switch = e.sched.swaps.switch(V1, "restart", keeps_old=False)
    assert switch.num_restarted == 4
    so = e.step()
    assert set(so.preempted_req_ids) == set(prompts)
    e.run()
    for r, p in prompts.items():
        versions = [v for _, v in e.tokens[r]]
        assert versions == [V0] * before[r] + [V1] * (20 - before[r])
        consistent(e.tokens[r], p)
    e.assert_all_free()


def test_a_request_a_restart_had_still_to_take_back_is_recomputed_on_the_new_version():
    # The room (10 tokens a step) holds no whole context: the silver request recomputes over
    # two steps, and the bronze ones wait their turn on the old version. A gold arrival
    # preempts one of them: it must come back on the new version, not finish on the old.
    e = Engine(policy="tiers", max_num_seqs=3, migrate=10)
    prompts = {"a": prompt(12), "b": prompt(20), "c": prompt(20)}
    for r, p in prompts.items():
        e.add(r, p, max_tokens=40, tier=Tier.SILVER if r == "a" else Tier.BRONZE)
    for _ in range(3):
        e.step()
    e.swap(V1, "restart")
    e.step()
    e.add("gold", prompt(5), max_tokens=5, tier=Tier.GOLD)
    so = e.step()
    assert [p.reason.value for p in so.preemptions] == ["tier"]
    e.run()
    for r, p in prompts.items():
        versions = [v for _, v in e.tokens[r]]
        cut = versions.index(V1)
        assert versions == [V0] * cut + [V1] * (40 - cut), r
        consistent(e.tokens[r], p)
    e.assert_all_free()


def run_migration(e, prompts, steps_before=4, max_tokens=80):
    """Requests long enough to outlast the migration; a swap to V1 after `steps_before`."""
    for r, p in prompts.items():
        e.add(r, p, max_tokens=max_tokens)
    for _ in range(steps_before):
        e.step()
    switch = e.swap(V1, "migrate")
    flip_step = None
    while e.sched.has_work():
        so = e.step()
        if so.committed_version is not None:
            flip_step = so
    return switch, flip_step


def test_migrate_recomputes_kv_in_shadows_then_flips_every_request_in_one_step():
    e = Engine(budget=256, migrate=16)
    prompts = {f"r{i}": prompt(random.randrange(20, 60)) for i in range(4)}
    switch, flip = run_migration(e, prompts)
    assert switch.num_migrating == 4
    assert flip is not None
    assert {m.req_id for m in flip.migrated} == set(prompts)  # all in the same step
    for r, p in prompts.items():
        versions = [v for _, v in e.tokens[r]]
        switch_at = versions.index(V1)
        assert versions == [V0] * switch_at + [V1] * (80 - switch_at)
        consistent(e.tokens[r], p)  # after the flip: exactly what V1 makes of that prefix
    assert e.runner.max_versions_in_step == 2  # decodes on V0 next to shadows on V1
    e.assert_all_free()


def test_migrating_requests_never_miss_a_step():
    e = Engine(budget=256, migrate=8)
    prompts = {f"r{i}": prompt(40) for i in range(3)}
    for r, p in prompts.items():
        e.add(r, p, max_tokens=40)
    for _ in range(4):
        e.step()
    e.swap(V1, "migrate")
    counts = []
    while e.sched.swaps.migration is not None or not counts:
        e.step()
        counts.append({r: len(t) for r, t in e.tokens.items()})
    for before, after in itertools.pairwise(counts):
        assert all(after[r] == before[r] + 1 for r in prompts)  # one token per step, each step


def test_a_request_finishing_or_aborted_mid_migration_frees_its_shadow():
    e = Engine(budget=256, migrate=4)
    e.add("short", prompt(40), max_tokens=6)
    e.add("aborted", prompt(40), max_tokens=30)
    e.add("long", prompt(40), max_tokens=30)
    for _ in range(3):
        e.step()
    e.swap(V1, "migrate")
    e.step()
    assert e.sched.swaps.migration is not None
    e.sched.finish_request("aborted", FinishReason.ABORT)
    e.run()
    assert e.finished["short"] is FinishReason.LENGTH
    e.assert_all_free()


def test_a_shadow_without_free_blocks_falls_back_to_recomputing_its_request():
    e = Engine(num_blocks=40, budget=256, migrate=256)
    prompts = {f"r{i}": prompt(40) for i in range(3)}  # 3 x 11 blocks: no room for 3 shadows
    _, flip = run_migration(e, prompts, steps_before=2)
    assert flip is not None
    migration = e.sched.swaps.last_migration
    assert migration.num_restarted >= 1
    for r, p in prompts.items():
        consistent(e.tokens[r], p)
        assert e.tokens[r][-1][1] == V1
    e.assert_all_free()


def test_gold_preempting_a_migrating_bronze_request_drops_its_shadow():
    e = Engine(num_blocks=30, max_num_seqs=2, budget=256, policy="tiers", migrate=4)
    bronze = prompt(40)
    e.add("bronze", bronze, max_tokens=30, tier=Tier.BRONZE)
    e.add("silver", prompt(8), max_tokens=30)
    for _ in range(2):
        e.step()
    e.swap(V1, "migrate")
    e.step()
    e.add("gold", prompt(8), max_tokens=5, tier=Tier.GOLD)  # no slot: preempts bronze
    e.run()
    assert {v for _, v in e.tokens["gold"]} == {V1}
    assert e.tokens["bronze"][-1][1] == V1
    consistent(e.tokens["bronze"], bronze)
    e.assert_all_free()


@pytest.mark.parametrize("policy", ["migrate", "drain", "restart"])
def test_a_hundred_swaps_under_load_leak_no_block_and_no_slot(rng, policy):
    e = Engine(num_blocks=160, budget=48, migrate=24)
    versions = [V1, V2]
    n = 0
    swaps = 0
    while swaps < 100:
        while len(e.sched.requests) < 6:
            e.add(f"r{n}", prompt(rng.randrange(3, 40)), max_tokens=rng.randrange(1, 30))
            n += 1
        e.step()
        target = versions[swaps % 2]
        in_use = e.sched.swaps.num_on_version(e.runner.slots.standby_version or "")
        if e.sched.swaps.migration is None and (in_use == 0 or policy == "migrate"):
            e.swap(target, policy)
            swaps += 1
    e.run()
    e.assert_all_free()
    assert sorted(v for v in e.runner.slots.versions if v) == sorted(versions)
    assert len(e.finished) == n
    e.runner.execute(e.sched.schedule())  # an empty step tells the runner what finished last
    assert not e.runner.tokens  # it holds no request (or shadow) state either
