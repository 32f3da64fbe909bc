"""The tiers policy on simulated time: tier order, preemption by gold, aging, caps, admission.

A `Sim` drives the scheduler the way the engine core does (drop overdue requests, schedule,
execute on the fake runner, advance the simulated clock by one step, update), so every timing
here is deterministic.
"""

from __future__ import annotations

import pytest

from sitsd.config import SchedulerConfig, TierConfig, TiersConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request, RequestStatus
from sitsd.engine.scheduler import Scheduler
from sitsd.plugins.interface import TierEstimate
from sitsd.plugins.p99_caps import P99BatchController
from sitsd.types import FinishReason, SamplingParams, Tier
from tests.engine.fakes import FakeRunner

BLOCK = 4
STEP_S = 0.05
GOLD, SILVER, BRONZE = Tier.GOLD, Tier.SILVER, Tier.BRONZE


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Sim:
    """A scheduler, a fake runner and a simulated clock, stepped like the engine core."""

    def __init__(self, tiers=None, num_blocks=64, max_num_seqs=4, budget=64, policy="tiers"):
        self.clock = FakeClock()
        kv = KVCacheManager(num_blocks, BLOCK)
        cfg = SchedulerConfig(
            max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy
        )
        self.sched = Scheduler(cfg, kv, 1024, clock=self.clock, tiers=tiers or TiersConfig())
        self.runner = FakeRunner(BLOCK)
        self.finished: dict[str, Request] = {}
        self.shed: set[str] = set()
        self.preempted: list[str] = []
        self._ids = 0

    def add(self, tier, prompt_len=8, max_tokens=8, req_id=None) -> Request:
        self._ids += 1
        req_id = req_id or f"{tier.value}-{self._ids}"
        request = Request(
            req_id=req_id,
            prompt_token_ids=[(self._ids * 7 + i) % 1000 for i in range(prompt_len)],
            params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
            seed=0,
            tier=tier,
            arrival_time=self.clock.now,
            weights_version="fake@0",
        )
        self.sched.add_request(request)
        return request

    def step(self, step_s=STEP_S):
        for req_id, _ in self.sched.overdue_requests(self.clock.now):
            self.sched.finish_request(req_id, FinishReason.ABORT)
            self.shed.add(req_id)
        so = self.sched.schedule()
        out = self.runner.execute(so)
        self.clock.now += step_s
        self.preempted += sorted(so.preempted_req_ids)
        for update in self.sched.update_from_output(so, out):
            if update.finish_reason is not None:
                self.finished[update.request.req_id] = update.request
        return so

    def run_until_idle(self, max_steps=2000):
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("requests did not finish")

    @property
    def running_ids(self) -> set[str]:
        return {r.req_id for r in self.sched.running}


def relaxed(**changes) -> TiersConfig:
    """Tiers whose queue limits never shed (for tests about order and preemption only)."""
    slow = TierConfig(ttft_p99_s=100, itl_p99_s=100, max_queue_wait_s=1000)
    return TiersConfig(gold=slow, silver=slow, bronze=slow, **changes)


def test_waiting_gold_preempts_the_newest_running_bronze_when_the_batch_is_full():
    sim = Sim(tiers=relaxed(), max_num_seqs=2)
    sim.add(BRONZE, max_tokens=30, req_id="b-old")
    sim.step()
    sim.add(BRONZE, max_tokens=30, req_id="b-new")
    sim.step()
    assert sim.running_ids == {"b-old", "b-new"}

    sim.add(GOLD, max_tokens=4, req_id="gold")
    so = sim.step()

    assert [n.req_id for n in so.new_reqs] == ["gold"]
    assert so.preempted_req_ids == {"b-new"}
    assert "b-new" not in so.num_scheduled_tokens
    assert sim.sched.requests["b-new"].status is RequestStatus.PREEMPTED
    sim.run_until_idle()
    # The preempted request resumes where it stopped: same tokens as if never preempted.
    first = sim.finished["b-new"].prompt_token_ids[-1]
    assert sim.finished["b-new"].output_token_ids == [(first + k) % 1000 for k in range(1, 31)]
    assert sim.sched.kv_cache.num_used_blocks == 0


