"""A swap's work inside engine steps (canary probes, migration recompute), paced by the measured
step time: in simulated time, the work a swap adds to a step never exceeds its share of the
steady step (or, when even its smallest piece cannot fit, at most one steady step and the share
on average), and a migration ends by its deadline.

The simulated steps cost what a memory-bound device pays: a fixed part, a part per token, and
a whole pass over a second slot's weights for a sub-batch on another version. The scheduler,
the pacer and the fake runner are the real ones; only the clock is simulated.
"""

from __future__ import annotations

import itertools
import random
import statistics

import pytest

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.observer import StepRecord
from sitsd.engine.pacing import PacingSettings, StepPacer
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.outputs import SchedulerOutput, SwapWork
from sitsd.types import SamplingParams, Tier
from tests.engine.fakes import FakeRunner, next_token

BLOCK = 4
V0, V1 = "fake@0", "fake@1"


class SimEngine:
    """The scheduler and the fake runner, stepped on a simulated clock.

    A step lasts `base_s + token_s * tokens + weights_s * (versions - 1)`: each sub-batch on
    a second weights version pays a pass over that slot's weights.
    """

    def __init__(self, share=0.2, base_s=0.1, token_s=0.002, weights_s=0.0, deadline_s=60.0,
                 fixed_tokens=0, deadline_steps=2000, drain_hold_s=0.0, noise_s=0.0):  # fmt: skip
        self.now = 0.0
        self.base_s, self.token_s, self.weights_s = base_s, token_s, weights_s
        self.kv = KVCacheManager(4096, BLOCK)
        cfg = SchedulerConfig(max_num_seqs=32, max_num_batched_tokens=512, policy="fcfs")
        pacing = PacingSettings(share=share, fixed_tokens=fixed_tokens,
                                migration_deadline_steps=deadline_steps,
                                migration_deadline_s=deadline_s,
                                drain_hold_s=drain_hold_s)  # fmt: skip
        self.sched = Scheduler(cfg, self.kv, 8192, clock=lambda: self.now, pacing=pacing)
        self.runner = FakeRunner(BLOCK)
        self.rng = random.Random(random.getrandbits(32))  # the test's seed decides
        self.steps = []  # (period, swap tokens, cost of the swap work, serving versions)
        self.alone = []  # per step: its swap work ran on a slot serving nothing else
        self.works = []  # per step: its SwapWork (what the pacer set, and why)
        self.outs: list[SchedulerOutput] = []  # per step: what was scheduled
        self.finished = set()
        # Seconds something else adds to the step of the swap's Nth piece (from 0).
        self.stalls: dict[int, float] = {}
        self.noise_s = noise_s  # each step takes up to this much longer, at random
        self.noise = random.Random(random.getrandbits(32))
        self.num_pieces = 0  # steps with swap work so far
        self.token_times: dict[str, list[float]] = {}  # request -> when each token came

    def add(self, req_id, prompt_len, max_tokens):
        prompt = [self.rng.randrange(3, 900) for _ in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        version = self.runner.slots.active_version
        self.sched.add_request(Request(req_id, prompt, params, seed=0, tier=Tier.SILVER,
                                       arrival_time=self.now, weights_version=version))  # fmt: skip

    def cost(self, so, req_ids):
        versions = {self.runner.versions[r] for r in req_ids}
        tokens = sum(so.num_scheduled_tokens[r] for r in req_ids)
        return self.token_s * tokens + self.weights_s * max(0, len(versions) - 1)

    def step(self):
        start = self.now
        so = self.sched.schedule()
        out = self.runner.execute(so)
        swap_ids = [r for r in so.num_scheduled_tokens if r not in self.sched.requests]
        serving = [r for r in so.num_scheduled_tokens if r in self.sched.requests]
        period = self.base_s + self.cost(so, list(so.num_scheduled_tokens))
        if swap_ids:  # slowed by something else
            period += self.stalls.pop(self.num_pieces, 0.0)
            self.num_pieces += 1
        # What the swap's work added: the step with it, less the step without it.
        added = period - self.base_s - self.cost(so, serving) if swap_ids else 0.0
        period += self.noise.uniform(0.0, self.noise_s)  # a busy machine's, not the work's
        self.now += period
        updates = self.sched.update_from_output(so, out)
        self.sched.pacer.step_ended(StepRecord(so, updates, start, self.now), self.now)
        versions = {self.runner.versions[r] for r in serving}
        self.steps.append((period, sum(so.num_scheduled_tokens[r] for r in swap_ids), added,
                           len(versions)))  # fmt: skip
        self.alone.append(so.swap_work is not None and so.swap_work.alone)
        self.works.append(so.swap_work)
        self.outs.append(so)
        for u in updates:
            if u.new_token_ids:
                self.token_times.setdefault(u.request.req_id, []).append(self.now)
            if u.finish_reason is not None:
                self.finished.add(u.request.req_id)
        return so

    def gaps(self, since: float, until: float) -> list[float]:
        """Inter-token gaps of every stream that ended in (since, until]."""
        return [b - a for times in self.token_times.values()
                for a, b in itertools.pairwise(times) if since < b <= until]  # fmt: skip

    def steady(self, num_requests, max_tokens=100_000, num_steps=40, prompt_len=(8, 40)):
        """Long requests decoding (prompts of `prompt_len`, randrange's bounds): every step
        costs the same."""
        for i in range(num_requests):
            self.add(f"r{i}", self.rng.randrange(*prompt_len), max_tokens)
        for _ in range(num_steps):
            self.step()
        return statistics.median(p for p, *_ in self.steps[-20:])


class ChurningLoad:
    """32 streams on `sim`, as on a CPU: eight long requests that outlast any swap, and
    requests that finish and are replaced by new ones with prompts of 30-170 tokens."""

    def __init__(self, sim: SimEngine, max_tokens: tuple[int, int]) -> None:
        self.sim = sim
        self.max_tokens = max_tokens  # of the replacing requests: randrange's bounds
        for i in range(8):
            sim.add(f"long{i}", sim.rng.randrange(30, 170), 100_000)
        self.live = {f"long{i}" for i in range(8)}
        self.added: dict[str, tuple[int, float]] = {}  # request -> (its first step, when)

    def step(self) -> SchedulerOutput:
        """Replace the requests that finished, then run a step."""
        sim, live = self.sim, self.live
        live.difference_update(sim.finished)
        while len(live) < 32:
            req_id = f"c{len(sim.steps)}-{len(live)}"
            sim.add(req_id, sim.rng.randrange(30, 170), sim.rng.randrange(*self.max_tokens))
            live.add(req_id)
            self.added[req_id] = (len(sim.steps), sim.now)
        return sim.step()


def probe_prompts(rng, num, length=(8, 40)):
    return [[rng.randrange(3, 900) for _ in range(rng.randrange(*length))] for _ in range(num)]


def p99(values):
    """The nearest-rank 99th percentile."""
    ordered = sorted(values)
    return ordered[int(0.99 * (len(ordered) - 1))]


def run_canary(sim, prompts, max_steps=3000):
    """Probes of `prompts` on both versions; returns (steps they took, {probe index: argmax})."""
    results = {}
    first = len(sim.steps)

    def done(index, probe_id, error):
        assert error is None
        results[index] = sim.runner.take_prompt_logprobs(probe_id).argmax(-1).tolist()

    for i, prompt in enumerate(prompts):
        for version in (V0, V1):
            key = (i, version)
            sim.sched.probes.add(prompt, version, lambda p, e, k=key: done(k, p, e))
    while sim.sched.probes.pending:
        sim.step()
        assert len(sim.steps) - first < max_steps, "the canary never finished"
    for (i, version), argmax in results.items():
        assert argmax == [next_token(t, version, 1000) for t in prompts[i]]
    return sim.steps[first:]


def test_a_canary_that_fits_the_share_adds_at_most_the_share_to_every_step():
    # A second slot's pass costs 5% of a step: even alone, pieces fit in every step.
    sim = SimEngine(share=0.2, weights_s=0.005)
    sim.runner.slots.load(V1)
    steady = sim.steady(num_requests=8)
    steps = run_canary(sim, probe_prompts(sim.rng, 6))
    added = [a for _, n, a, _ in steps if n]
    assert added, "the canary ran in the steps"
    # One token's cost of rounding: the allowance is a whole number of tokens.
    assert max(added) <= 0.2 * steady + sim.token_s + 1e-9
    assert len(added) >= len(steps) / 2, "it went in most steps, not spaced out"


def test_a_canary_that_fits_the_share_on_a_noisy_machine_is_not_spaced_out():
    # A CPU at 128 streams, steps 1-2.6 s: a piece whose step was slow for reasons of its own
    # counted as one that grew past the share, and the canary's next pieces waited 128 steps
    # (a canary of 178 s, 139 steps, where another run's took 16 s, 11). Past the share means
    # past the steady steps' own spread too.
    sim = SimEngine(share=0.2, weights_s=0.005, noise_s=0.1)
    sim.runner.slots.load(V1)
    sim.steady(num_requests=8)
    steps = run_canary(sim, probe_prompts(sim.rng, 6))
    idle = [len(list(run)) for without, run in itertools.groupby(n == 0 for _, n, *_ in steps)
            if without]  # fmt: skip
    assert max(idle, default=0) < 16, f"the canary waited {max(idle)} steps"


def test_a_canary_on_a_slot_whose_pass_exceeds_the_share_is_spaced_and_never_triples_a_step():
    # A pass over the standby slot costs 60% of a steady step: no piece fits the 20% share.
    sim = SimEngine(share=0.2, weights_s=0.06)
    sim.runner.slots.load(V1)
    steady = sim.steady(num_requests=8)
    steps = run_canary(sim, probe_prompts(sim.rng, 4))
    added = [a for _, n, a, _ in steps if n]
    assert max(added) <= 2 * steady + sim.token_s + 1e-9, "a step at most triples"
    # The share holds on average over the canary (the first, probing piece included).
    assert sum(added) <= 0.2 * sum(p for p, *_ in steps) * 1.25
    # The active slot's probes join its sub-batch in every step; the standby slot's, each a
    # pass of its own, are spaced once those are done.
    alone = sim.alone[-len(steps) :]
    standby = alone[alone.index(True) :]
    assert sum(standby) < len(standby) / 2, "pieces on the standby slot are spaced"
    # Each spaced piece says what its smallest piece was priced at: past the share.
    spaced = [w for w in sim.works[-len(steps) :] if w is not None and w.limit == "spaced"]
    assert spaced
    assert all(w.smallest_s > 0.2 * steady for w in spaced), [w.smallest_s for w in spaced]


def test_a_spaced_canary_piece_waits_for_a_step_without_arriving_prompts():
    # A CPU at 32 streams (swap-cpu run N): a canary piece alone, priced at 28 ms, went into a
    # step computing 284 prompt tokens of arriving requests: 2.42x the steady P99. A spaced
    # piece now waits for a step whose prompt tokens are no more than its decodes. And under
    # this churning load the steady steps' spread (arrivals' prompts) made a pass over the
    # other slot's weights look like it fitted the share: one-token pieces alone in nearly
    # every step, each doubling it. The spread is now the decode-only steps'.
    sim = SimEngine(share=0.2, base_s=0.2, token_s=0.00225, weights_s=0.3, deadline_s=1e6)
    load = ChurningLoad(sim, max_tokens=(100, 200))
    for _ in range(150):
        load.step()
    sim.runner.slots.load(V1)
    done = []
    for prompt in probe_prompts(sim.rng, 4, length=(60, 120)):
        sim.sched.probes.add(prompt, V1, lambda probe_id, error: done.append(error))
    heavy_offers, pieces = 0, []
    first = len(sim.steps)
    while sim.sched.probes.pending:
        so = load.step()
        serving = [r for r in so.num_scheduled_tokens if r in sim.sched.requests]
        prompts = sum(so.num_scheduled_tokens[r] for r in serving) - len(serving)
        work = sim.works[-1]
        if work is not None and work.alone and work.num_tokens and work.limit == "spaced":
            pieces.append((prompts, len(serving)))
        heavy_offers += prompts > len(serving)
        # ~10 pieces 128 steps apart: the credit must reach what a piece costs (a cap below
        # the price of the smallest piece held every piece back for thousands of steps)
        assert len(sim.steps) - first < 3000, "the canary starved"
    assert done == [None] * 4
    works = [w for w in sim.works[first:] if w is not None and w.alone and w.num_tokens]
    assert {w.limit for w in works} <= {"first", "spaced"}, [w.limit for w in works]
    assert len(works) <= 1 + (len(sim.steps) - first) // 100, "under 1% of the steps"
    assert len(pieces) >= 2, "the canary's pieces were spaced"
    assert heavy_offers, "steps computed arriving prompts meanwhile"
    assert all(p <= n for p, n in pieces), pieces


class ShortMeasuredSim(SimEngine):
    """Asynchronous scheduling's periods: a step runs from the end of the last one, so when
    that one ended late (the host) the device's work ran into it, and this step measures
    short. Here the `short`-th piece on the standby slot measures its pass as nearly free."""

    def __init__(self, *args, short: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.short, self.num_alone = short, 0

    def cost(self, so, req_ids):
        cost = super().cost(so, req_ids)
        whole_step = set(req_ids) == set(so.num_scheduled_tokens)
        if whole_step and so.swap_work is not None and so.swap_work.alone:
            if self.num_alone == self.short:
                cost -= 0.95 * self.weights_s
            self.num_alone += 1
        return cost


@pytest.mark.parametrize("short", [0, 3])
def test_a_piece_on_the_standby_slot_measured_short_does_not_unspace_the_pieces_after_it(short):
    # On an H100 a drain's canary priced a one-token piece alone at 0.68 ms where each was a
    # 5 ms pass over the other slot's weights, and ran such pieces in consecutive steps: the
    # least a piece had cost stood for the smallest piece's price while the fit could not
    # tell the pass from the tokens, and one piece measured short set it.
    sim = ShortMeasuredSim(share=0.2, token_s=0.0002, weights_s=0.07, short=short)
    sim.runner.slots.load(V1)
    steady = sim.steady(num_requests=32)
    steps = run_canary(sim, probe_prompts(sim.rng, 4, length=(60, 120)), max_steps=20000)
    works = [w for w in sim.works[-len(steps) :] if w is not None and w.alone and w.num_tokens]
    assert sim.num_alone > short, "the short piece ran"
    assert [w.limit for w in works].count("share") <= 1, [w.limit for w in works]
    assert p99([p for p, *_ in steps]) <= (1 + 0.2) * steady + 0.0002 + 1e-9


def test_one_step_slowed_by_something_else_does_not_shrink_the_pieces_after_it():
    # As on a GPU: a piece on the standby slot pays a pass over its weights as long as a steady
    # step, and its tokens cost little. The fourth piece's step is slowed by something else
    # (the host) by four steady steps: a least-squares fit would price every token of the
    # pieces after it as that, and space out one-token pieces for the rest of the canary.
    sim = SimEngine(share=0.2, token_s=0.0005, weights_s=0.11)
    sim.runner.slots.load(V1)
    steady = sim.steady(num_requests=8)
    spaced_every = sim.sched.pacer.settings.spaced_every
    sim.stalls[sim.num_pieces + 3] = 4 * steady
    first = len(sim.steps)
    # Pieces grow about twofold a step (11, 46, 94 after the slowed one): prompts of 480
    # tokens or more leave enough to show it (with 60-100 tokens, one run in ten ended first).
    prompts = probe_prompts(sim.rng, 4, length=(120, 160))
    done = {}
    for i, prompt in enumerate(prompts):
        sim.sched.probes.add(prompt, V1, lambda p, e, k=i: done.setdefault(k, e))
    while len(done) < len(prompts):
        sim.step()
        assert len(sim.steps) - first < 20 * spaced_every, "the canary crawled"
    assert not sim.stalls, "the slowed piece ran"
    added = [a for _, n, a, _ in sim.steps[first:] if n]
    pieces = [n for _, n, _, _ in sim.steps[first:] if n]
    # After the slowed step the pieces grow to what two steady steps of extra time buy, less
    # the pass: (2 x 0.116 - 0.11) / 0.0005 = 240 tokens; no other step more than triples.
    assert max(pieces[4:]) >= 100
    assert sorted(added)[-2] <= 2 * steady + sim.token_s + 1e-9


def test_every_step_with_swap_work_serves_every_running_request():
    sim = SimEngine(share=0.2, weights_s=0.06)
    sim.runner.slots.load(V1)
    sim.steady(num_requests=6)
    first = len(sim.runner.step_log)
    run_canary(sim, probe_prompts(sim.rng, 4))
    for step in sim.runner.step_log[first:]:
        assert {f"r{i}" for i in range(6)} <= set(step), "a request missed a step"


def test_migration_recompute_that_joins_new_requests_adds_at_most_the_share_to_a_step():
    sim = SimEngine(share=0.2, weights_s=0.06, deadline_s=1e6)
    steady = sim.steady(num_requests=8, max_tokens=400)
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    switch = sim.sched.swaps.switch(V1, "migrate")
    assert switch.num_migrating == 8
    sim.add("new", 16, 10_000)  # a request on the new version: shadows join its sub-batch
    first = len(sim.steps)
    while sim.sched.swaps.migration is not None:
        sim.step()
        assert len(sim.steps) - first < 5000
    joined = [(a, k) for _, n, a, k in sim.steps[first:] if n and k == 2]
    assert joined, "shadows ran next to both versions' requests"
    two_slot_steady = sim.base_s + sim.weights_s + sim.token_s * 9  # 9 decodes, two slots
    assert max(a for a, _ in joined) <= 0.2 * two_slot_steady + sim.token_s + 1e-9
    assert max(a for a, _ in joined) < 0.2 * steady + sim.weights_s  # never a third slot's pass
    assert not {f"r{i}" for i in range(8)} & sim.finished, "every request migrated"


def test_a_migration_too_slow_for_its_share_still_ends_by_its_deadline():
    # 16 long requests add 16 tokens a step; a 1% share allows ~1 shadow token a step.
    sim = SimEngine(share=0.01, deadline_s=30.0)
    sim.steady(num_requests=16, max_tokens=100_000)
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    started = sim.now
    sim.sched.swaps.switch(V1, "migrate")
    while sim.sched.swaps.migration is not None:
        sim.step()
        assert sim.now - started < 60.0, "the migration did not end by its deadline"
    assert sim.now - started <= 30.0 * 1.1
    assert sim.sched.swaps.last_migration.num_restarted == 0


@pytest.mark.parametrize("step_s", [0.005, 1.0], ids=["gpu-like", "cpu-like"])
def test_by_default_a_migration_ends_within_its_deadline_in_steady_steps_on_any_device(step_s):
    # The same engine at a GPU's pace and at a CPU's 200x slower one: a 1% share is too slow
    # for 16 long requests, so the deadline decides when the migration ends; counted in steady
    # steps, it is the same number of steps on both (a deadline in seconds would be 200x
    # more steps on the GPU, or push the CPU's steps past the share 200x sooner).
    sim = SimEngine(share=0.01, base_s=step_s, token_s=step_s / 50, deadline_s=0.0,
                    deadline_steps=300)  # fmt: skip
    steady = sim.steady(num_requests=16, max_tokens=100_000)
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    started, first = sim.now, len(sim.steps)
    sim.sched.swaps.switch(V1, "migrate")
    while sim.sched.swaps.migration is not None:
        sim.step()
        assert len(sim.steps) - first < 3000, "the migration never ended"
    migration = sim.sched.swaps.last_migration
    assert migration.deadline_s == pytest.approx(300 * steady, rel=0.05)
    assert sim.now - started <= migration.deadline_s * 1.1
    assert 150 <= len(sim.steps) - first <= 330, "the deadline, not the share, ended it"
    assert migration.num_restarted == 0


def test_a_migration_behind_its_deadline_never_more_than_doubles_a_step():
    # Steps of a second against a 2 s deadline: catching up in time would take every
    # shadow's whole context in one step; the deadline's push stops at one steady step.
    sim = SimEngine(share=0.2, base_s=1.0, token_s=0.02, deadline_s=2.0)
    steady = sim.steady(num_requests=8, max_tokens=100_000, num_steps=30)
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    first = len(sim.steps)
    sim.sched.swaps.switch(V1, "migrate")
    while sim.sched.swaps.migration is not None:
        sim.step()
        assert len(sim.steps) - first < 2000, "the migration never ended"
    added = [a for _, n, a, _ in sim.steps[first:] if n]
    assert max(added) > 0.2 * steady + sim.token_s, "the deadline pushed past the share"
    assert max(added) <= steady + sim.token_s + 1e-9, "a step at most doubles"
    assert sim.sched.swaps.last_migration.num_restarted == 0
    assert "deadline" in {w.limit for w in sim.works[first:] if w is not None and w.num_tokens}


def test_a_migration_under_a_churning_load_adds_at_most_the_share_to_a_step():
    # As on a CPU at 32 streams: requests finish and new ones bring prompts of 30-170 tokens,
    # so a step takes the steady median give or take as much as a piece of shadows costs.
    # Fitted on what each piece's step took past the median, the pieces' price fell near zero
    # and they doubled step after step (to 7-11x the share); priced at least as the prompts
    # of steady steps cost, no piece takes more than the share.
    sim = SimEngine(share=0.2, base_s=0.2, token_s=0.00225, deadline_s=1e6)
    load = ChurningLoad(sim, max_tokens=(20, 120))  # its long requests: the migration moves

    def step():
        steady = {k: sim.sched.pacer.steady_s(k) for k in (1, 2)}
        load.step()
        return steady

    for _ in range(150):
        step()
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    first = len(sim.steps)
    sim.sched.swaps.switch(V1, "migrate")
    pieces = []
    while sim.sched.swaps.migration is not None:
        steady = step()
        _, tokens, added, versions = sim.steps[-1]
        if tokens:
            pieces.append((added, steady[versions]))
        assert len(sim.steps) - first < 5000, "the migration never ended"
    assert sum(1 for _, tokens, *_ in sim.steps[first:] if tokens) > 10
    # Each step's record says what set its piece, and at what price of a token.
    # (None: a step that preempted for blocks, as the long requests grow, schedules no swap
    # work.)
    works = [w for w in sim.works[first:] if w is not None and w.num_tokens]
    assert {w.limit for w in works} <= {"first", "share", "spaced"}
    # Joined to a serving sub-batch, that is: shadows alone on the new slot (no request on it
    # in their step) are priced by their own fit, a fixed part for the pass over its weights
    # and little a token (seed 1061531986: three such pieces first, at 1e-7 s a token).
    priced = [w.per_token_s for w in works if w.limit != "first" and not w.alone]
    assert priced
    assert min(priced) >= sim.token_s * (1 - 1e-9), "a token priced below a prompt token"
    assert not {f"long{i}" for i in range(8)} & sim.finished, "every long request migrated"
    for added, steady in pieces:
        assert added <= 0.2 * steady + 1e-9


def test_arrivals_prompts_in_steps_serving_two_versions_are_spread_over_the_steps():
    # CPU run O, 32 streams: every step of a migration reads both weight sets (on a CPU half
    # a steady step more), and one that also computed an arrival's prompt of 150-300 tokens
    # took 1.6-1.9x the steady P99: the migrate phase's P99 (1.63x), and the drain's and the
    # restart's. Arrivals' prompts are computed in chunks while two versions serve (about
    # twice what steady steps computed a step, on average), so no step stands out.
    sim = SimEngine(share=0.2, base_s=0.136, token_s=0.0012, weights_s=0.1, deadline_s=1e6)
    load = ChurningLoad(sim, max_tokens=(20, 128))  # its long requests: the migration moves
    for _ in range(150):
        load.step()
    measured = sum(p for p, *_ in sim.steps[:50])
    steady_prompts = [so_prompts for so_prompts in _prompt_tokens(sim)[50:]]
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    switched, first = sim.now, len(sim.steps)
    sim.sched.swaps.switch(V1, "migrate")
    rooms = []  # per step of the migration: the arrivals' room it began with (None: one version)
    while sim.sched.swaps.migration is not None:
        load.step()
        rooms.append(sim.sched.arrival_room)
        assert len(sim.steps) - first < 3000, "the migration never ended"
    steady, during = sim.gaps(measured, switched), sim.gaps(switched, sim.now)
    assert p99(during) <= 1.5 * p99(steady)
    assert max(during) <= 4 * p99(steady)
    prompts = _prompt_tokens(sim)
    # In the steps serving two versions (not the flip's), the arrivals' tokens within the
    # room; the shadows' are the swap's work, paced apart.
    for i, room in zip(range(first, len(sim.steps)), rooms, strict=True):
        _, swap, _, versions = sim.steps[i]
        if versions == 2:
            assert prompts[i] - swap <= room, f"step {i - first} of the migration"
    assert max(r for r in rooms if r is not None) < max(steady_prompts), "prompts held back"


def _prompt_tokens(sim: SimEngine) -> list[int]:
    """Per step so far: its tokens past one a request (prompts, a swap's recompute)."""
    return [s.total_num_scheduled_tokens - len(s.num_scheduled_tokens) for s in sim.outs]


@pytest.mark.parametrize("fixed", [3, 11])
def test_a_fixed_allowance_is_never_exceeded(fixed):
    sim = SimEngine(fixed_tokens=fixed, deadline_s=1e6)
    sim.runner.slots.load(V1)
    sim.steady(num_requests=4, num_steps=5)
    steps = run_canary(sim, probe_prompts(sim.rng, 3))
    assert max(n for _, n, _, _ in steps) <= fixed


def test_steps_a_canary_makes_longer_than_the_share_are_too_rare_for_the_p99():
    # On a GPU a piece on the standby slot is a whole pass over its weights (here 60% of a
    # steady step): every such step is past the share, so at most one in `spaced_every` may
    # carry one, and the P99 of the canary's steps stays within the share of steady.
    sim = SimEngine(share=0.2, weights_s=0.06)
    sim.runner.slots.load(V1)
    steady = sim.steady(num_requests=8)
    spaced_every = sim.sched.pacer.settings.spaced_every
    steps = run_canary(sim, probe_prompts(sim.rng, 4), max_steps=20 * spaced_every)
    past = [i for i, (_, n, a, _) in enumerate(steps) if n and a > 0.2 * steady + 1e-9]
    assert past, "pieces on the standby slot cost more than the share"
    gaps = [b - a for a, b in itertools.pairwise(past)]
    assert min(gaps, default=spaced_every) >= spaced_every
    periods = [p for p, *_ in steps]
    assert p99(periods) <= (1 + 0.2) * steady + sim.token_s + 1e-9
    assert max(periods) <= 3 * steady + sim.token_s + 1e-9, "a step at most triples"


def test_a_canary_keeps_its_steps_past_the_share_to_one_in_spaced_every_from_its_start():
    # A phase's P99 is taken over the phase: a second swap's canary, priced by the first's,
    # ran its one or two pieces alone at once on an H100 (their steps 2x the steady one) in
    # a phase of 8-16 steps, whose P99 they were. Each canary here, the first (which prices
    # the pieces) and the ones after it, keeps such steps to one in `spaced_every` of its own.
    sim = SimEngine(share=0.2, weights_s=0.06)
    sim.runner.slots.load(V1)
    steady = sim.steady(num_requests=8)
    spaced_every = sim.sched.pacer.settings.spaced_every
    for canary in range(3):
        steps = run_canary(sim, probe_prompts(sim.rng, 4), max_steps=20 * spaced_every)
        past = [i for i, (_, n, a, _) in enumerate(steps) if n and a > 0.2 * steady + 1e-9]
        assert past, "pieces on the standby slot cost more than the share"
        assert len(steps) >= len(past) * spaced_every, (canary, past, len(steps))
        periods = [p for p, *_ in steps]
        assert p99(periods) <= (1 + 0.2) * steady + sim.token_s + 1e-9, canary
        for _ in range(sim.rng.randrange(5, 50)):  # the swap commits; serving goes on
            sim.step()


def test_a_restart_in_place_recomputes_its_requests_in_their_order_and_no_step_more_than_doubles():
    # A swap in place (one weight slot) takes every request back at once: the old weights are
    # gone. 8 requests of 60-100 tokens: all at once, their recompute would be a step of ~640
    # tokens (the 512 budget: over five steady steps). The canary before the swap measured
    # what tokens joining the batch cost.
    sim = SimEngine(share=0.2)
    for i in range(8):
        sim.add(f"r{i}", sim.rng.randrange(40, 80), 100_000)
    for _ in range(20):
        sim.step()
    steady = statistics.median(p for p, *_ in sim.steps[-10:])
    sim.runner.slots.load(V1)
    run_canary(sim, probe_prompts(sim.rng, 2))
    computed = {r: sim.sched.requests[r].num_computed_tokens for r in sim.sched.requests}
    sim.runner.slots.activate(V1)
    switch = sim.sched.swaps.switch(V1, "restart", keeps_old=False)
    assert switch.num_restarted == 8
    first = len(sim.steps)
    resumed: dict[str, int] = {}  # req_id -> the step in which it sampled again
    while len(resumed) < 8:
        so = sim.step()
        for req_id in so.num_scheduled_tokens:
            request = sim.sched.requests[req_id]
            if request.num_computed_tokens > computed[req_id] and req_id not in resumed:
                resumed[req_id] = len(sim.steps)
        assert len(sim.steps) - first < 500, "the restarted requests never caught up"
    periods = [p for p, *_ in sim.steps[first:]]
    # A step at most doubles (a few tokens' slack: the allowance comes from the fitted cost).
    assert max(periods) <= 2 * steady + 4 * sim.token_s + 1e-9
    assert len(set(resumed.values())) > 2, "the recompute was spread over several steps"
    order = [resumed[f"r{i}"] for i in range(8)]
    assert order == sorted(order), "restarted requests resume in their queue order"
    assert all(sim.runner.versions[f"r{i}"] == V1 for i in range(8)), "none lost, all on V1"


@pytest.mark.parametrize("weights_s", [0.0, 0.1])
def test_a_restart_under_a_churning_load_keeps_every_stream_within_the_steady_gaps(weights_s):
    # CPU run D, 32 streams: a restart took every request back at once, and the last stream
    # waited for all of their contexts' recompute (inter-token P99 15.4x steady; 10-15x
    # here). Taken back in batch order as each whole context fits a steady step's prompts,
    # a stream waits about one step, as it does for a new request's prompt. CPU run O (32
    # streams, each step of the restart reading both weight sets, half a steady step more):
    # two taken back a step, their waits were 2% of the phase's gaps and its P99 (1.84x);
    # now one at most in 128 gaps, and the arrivals' prompts spread over the steps.
    sim = SimEngine(share=0.2, base_s=0.2, token_s=0.00225, weights_s=weights_s,
                    deadline_s=1e6)  # fmt: skip
    load = ChurningLoad(sim, max_tokens=(5, 40))  # its long requests outlast the restart
    for _ in range(150):
        load.step()
    measured = sum(p for p, *_ in sim.steps[:50])  # the steady window: after the start-up
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    switched = sim.now
    switch = sim.sched.swaps.switch(V1, "restart")
    assert switch.num_restarted >= 8
    first = len(sim.steps)
    taken = gaps = 0
    while sim.sched.swaps.restarting or sim.sched.swaps.recomputing:
        so = load.step()
        taken += len(so.preempted_req_ids)
        gaps += sum(1 for n in so.num_scheduled_tokens.values() if n == 1)  # the decodes
        assert taken <= 1 + gaps // 128, "taken back more often than once in 128 gaps"
        assert len(sim.steps) - first < 1000, "the restart never took them all back"
    steady, during = sim.gaps(measured, switched), sim.gaps(switched, sim.now)
    # The CPU targets of a swap's phases: P99 within 1.5x steady's, the longest within 4x.
    assert p99(during) <= 1.5 * p99(steady)
    assert max(during) <= 4 * p99(steady)
    for i in range(8):  # the long requests: old tokens, then new ones, none lost
        assert sim.runner.versions[f"long{i}"] == V1
        assert sim.sched.requests[f"long{i}"].weights_version == V1


def test_a_restarted_context_larger_than_the_room_is_recomputed_in_two_steps():
    # CPU run K, 128 streams: contexts of ~250 tokens recomputed 24 tokens a step (the share)
    # left their streams without a token for ~10 steps (16 s, 6.5x the steady P99). Here 8
    # contexts of 300-400 tokens against a room of a few dozen: each one's stream waits at
    # most two steps, and a step grows by at most half a context.
    sim = SimEngine(share=0.2)
    sim.steady(num_requests=8, prompt_len=(300, 400))
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    switched, first = sim.now, len(sim.steps)
    assert sim.sched.swaps.switch(V1, "restart").num_restarted == 8
    while sim.sched.swaps.restarting:
        sim.step()
        assert len(sim.steps) - first < 500, "the restart never took them all back"
    recomputed = [w.num_tokens for w in sim.works[first:] if w is not None]
    assert sum(1 for n in recomputed if n) >= 8, "a few a step, not all at once"
    # Half a context at most (they grew while they waited their turn).
    assert max(recomputed) <= (max(r.num_tokens for r in sim.sched.requests.values()) + 1) // 2
    longest = max(p for p, *_ in sim.steps[first:])
    assert max(sim.gaps(switched, sim.now)) <= 2 * longest + 1e-9
    assert all(sim.runner.versions[f"r{i}"] == V1 for i in range(8))


def test_requests_a_drain_held_back_start_within_the_share_priced_by_steady_prompts():
    # No canary ran, so nothing measured what tokens joining the batch cost: the prompts of
    # requests arriving in steady steps do. Held for the whole hold, 12 prompts of 40 tokens
    # at once would be a step of 480 tokens, over eight steady steps.
    sim = SimEngine(share=0.2, drain_hold_s=2.0)
    for i in range(8):
        sim.add(f"old{i}", sim.rng.randrange(8, 40), 100_000)
    for i in range(60):
        if i % 3 == 0:
            sim.add(f"short{i}", sim.rng.randrange(10, 40), 4)
        sim.step()
    steady = sim.sched.pacer.steady_s(1)
    assert steady is not None
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    switch = sim.sched.swaps.switch(V1, "drain")
    assert switch.num_draining >= 8
    held = [f"held{i}" for i in range(12)]
    for req_id in held:
        sim.add(req_id, 40, 4)
    first = len(sim.steps)
    admitted: dict[str, int] = {}  # held request -> the step it was first scheduled in
    while not all(r in sim.finished for r in held):
        so = sim.step()
        for req_id in so.num_scheduled_tokens:
            if req_id in held:
                assert sim.runner.versions[req_id] == V1, "a held request ran on the old version"
                admitted.setdefault(req_id, len(sim.steps))
        assert len(sim.steps) - first < 500, "the held requests never finished"
    periods = [p for p, *_ in sim.steps[first:]]
    # Within the share of a steady step (a few tokens' slack: the pace comes from a fit).
    assert max(periods) <= (1 + 0.2) * steady + 4 * sim.token_s + 1e-9
    assert len(set(admitted.values())) > 2, "the held prompts were spread over several steps"


def test_arrivals_go_ahead_of_the_prompts_a_drain_held_while_it_paces_them():
    # CPU run E, 128 streams: requests arriving while a drain paced the prompts it had held
    # waited behind them, then all came in one step of 1024 prompt tokens (3 s, 2.1x the
    # steady P99). They are a steady load's arrivals: admitted as they come, as in steady
    # steps, while the held prompts start within the share.
    sim = SimEngine(share=0.2, base_s=0.2, token_s=0.00225, deadline_s=1e6, drain_hold_s=3.0)
    load = ChurningLoad(sim, max_tokens=(5, 40))  # its long requests outlast the 3 s hold
    added, step = load.added, load.step
    for _ in range(150):
        step()
    sim.runner.slots.load(V1)
    sim.runner.slots.activate(V1)
    switched = sim.now
    sim.sched.swaps.switch(V1, "drain")
    first_step: dict[str, int] = {}  # request -> the step it was first scheduled in
    versions: dict[str, str] = {}  # request -> the version it started on
    full = [False] * len(sim.steps)  # per step: its token budget or its batch was full
    paced = []  # per step of the release: the held prompts' tokens in it
    while len(sim.steps) < 300:
        so = step()
        for new in so.new_reqs:
            first_step.setdefault(new.req_id, len(sim.steps) - 1)
            versions[new.req_id] = new.weights_version
        full.append(so.total_num_scheduled_tokens >= 512 or len(sim.sched.running) >= 32)
        if so.swap_work is not None and so.swap_work.limit == "recompute":
            paced.append(so.swap_work.num_tokens)
    held = [r for r, (_, t) in added.items() if switched <= t < switched + 3.0]
    after = [r for r, (_, t) in added.items() if t >= switched + 3.0 + 1.0]
    assert len(held) > 4
    assert len(after) > 10
    assert {versions[r] for r in held + after} == {V1}
    assert len(paced) > 4, "the held prompts were spread over several steps"
    steady = sim.sched.pacer.steady_s(1)
    assert max(paced) <= 0.2 * steady / sim.token_s + 4, "the held prompts start in the share"
    # An arrival waits only for a step with room for it, as in a steady load.
    late = {r: first_step[r] - added[r][0] for r in after
            if r in first_step and not all(full[added[r][0]:first_step[r]])}  # fmt: skip
    assert not late, f"arrivals waited behind the held prompts (steps late): {late}"


class FedPacer:
    """A pacer fed finished steps directly: steady ones, then ones with swap work."""

    def __init__(self) -> None:
        self.pacer = StepPacer(PacingSettings(share=0.2))
        self.clock = 0.0
        for period in itertools.islice(itertools.cycle((0.38, 0.40, 0.42)), 30):
            self.step(period, 0)
        assert self.pacer.steady_s(1) == pytest.approx(0.40)

    def step(self, period: float, work_tokens: int, alone: bool = False, versions: int = 1) -> None:
        sched_out = SchedulerOutput(num_scheduled_tokens={"r": 1 + work_tokens},
                                    total_num_scheduled_tokens=1 + work_tokens,
                                    swap_work=SwapWork(work_tokens, alone, versions))  # fmt: skip
        start, self.clock = self.clock, self.clock + period
        self.pacer.step_ended(StepRecord(sched_out, [], start, self.clock), self.clock)

    def pieces(self, steady: float, extra, num_steps: int, versions: int = 1) -> list[int]:
        """`num_steps` steps of `versions` serving versions, `steady` seconds long, each with
        the joined piece the pacer allows, which adds `extra(tokens)` seconds (a step the
        pacer keeps free, none); the pieces' sizes."""
        pieces = []
        for _ in range(num_steps):
            allowance = self.pacer.pace(versions, alone=False)
            if allowance.tokens == 0:
                self.step(steady, 0, versions=versions)
                continue
            pieces.append(allowance.tokens)
            self.step(steady + extra(allowance.tokens), allowance.tokens, versions=versions)
        return pieces

    def prompt_step(self, period: float, prompt_tokens: int) -> None:
        """A steady step of 32 decodes and one new request's prompt."""
        scheduled = {f"d{i}": 1 for i in range(32)} | {"new": prompt_tokens}
        sched_out = SchedulerOutput(num_scheduled_tokens=scheduled,
                                    total_num_scheduled_tokens=sum(scheduled.values()),
                                    swap_work=SwapWork(0, False, 1))  # fmt: skip
        start, self.clock = self.clock, self.clock + period
        self.pacer.step_ended(StepRecord(sched_out, [], start, self.clock), self.clock)

    def steady_with_prompts(self, every: int, period: float, prompt_tokens: int) -> None:
        """64 steady steps of 0.40 s, one in `every` a `prompt_step` instead."""
        for i in range(64):
            if i % every == 0:
                self.prompt_step(period, prompt_tokens)
            else:
                self.step(0.40, 0)


def test_steps_serving_two_versions_take_prompts_that_keep_them_within_one_steady_step_in_ten():
    # Steady steps of 0.40 s, one in four with a prompt of 99 tokens (past one) at ~2 ms a
    # token (0.60 s); steps of two versions without prompts 0.50 s: 0.10 s of room under the
    # steady P90 (0.60 s), ~50 tokens, more than the share buys.
    fed = FedPacer()
    fed.steady_with_prompts(4, 0.60, 100)
    assert fed.pacer.release_tokens(4096) < 50
    assert fed.pacer.mixed_prompt_tokens(4096) == fed.pacer.release_tokens(4096), \
        "unmeasured two-version steps: the share's pace"  # fmt: skip
    for _ in range(4):
        fed.step(0.50, 0, versions=2)
    assert fed.pacer.mixed_prompt_tokens(4096) == pytest.approx(50, abs=1)
    # Where the steady steps leave less room than the arrivals need, they still get twice
    # their average (16 prompts of 99 tokens in the 94 steady steps): they must not pile up.
    for _ in range(4):
        fed.step(0.59, 0, versions=2)
    assert fed.pacer.mixed_prompt_tokens(4096) < 2 * 16 * 99 // 94
    assert fed.pacer.arrival_tokens(4096, 0) == 2 * 16 * 99 // 94


def test_arrivals_waiting_clear_in_four_steps_within_a_quarter_past_the_longest_steady_step():
    # Steady steps of 0.40 s, one in eight with a prompt of 199 tokens (past one) at ~2 ms a
    # token (0.80 s, the longest); steps of two versions without prompts 0.45 s: past the
    # steady P90 already (the share's pace), 0.55 s under 1.25 x the longest, ~275 tokens.
    fed = FedPacer()
    fed.steady_with_prompts(8, 0.80, 200)
    for _ in range(4):
        fed.step(0.45, 0, versions=2)
    pacer = fed.pacer
    mean = 2 * 8 * 199 // (30 + 64)  # eight prompts in the 94 steady steps fed
    assert pacer.mixed_prompt_tokens(4096) == pacer.release_tokens(4096) < mean
    assert pacer.arrival_tokens(4096, 0) == mean, "twice what arrives, waiting or not"
    assert pacer.arrival_tokens(4096, 400) == 100, "those waiting clear in four steps"
    # A drain on a CPU at 128 streams: the arrivals waiting came four steps' worth a step,
    # 479-608 tokens, 1.8x the steady P99. No more than a quarter past the longest steady
    # step holds.
    assert pacer.arrival_tokens(4096, 4000) == pytest.approx(275, abs=3)


def test_a_drain_releases_few_prompt_tokens_a_step_until_a_token_is_priced():
    # The H200 push benchmark: with no price measured, a drain's held prompts took the whole
    # budget, three steps of 1024 tokens at 22-23 ms where steady ones take 5.
    fed = FedPacer()
    assert 0 < fed.pacer.release_tokens(1024) <= 16


def test_a_price_fitted_where_prompts_are_nearly_free_is_not_taken_past_the_sizes_measured(rng):
    # An H200 step is bound by its pass over 16 GB of weights up to some hundred tokens and
    # by compute past them: steady steps' prompts of 20-150 tokens cost nearly nothing, and a
    # price fitted on them let a drain's held prompts take 194-275 tokens a step (14 ms steps
    # of 5). No more than a steady step computed within the share.
    fed = FedPacer()
    for _ in range(4):
        for n in (20, 45, 70, 100, 150):
            fed.prompt_step(0.40 + rng.uniform(-0.004, 0.004) + 0.00001 * n, n)
    fed.prompt_step(0.40 + 0.0035 * 250, 400)  # past the knee: 2.2x a steady step
    released = fed.pacer.release_tokens(2048)
    assert 100 <= released <= 150


def test_where_no_step_measured_kept_within_the_share_a_drain_releases_a_few_tokens_a_step():
    # The H200 swap benchmark: steady steps' prompts (100-300 tokens) each took a step past
    # the share, and the drain's held prompts came 461 tokens a step (14-21 ms, steady 5).
    fed = FedPacer()
    for n in (100, 200, 300):  # one step in ten
        fed.prompt_step(0.40 + 0.0000005 * n + 0.15, n)
    assert 0 < fed.pacer.release_tokens(2048) <= 16


def test_pieces_measured_below_the_steady_median_do_not_make_tokens_look_cheaper():
    # A CPU run's joined pieces: 1.68 ms a token with a fitted fixed part of -50 ms (the steady
    # median held prompts that the small pieces' steps did not carry). Priced through the
    # origin, the small pieces' negative extras made a token look 1.4x cheaper, and a drain's
    # held-back prompts took 0.28 of a steady step instead of 0.2.
    fed = FedPacer()
    per_token, below = 0.0017, -0.05
    for n in (2, 10, 3, 6, 22, 46, 94, 138, 278, 558, 224, 103, 26, 66):
        fed.step(0.40 + per_token * n + below, n)
    assert fed.pacer.release_tokens(2048) == pytest.approx(0.2 * 0.40 / per_token, abs=1)


def test_pieces_alone_whose_fixed_part_fits_below_zero_keep_the_price_that_lets_them_grow():
    # Pieces of 2 and 3 tokens alone on a slot, 10 and 90 ms: a slope of 80 ms a token (noise
    # between two sizes a token apart) and a fixed part of -150 ms. Alone, a piece pays a pass
    # over the slot's weights, a real fixed part: the slope would allow one token a step (and
    # a CPU canary took 64-158 s that way); the price through the origin allows four.
    fed = FedPacer()
    for n in (2, 3, 2, 3, 2, 3):
        fed.step(0.40 + (0.01 if n == 2 else 0.09), n, alone=True)
    assert fed.pacer.pace(1, alone=True).tokens == 4


def test_pieces_priced_where_tokens_are_nearly_free_stop_growing_at_the_knee():
    # An H100 at 32 streams: a step is bound by its pass over the weights up to some hundred
    # tokens and by compute past them. A migration's pieces doubled at ~0.001 ms a token to
    # 262 tokens (a 19 ms step where two-version steps took 12), then to 485 (27 ms): twice the
    # largest measured. Past the knee they fall back between the sizes, and stay under it.
    fed = FedPacer()  # steady 0.40 s, share 0.08 s, spread 0.02 s

    def extra(n: int) -> float:  # flat to 256 tokens, then 5 ms a token
        return 0.00005 * n + 0.005 * max(0, n - 256)

    pieces = fed.pieces(0.40, extra, 200)
    past = [n for n in pieces if extra(n) > 0.08 + 0.02]
    assert len(past) <= 6, f"pieces went past the share {len(past)} times: {past}"
    assert all(extra(n) <= 0.10 for n in pieces[-100:]), pieces[-100:]
    # The linear price, fitted across the knee too, then says less than what fits (~120-270
    # tokens where 300 would): safe, and no collapse to a few tokens a step.
    assert min(pieces[-100:]) >= 100, pieces[-100:]


def test_a_knee_found_at_short_steps_does_not_hold_the_pieces_once_steps_grow_longer():
    # The piece past the share that stops the pieces' growth holds while the steady time is
    # near what it was: steady steps five times longer (more streams) leave room for larger
    # pieces, found by growing again.
    fed = FedPacer()

    def extra(n: int) -> float:  # flat to 256 tokens, then 1 ms a token
        return 0.00005 * n + 0.001 * max(0, n - 256)

    short = fed.pieces(0.40, extra, 200)
    assert max(short[-50:]) < 360  # share 0.08 s: the knee near 330 tokens
    for _ in range(20):  # small pieces fill the fit's window: no piece near the knee in it
        fed.step(0.40 + extra(50), 50)
    for _ in range(40):  # the steady steps grow to 2 s (share 0.4 s)
        fed.step(2.0, 0)
    assert fed.pacer.steady_s(1) == pytest.approx(2.0)
    long = fed.pieces(2.0, extra, 200)
    assert max(long) >= 450, long
    assert all(extra(n) <= 0.4 for n in long[-50:]), long[-50:]


def test_a_knee_found_in_one_kind_of_step_does_not_stand_for_another_kinds():
    # A canary's pieces joined to one-version steps find a knee at ~64 tokens; a migration's
    # pieces then join two-version steps (each reads both weight sets: 1 s here), whose knee
    # is at 256 tokens. The first kind's knee neither holds the second's pieces nor keeps the
    # second's own knee from being kept: its pieces go past their share a few times only.
    fed = FedPacer()
    for period in itertools.islice(itertools.cycle((0.98, 1.0, 1.02)), 30):
        fed.step(period, 0, versions=2)

    def knee(at: int):
        return lambda n: 0.00005 * n + 0.005 * max(0, n - at)

    one = fed.pieces(0.40, knee(64), 200)
    assert max(one[-50:]) < 100
    two = fed.pieces(1.0, knee(256), 200, versions=2)
    past = [n for n in two if knee(256)(n) > 0.2 + 0.02]
    assert max(two) > 200, two[-20:]
    assert len(past) <= 6, past