def test_gold_preempts_bronze_before_silver_and_never_gold():
    sim = Sim(tiers=relaxed(), max_num_seqs=3)
    sim.add(SILVER, max_tokens=40, req_id="silver")
    sim.add(GOLD, max_tokens=40, req_id="gold-1")
    sim.add(BRONZE, max_tokens=40, req_id="bronze")
    sim.step()
    sim.add(GOLD, max_tokens=4, req_id="gold-2")
    assert sim.step().preempted_req_ids == {"bronze"}
    sim.add(GOLD, max_tokens=4, req_id="gold-3")
    assert sim.step().preempted_req_ids == {"silver"}
    sim.add(GOLD, max_tokens=4, req_id="gold-4")
    so = sim.step()
    assert so.preempted_req_ids == set()  # only gold is running: gold-4 waits
    assert sim.sched.requests["gold-4"].status is RequestStatus.WAITING


def test_gold_preempts_bronze_when_kv_blocks_run_out():
    # 8 blocks of 4 tokens: two bronze requests of 14 tokens hold all of them.
    sim = Sim(tiers=relaxed(), num_blocks=8, max_num_seqs=8)
    sim.add(BRONZE, prompt_len=14, max_tokens=2, req_id="b1")
    sim.add(BRONZE, prompt_len=14, max_tokens=2, req_id="b2")
    sim.step()
    assert sim.sched.kv_cache.pool.num_free_blocks == 0
    sim.add(GOLD, prompt_len=6, max_tokens=2, req_id="gold")
    so = sim.step()
    assert [n.req_id for n in so.new_reqs] == ["gold"]
    assert so.preempted_req_ids == {"b2"}
    sim.run_until_idle()
    assert set(sim.finished) == {"b1", "b2", "gold"}
    assert sim.sched.kv_cache.num_used_blocks == 0


def test_silver_waits_instead_of_preempting_bronze():
    sim = Sim(tiers=relaxed(), max_num_seqs=1)
    sim.add(BRONZE, max_tokens=20, req_id="bronze")
    sim.step()
    sim.add(SILVER, max_tokens=2, req_id="silver")
    so = sim.step()
    assert so.preempted_req_ids == set()
    assert sim.running_ids == {"bronze"}


def test_gold_is_admitted_before_bronze_that_arrived_just_before_it():
    sim = Sim(max_num_seqs=1)
    sim.add(BRONZE, req_id="bronze")
    sim.clock.now += 0.01
    sim.add(GOLD, req_id="gold")
    assert [n.req_id for n in sim.step().new_reqs] == ["gold"]


def test_bronze_that_waited_long_enough_outranks_fresh_gold():
    # Aging: bronze ranks as if it had arrived 250 ms later than it did, so after 250 ms it
    # goes before a gold request that arrives now.
    sim = Sim(max_num_seqs=1)
    bronze = sim.add(BRONZE, req_id="bronze")
    sim.clock.now += 0.26
    sim.add(GOLD, req_id="gold")
    assert [n.req_id for n in sim.step().new_reqs] == ["bronze"]
    assert bronze.first_scheduled_time is not None


def test_fcfs_policy_ignores_tiers():
    sim = Sim(policy="fcfs", max_num_seqs=1)
    sim.add(BRONZE, max_tokens=20, req_id="bronze")
    sim.step()
    sim.add(GOLD, max_tokens=2, req_id="gold")
    for _ in range(5):
        assert not sim.step().preempted_req_ids
    assert sim.running_ids == {"bronze"}
    assert sim.sched.overdue_requests(sim.clock.now + 60) == []


def test_bronze_is_not_starved_under_sustained_gold_load():
    # Two batch slots, each busy ~7 steps per gold request; one gold request arrives every
    # step, about 3.5x what the slots can serve. A bronze request arrives early on. Gold
    # beyond capacity is shed after 120 ms; bronze must still be served within its 500 ms.
    sim = Sim(max_num_seqs=2)
    for step in range(120):
        sim.add(GOLD, max_tokens=6)
        if step == 10:
            bronze = sim.add(BRONZE, max_tokens=10, req_id="bronze")
        sim.step()
    assert "bronze" not in sim.shed
    assert sim.finished["bronze"].output_token_ids  # served to the end
    assert bronze.first_scheduled_time - bronze.arrival_time <= 0.5
    assert len(sim.shed) > 0, "the gold load must exceed capacity for this test to mean much"
    assert sum(1 for r in sim.finished if r.startswith("gold")) > 20


def test_a_request_is_preempted_for_a_higher_tier_at_most_max_tier_preemptions_times():
    sim = Sim(tiers=relaxed(max_tier_preemptions=2), max_num_seqs=1)
    sim.add(BRONZE, max_tokens=60, req_id="bronze")
    sim.step()
    for _ in range(40):
        if sim.sched.num_waiting == 0:
            sim.add(GOLD, max_tokens=2)
        sim.step()
    assert sim.preempted.count("bronze") == 2
    sim.run_until_idle()
    assert len(sim.finished["bronze"].output_token_ids) == 60


def test_queue_wait_past_the_tier_limit_sheds_only_requests_that_never_ran():
    sim = Sim(max_num_seqs=1)
    sim.add(SILVER, max_tokens=50, req_id="running")
    sim.step()
    sim.add(SILVER, req_id="queued")
    sim.clock.now += 0.2
    assert sim.sched.overdue_requests(sim.clock.now) == []
    sim.clock.now += 0.06  # 260 ms > silver's 250 ms
    ((req_id, reason),) = sim.sched.overdue_requests(sim.clock.now)
    assert req_id == "queued"
    assert "250 ms" in reason
    (silver,) = [t for t in sim.sched.tier_stats() if t.tier == "silver"]
    assert silver.num_shed == 1


def test_admission_refuses_when_the_queue_ahead_cannot_meet_the_tier_wait():
    sim = Sim(max_num_seqs=2, budget=16)
    sim.add(GOLD, max_tokens=200, req_id="g1")
    sim.add(GOLD, max_tokens=200, req_id="g2")
    sim.step(step_s=0.05)
    assert sim.sched.step_time_s == pytest.approx(0.05)

    def probe(tier, prompt_len=8):
        request = Request(
            f"probe-{tier}",
            list(range(prompt_len)),
            SamplingParams(max_tokens=4),
            0,
            tier,
            sim.clock.now,
        )
        return sim.sched.admission_refusal(request)

    # The batch is full of gold with ~200 steps (10 s) to go: bronze and silver cannot run
    # within their limits, and gold finds no lower tier to preempt.
    assert "expected queue wait" in probe(BRONZE).message
    assert "silver" in probe(SILVER).message
    assert probe(GOLD) is not None
    (bronze,) = [t for t in sim.sched.tier_stats() if t.tier == "bronze"]
    assert bronze.num_refused == 1


def test_admission_lets_gold_in_when_it_can_preempt_and_counts_prefill_ahead():
    sim = Sim(max_num_seqs=2, budget=16)
    sim.add(BRONZE, max_tokens=200, req_id="b1")
    sim.add(BRONZE, max_tokens=200, req_id="b2")
    sim.step(step_s=0.05)
    gold = Request("g", list(range(8)), SamplingParams(max_tokens=4), 0, GOLD, sim.clock.now)
    assert sim.sched.admission_refusal(gold) is None  # it can preempt the bronze work
    # 3 gold requests of 64 prompt tokens ahead: 192 tokens at 14 per step = 14 steps = 0.7 s.
    for i in range(3):
        sim.add(GOLD, prompt_len=64, req_id=f"ahead-{i}")
    late = Request("late", list(range(8)), SamplingParams(max_tokens=4), 0, GOLD, sim.clock.now)
    assert "exceeds the gold tier's 120 ms" in sim.sched.admission_refusal(late).message


def test_controller_shrinks_lower_tier_caps_when_gold_p99_is_over_target_and_regrows():
    controller = P99BatchController(TiersConfig(), max_num_seqs=32)

    def caps(gold_ttft, silver_ttft=None):
        estimates = {
            GOLD: TierEstimate(GOLD, gold_ttft, None, 100, 0.08, 0.08),
            SILVER: TierEstimate(SILVER, silver_ttft, None, 100, 0.2, 0.2),
        }
        return controller.update(estimates, 0.0)

    assert caps(0.02) == {GOLD: 32, SILVER: 32, BRONZE: 32}  # gold: the whole batch, 32
    over = caps(0.1)  # gold P99 125% of its target
    assert over[GOLD] == 32
    assert over[SILVER] == over[BRONZE] == 4
    middle = caps(0.06, silver_ttft=0.05)  # 75%: between the bounds
    assert 4 < middle[SILVER] <= 32
    caps(0.06, silver_ttft=0.3)  # silver over its own target: bronze shrinks, not silver
    now = caps(0.06, silver_ttft=0.3)
    assert now[BRONZE] == 4 < now[SILVER]
    history = [caps(0.01)[BRONZE] for _ in range(12)]
    assert history == sorted(history)  # grows back step by step
    assert history[0] < 32
    assert history[-1] == 32


def test_scheduler_applies_the_caps_from_live_gold_latency():
    tiers = TiersConfig(max_batch_cap=16, min_batch_cap=1, control_interval_s=0.1, window_s=5.0)
    sim = Sim(tiers=tiers, max_num_seqs=16, budget=256)
    # Slow steps: gold's inter-token P99 (0.3 s) is far above its 80 ms target.
    sim.add(GOLD, max_tokens=10, req_id="first-gold")
    for _ in range(3):
        sim.step(step_s=0.3)
    bronze_cap = {t.tier: t.batch_cap for t in sim.sched.tier_stats()}["bronze"]
    assert bronze_cap == 16, "one request's samples are too few to act on"
    for i in range(12):
        sim.add(GOLD, max_tokens=10, req_id=f"gold-{i}")
    for _ in range(3):
        sim.step(step_s=0.3)
    caps = {t.tier: t.batch_cap for t in sim.sched.tier_stats()}
    assert caps == {"gold": 16, "silver": 1, "bronze": 1}
    for i in range(5):
        sim.add(BRONZE, max_tokens=50, req_id=f"b{i}")
    sim.step(step_s=0.3)
    assert sum(1 for r in sim.sched.running if r.tier is BRONZE) == 1


def test_gold_runs_on_the_whole_batch_past_the_largest_lower_tier_cap():
    # Caps protect the tiers above a tier; none is above gold. Capped at max_batch_cap, a gold
    # burst waited for gold to finish while batch slots stood free.
    controller = P99BatchController(TiersConfig(max_batch_cap=4), max_num_seqs=12)
    assert controller.update({}, 0.0) == {GOLD: 12, SILVER: 4, BRONZE: 4}
    sim = Sim(tiers=relaxed(max_batch_cap=4, min_batch_cap=1), max_num_seqs=12, budget=256)
    for i in range(10):
        sim.add(GOLD, max_tokens=20, req_id=f"gold-{i}")
    for i in range(3):
        sim.add(BRONZE, max_tokens=20, req_id=f"bronze-{i}")
    sim.step()
    running = [r.tier for r in sim.sched.running]
    assert running.count(GOLD) == 10
    assert running.count(BRONZE) == 2  # the two slots left
    assert {t.tier: t.batch_cap for t in sim.sched.tier_stats()}["gold"] == 12


@pytest.mark.parametrize("gold_step_tokens", [512, 8])
def test_no_block_leaks_through_tier_preemption_aborts_and_shedding(rng, gold_step_tokens):
    sim = Sim(tiers=TiersConfig(gold_step_tokens=gold_step_tokens), num_blocks=24,
              max_num_seqs=4, budget=24)  # fmt: skip
    tiers = [GOLD, SILVER, BRONZE]
    for step in range(500):
        if step < 400 and rng.random() < 0.5:
            sim.add(
                rng.choice(tiers), prompt_len=rng.randrange(1, 20), max_tokens=rng.randrange(1, 25)
            )
        live = sorted(sim.sched.requests)
        if live and rng.random() < 0.05:
            sim.sched.finish_request(rng.choice(live), FinishReason.ABORT)
        if sim.sched.has_work():
            sim.step(step_s=rng.choice([0.01, 0.05]))
        kv = sim.sched.kv_cache
        held = sum(len(kv.block_ids(r)) for r in sim.sched.running)
        assert kv.num_used_blocks <= held
        for request in sim.sched.waiting:
            assert kv.block_ids(request) == []  # waiting and preempted requests hold nothing
    stats = {t.tier: t for t in sim.sched.tier_stats()}
    assert stats["bronze"].num_preempted + stats["silver"].num_preempted > 0
    for req_id in list(sim.sched.requests):
        sim.sched.finish_request(req_id, FinishReason.ABORT)
    assert sim.sched.kv_cache.num_used_blocks == 0
    assert sim.sched.kv_cache.pool.num_free_blocks == 24


def test_gold_is_not_charged_for_aged_lower_tier_work_it_passes_by_preemption():
    patient_bronze = TierConfig(
        ttft_p99_s=1.0, itl_p99_s=1.0, max_queue_wait_s=100.0, priority_offset_s=0.25
    )
    sim = Sim(tiers=TiersConfig(bronze=patient_bronze), max_num_seqs=2, budget=16)
    sim.add(BRONZE, max_tokens=200, req_id="b1")
    sim.add(BRONZE, max_tokens=200, req_id="b2")
    sim.step(step_s=0.05)
    for i in range(10):
        sim.add(BRONZE, prompt_len=64, req_id=f"queued-{i}")
    sim.clock.now += 1.0  # the queued bronze work now outranks fresh gold (aging)

    def probe(tier):
        request = Request(
            "probe", list(range(8)), SamplingParams(max_tokens=4), 0, tier, sim.clock.now
        )
        return sim.sched.admission_refusal(request)

    assert probe(GOLD) is None  # the batch is full: gold passes the queue by preemption
    assert "silver tier's 250 ms" in probe(SILVER).message  # silver cannot: 640 tokens ahead
    sim.add(GOLD, req_id="gold")
    so = sim.step()
    assert [n.req_id for n in so.new_reqs] == ["gold"]
    assert so.preempted_req_ids == {"b2"}


def test_a_request_preempted_before_its_first_token_can_still_be_shed():
    sim = Sim(tiers=TiersConfig(), max_num_seqs=1, budget=4)
    sim.add(BRONZE, prompt_len=40, max_tokens=4, req_id="bronze")  # 10 chunks of prefill
    sim.step()
    sim.add(GOLD, max_tokens=30, req_id="gold")
    assert sim.step().preempted_req_ids == {"bronze"}
    sim.clock.now += 0.5
    assert [r for r, _ in sim.sched.overdue_requests(sim.clock.now)] == ["bronze"]


def test_controller_acts_on_a_p99_only_once_its_window_has_enough_samples():
    controller = P99BatchController(TiersConfig(), max_num_seqs=32)

    def bronze_cap(num_ttft, num_itl):
        gold = TierEstimate(GOLD, 0.5, 0.5, num_ttft, 0.08, 0.08, num_itl)  # 6x over target
        return controller.update({GOLD: gold}, 0.0)[BRONZE]

    assert bronze_cap(num_ttft=3, num_itl=5) == 32  # a handful of samples: their maximum
    assert bronze_cap(num_ttft=3, num_itl=200) == 4  # plenty of inter-token gaps: act


def test_a_step_with_golds_prompt_gives_lower_tier_chunks_only_the_gold_step_allowance():
    sim = Sim(tiers=relaxed(gold_step_tokens=40), max_num_seqs=4, budget=200, num_blocks=256)
    sim.add(SILVER, prompt_len=4, max_tokens=30, req_id="s")
    sim.add(BRONZE, prompt_len=400, max_tokens=4, req_id="b")
    assert sim.step().num_scheduled_tokens == {"s": 4, "b": 196}  # no gold: the whole budget
    sim.add(GOLD, prompt_len=20, max_tokens=4, req_id="g")
    so = sim.step()
    # Gold's 20 prompt tokens, silver's decode, and bronze's chunk cut to 40 - 20 - 2 running.
    assert so.num_scheduled_tokens == {"s": 1, "b": 18, "g": 20}
    assert so.total_num_scheduled_tokens <= 40
    so = sim.step()  # gold decodes now: no limit, bronze's chunk fills the budget again
    assert so.num_scheduled_tokens == {"g": 1, "s": 1, "b": 186}


def test_a_gold_prompt_longer_than_the_gold_step_holds_lower_tier_chunks_back():
    sim = Sim(tiers=relaxed(gold_step_tokens=64), max_num_seqs=4, budget=200, num_blocks=256)
    sim.add(BRONZE, prompt_len=500, max_tokens=4, req_id="b")
    sim.step()
    sim.add(GOLD, prompt_len=100, max_tokens=4, req_id="g")
    assert sim.step().num_scheduled_tokens == {"g": 100}  # 64 - 100 - 2 running: nothing left
    assert sim.step().num_scheduled_tokens == {"g": 1, "b": 199}


def test_without_a_gold_step_limit_a_running_lower_tier_chunk_can_delay_gold_a_step():
    sim = Sim(tiers=relaxed(gold_step_tokens=0), max_num_seqs=4, budget=200, num_blocks=256)
    sim.add(BRONZE, prompt_len=500, max_tokens=4, req_id="b")
    sim.step()
    sim.add(GOLD, prompt_len=20, max_tokens=4, req_id="g")
    assert sim.step().num_scheduled_tokens == {"b": 200}  # what the limit exists to prevent
    assert sim.step().num_scheduled_tokens["g"] == 20
