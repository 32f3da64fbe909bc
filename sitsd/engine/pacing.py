"""How much of a swap's work the next engine step may take: the allowance, from measured steps.

A swap adds work to the steps that serve: canary prompts (`sitsd.engine.probes`) and the
recompute of migrating requests (`sitsd.engine.migration`). The rule: that work may add at most
`share` of the steady step time to any step, and costs the streams no more than that share of
the engine's time on average.

    steady     the median period of recent busy steps without swap work, per number of weights
               versions serving in the step (a step with two serving sub-batches costs more);
               the period is the time between two steps' ends, which with asynchronous
               scheduling is the inter-token latency. Until a kind of step has been measured,
               steps of that kind run without swap work.
    cost       fitted on recent steps with swap work, separately for work that joins a serving
               sub-batch and work that runs alone on a weight slot serving nothing else:
               extra time ~ fixed + per_token x tokens, a median fit (one step slowed by
               something else must not shrink every piece after it). Alone, the fixed part is
               a whole second pass over the other slot's weights, whatever the piece's size.
               Joined, a token costs at least what a prompt token of a steady step costs
               (the slope of those steps' periods over their prompt tokens): each step's
               other prompts make its time past the median too noisy to price pieces by.
    allowance  the tokens whose predicted cost fits in `share x steady`, in every step (at most
               twice the largest piece that kept within it, and short of a larger one that
               did not: noise must not turn into a huge step, and a price measured on small
               pieces does not hold for large ones on a GPU). When
               even the smallest piece does not fit (alone: the fixed part is over the share),
               pieces are spaced instead: each is as large as `spaced_steps` steady steps
               of extra time allow (at most twice the largest measured), and waits until the
               credit the share earns every step covers that, so the share still holds on
               average, no step more than triples, and the fixed part is paid as seldom as
               it can be.
               Each step with swap work is charged what it measured, either way (a noisy
               machine's slow and fast steps average out), at most one spaced piece. And a
               step that grew past the share comes at most once in `spaced_every` steps: on
               a GPU a piece alone is a whole pass over the other slot's weights, and one
               such step in five (what the share alone would space them by) shows in every
               inter-token P99; one in 128 shows in none. For pieces alone (a canary's on the
               standby slot) that holds over each stretch of swap work from its start, too
               (the steps from the first that asked for an allowance to the last), not only
               between two such steps: the Nth comes no earlier than N x `spaced_every` steps
               into the stretch (the first piece alone, which measures the price, goes at
               once; the next then waits twice as long). A second swap's canary, priced by the
               first's, ran its one or two pieces at once on an H100, in a phase of 8-16 steps
               whose P99 they were (1.7-2.2x the steady P99). A migration's pieces join a
               serving sub-batch and keep a deadline: held back like that, a simulated CPU
               migration took 3x the steps, and one stream waited 9.7 s in it. Both tests (a
               piece fits the share; a step grew past it) allow for what steady steps of the
               kind run over their median one time in ten (of those without prompt tokens,
               where enough were measured: arrivals' prompts are work, not noise): a busy
               machine's slow step is not the work's.
    most       what one steady step of extra time buys: a migration behind its deadline may
               take more than the allowance, never more than that; the requests a restart
               took back all at once recompute that much a step (`recompute_tokens`); those
               a drain held back compute what fits in the share (`release_tokens`: they wait
               for a first token, not between two), never more than a steady step computed
               within it (a GPU's price per token changes past some hundred tokens); those a
               restart takes back one at a time, what a step serving two versions may take
               (below).
               Until a swap's recompute has been measured, its tokens are priced as the
               prompts that steady steps computed cost.
    two        a step serving two weights versions (a drain, a migration, a restart under
               way) reads both weight sets; the prompt tokens it may take are those that
               keep it within what one steady step in ten on one version takes, over what
               steps of two versions without prompts take (`mixed_prompt_tokens`; a
               restart's whole context in one step where it fits, so that the stream waits
               one step), and for arrivals at least twice what steady steps computed on
               average and what clears those waiting in `_CLEAR_STEPS` steps within a
               quarter past the longest recent steady step (`arrival_tokens`: their prompts
               then go in chunks, and do not pile up), never less than the share buys.

Every eighth step runs without swap work, to keep measuring the steady time. A step with no
serving work has nothing to protect: the scheduler gives swap work its whole budget then.
`fixed_tokens` replaces the rule with a fixed allowance (`--migration-tokens-per-step`).

The pacer hears of every step as a step hook (`sitsd.engine.step.StepHooks`, through the
step's `SwapWork`); the scheduler asks it for the allowance. Which work takes the allowance is
the scheduler's business.
"""

from __future__ import annotations

import itertools
import statistics
from collections import defaultdict, deque
from dataclasses import dataclass
from typing import Protocol

from sitsd.outputs import SchedulerOutput

_STEADY_WINDOW = 32  # steady periods remembered per kind of step
_MIN_STEADY_SAMPLES = 3  # a kind of step is measured once it has this many
_FIT_WINDOW = 16  # steps with swap work the cost is fitted on, per kind of work
_FREE_EVERY = 8  # one step in this many runs without swap work
_MIN_PER_TOKEN_S = 1e-7  # a cost per token below this is noise
_UNPRICED_RELEASE = 16  # prompt tokens a step for requests a drain held, until a token is priced
_CEILING_HOLDS = 1.5  # a piece past the share bounds the next while steady steps grow less
_CLEAR_STEPS = 4  # arrivals' prompts held back while two versions serve clear in this many steps
# ... in steps no longer than this times the longest recent steady step (issue 17's bound on a
# GPU is 1.3x the steady P99): at the longest itself, where steps of two versions already
# take about that (a CPU at 128 streams), arrivals got ~40 tokens a step and waited 37 s.
_CLEAR_CEILING = 1.25
# A step whose allowance nobody asked for in more than this many steps ends a stretch of swap
# work (one step more than the step running ahead, with asynchronous scheduling).
_STRETCH_GAP = 2


@dataclass(frozen=True)
class PacingSettings:
    """Limits of a swap's work inside engine steps (from `SwapConfig`)."""

    # Of the steady step time, the most a swap's work may add to a step (and, on average, the
    # share of the engine's time it may take).
    share: float = 0.2
    fixed_tokens: int = 0  # > 0: this many tokens a step instead of the measured allowance
    # A migration's recompute grows past the share when it must to end within this many
    # steady steps of the commit (`sitsd.engine.migration.Migration.tokens_to_finish`): the
    # device's own pace, so one default holds on a GPU and on a CPU...
    migration_deadline_steps: int = 2000
    # ...or within this many seconds instead, where set (> 0).
    migration_deadline_s: float = 0.0
    # A step the swap's work makes longer than the share allows (a spaced piece) comes at
    # most once in this many steps: under 1% of them, out of every inter-token P99. And a
    # restart takes a stream back (a wait of a step or two) at most once in this many token
    # gaps of the running streams (`sitsd.engine.swap_policies`).
    spaced_every: int = 128
    # A spaced piece adds at most this many steady steps to its step (or what its smallest
    # piece costs, if more): on a GPU a piece alone pays about one for its pass over the
    # other slot's weights, and the rest buys its tokens; its step then at most triples.
    spaced_steps: float = 2.0
    # After a drain commit, new requests wait up to this long for the old version's requests
    # to finish (`sitsd.engine.swap_policies`): a step serving both reads both weight sets.
    drain_hold_s: float = 2.0
    # A request a restart takes back a few a step recomputes its context in at most this many
    # steps, past the share where it must (`sitsd.engine.swap_policies`): its stream waits
    # that many steps, the longest gap of the swap, where each step growing by half a
    # context is one gap in many (a CPU at 128 streams: contexts recomputed over ~10 steps
    # within the share made gaps of 16 s, 6.5x the steady P99).
    restart_steps: int = 2


def _window() -> deque[float]:
    """The last `_STEADY_WINDOW` steady periods of one kind of step."""
    return deque(maxlen=_STEADY_WINDOW)


class FinishedStep(Protocol):
    """What the pacer reads of a step that ended (`sitsd.engine.observer.StepRecord`)."""

    @property
    def sched_out(self) -> SchedulerOutput: ...

    @property
    def start(self) -> float: ...  # time.monotonic() before `schedule()`


class _Cost:
    """Extra seconds of swap work in a step, fitted as fixed + per_token x tokens."""

    def __init__(self, passes_weights: bool) -> None:
        """Args:
        passes_weights: the work runs as a sub-batch of its own, a pass over a slot's
            weights (a fixed part that is real); else it joins a serving sub-batch (tokens
            only: a fixed part fitted below zero is the baseline's, see `_fit`).
        """
        self._passes_weights = passes_weights
        self._samples: deque[tuple[int, float]] = deque(maxlen=_FIT_WINDOW)  # (tokens, extra)
        # `fit()` of the samples as they are, and whether the two-part fit gave it.
        self._fitted: tuple[float, float, bool] | None = None

    def add(self, num_tokens: int, extra_s: float) -> None:
        self._samples.append((num_tokens, extra_s))
        self._fitted = None

    @property
    def known(self) -> bool:
        return bool(self._samples)

    @property
    def largest(self) -> int:
        return max(n for n, _ in self._samples)

    def largest_within(self, bound_s: float) -> int:
        """The most tokens of a sample that cost at most `bound_s` (0: none did)."""
        return max((n for n, e in self._samples if e <= bound_s), default=0)

    @property
    def cheapest(self) -> float:
        """The least extra time a piece of this work has cost (of those remembered), but one:
        with asynchronous scheduling a step's period starts where the last one's ended, so a
        step that ended late measures the next one short (on an H100 a drain's canary priced
        a one-token piece alone at 0.68 ms, where each was a 5 ms pass over the other slot's
        weights, and ran them in consecutive steps)."""
        extras = sorted(e for _, e in self._samples)
        return extras[min(1, len(extras) - 1)]

    @property
    def separable(self) -> bool:
        """The piece sizes vary enough to tell the fixed part from the per-token one."""
        sizes = [n for n, _ in self._samples]
        return len(sizes) >= 3 and max(sizes) >= 1.5 * min(sizes)

    def fit(self) -> tuple[float, float]:
        """(fixed seconds, seconds per token): a median fit of both parts once `separable`
        (for work that joins a serving sub-batch, a fixed part fitted below zero counts as
        none); else, or when the steps' noise hides the per-token part, all of it per token
        (`resolved` False)."""
        if self._fitted is None:
            self._fitted = self._fit()
        return self._fitted[:2]

    @property
    def resolved(self) -> bool:
        """The fit told the fixed part from the per-token one (the two-part fit)."""
        self.fit()
        assert self._fitted is not None
        return self._fitted[2]

    def _fit(self) -> tuple[float, float, bool]:
        samples = self._samples
        if self.separable:  # Theil-Sen: one step slowed by something else moves nothing
            per_token = statistics.median(
                (e2 - e1) / (n2 - n1)
                for (n1, e1), (n2, e2) in itertools.combinations(samples, 2)
                if n2 != n1
            )
            fixed = statistics.median(e - per_token * n for n, e in samples)
            if per_token >= _MIN_PER_TOKEN_S and fixed >= 0.0:
                return fixed, per_token, True
            if per_token >= _MIN_PER_TOKEN_S and not self._passes_weights:
                # Joined work has no fixed part of its own: one below zero is the steady
                # median's, which holds prompts that the small pieces' steps did not carry
                # (a CPU's steps: -50 ms, pieces of 2-26 tokens measured below it). Priced
                # through the origin, their negative extras made every token look 1.4x
                # cheaper; the slope is what the pieces say. (A pass over weights is a real
                # fixed part: there, one below zero is noise in small pieces' slopes, and
                # the all-per-token price below lets the pieces grow.)
                return 0.0, per_token, True
        through_origin = statistics.median(e / n for n, e in samples)
        return 0.0, max(_MIN_PER_TOKEN_S, through_origin), False


@dataclass(frozen=True, slots=True)
class Allowance:
    """The tokens of a swap's work a step may take, and what set them."""

    tokens: int
    # "share": what fits in the share; "spaced": a spaced piece (or 0 while the credit
    # builds); "first": a first piece, to be measured; "measuring": none, the step keeps the
    # steady time measured; "fixed": `fixed_tokens`.
    limit: str
    per_token_s: float = 0.0  # the price of a token it was set at (0: not priced)
    # What the smallest piece was predicted to cost, the test between "share" and "spaced"
    # (0: not priced).
    smallest_s: float = 0.0


class StepPacer:
    """The allowance of a swap's work per step; see the module docstring. Engine thread."""

    def __init__(self, settings: PacingSettings | None = None) -> None:
        self.settings = settings or PacingSettings()
        # Steady periods by the number of weights versions serving in the step.
        self._steady: defaultdict[int, deque[float]] = defaultdict(_window)
        # ...of those that computed no prompt tokens: their spread is the machine's noise,
        # where all steady steps' is arrivals' prompts too (`_spread`).
        self._decodes: defaultdict[int, deque[float]] = defaultdict(_window)
        self._cost = {False: _Cost(False), True: _Cost(True)}  # by `alone`
        # By (`alone`, serving versions): (tokens, steady seconds of that kind of step) of the
        # smallest piece whose step went past the share, until a piece as large keeps within
        # it (that one was slowed by something else). Kept past the fit's window, so that
        # pieces do not grow back past it every `_FIT_WINDOW` steps; it holds while the steady
        # time stays near what it was.
        self._ceiling: dict[tuple[bool, int], tuple[int, float]] = {}
        self._prompts = _Cost(False)  # what steady steps' prompt tokens added (one version)
        # Periods of one-version steady steps that computed prompts, by their prompt tokens.
        self._prefill = _Cost(False)
        # Prompt tokens of recent one-version steady steps (0 for most): what arrivals need.
        self._arrival_prompts: deque[int] = deque(maxlen=4 * _STEADY_WINDOW)
        self._credit = 0.0  # seconds of swap work the share has earned and not spent
        self._num_busy = 0  # consecutive steps with swap work
        self._num_steps = 0  # steps that ended with something scheduled
        # `_num_steps` at the last step whose swap work added more than the share (None: none).
        self._past_share_at: int | None = None
        self._paced_at: int | None = None  # `_num_steps` when `pace` was last asked
        self._stretch_start = 0  # `_num_steps` when the stretch of swap work now began
        self._stretch_past = 0  # steps of that stretch whose swap work went past the share
        self._last_end: float | None = None

    def steady_s(self, num_serving_versions: int = 1) -> float | None:
        """The steady period of steps with that many serving versions; None: not measured."""
        periods = self._steady.get(num_serving_versions)
        if periods is None or len(periods) < _MIN_STEADY_SAMPLES:
            return None
        return statistics.median(periods)

    def pace(self, num_serving_versions: int, alone: bool) -> Allowance:
        """The tokens of swap work the step being scheduled may take (0: none in this one),
        and what set them (for the step's record).

        Args:
            num_serving_versions: weights versions the step's serving requests run on.
            alone: the work would run on a slot that serves nothing in this step.
        """
        settings = self.settings
        self._note_stretch()
        if settings.fixed_tokens:
            return Allowance(settings.fixed_tokens, "fixed")
        steady = self.steady_s(num_serving_versions)
        if steady is None or self.measuring(num_serving_versions):
            return Allowance(0, "measuring")
        cost = self._cost[alone]
        if not cost.known:
            return Allowance(1, "first")  # a smallest piece: what it costs is measured next
        fixed, per_token, resolved = self._price(alone)
        share_s = settings.share * steady
        smallest = self._smallest(alone)
        # What steady steps run over their median now and then is not the work's cost.
        within = share_s + self._spread(num_serving_versions)
        if smallest <= within:  # fits in every step, within the sizes measured so far
            grown = _grown(cost, within, self._ceiling_at(alone, num_serving_versions, steady))
            tokens = max(1, min(int((share_s - fixed) / per_token), grown))
            return Allowance(tokens, "share", per_token, smallest)
        # Spaced: one piece as large as a spaced piece may be, once the credit covers it
        # (fewer, fuller pieces: each pays the fixed part once), at most twice the largest
        # measured. Until the fit tells the fixed part from the per-token one (pieces of
        # similar sizes, or steps noisier than a piece's tokens cost), each is just that: an
        # all-per-token fit would keep the pieces as small as the noise makes them look.
        cap = self._spaced_cap(steady, smallest)
        if self._credit < cap or not self._may_pass_share(alone):
            return Allowance(0, "spaced", per_token, smallest)
        grown = 2 * cost.largest + 2
        if not resolved:
            return Allowance(grown, "spaced", per_token, smallest)
        tokens = max(1, min(int((cap - fixed) / per_token), grown))
        return Allowance(tokens, "spaced", per_token, smallest)

    def most_tokens(self, num_serving_versions: int, alone: bool) -> int:
        """The most tokens of swap work a step may take even when more presses (a migration
        behind its deadline): what one steady step of extra time buys, so that no step more
        than doubles; 0 until that work's cost has been measured."""
        if self.settings.fixed_tokens:
            return 0
        steady = self.steady_s(num_serving_versions)
        if steady is None or not self._cost[alone].known:
            return 0
        return _most(*self._price(alone)[:2], steady)

    def recompute_tokens(self, budget: int) -> int:
        """Tokens the requests a swap restarted may recompute in the step being scheduled:
        what one steady step of extra time buys (`most_tokens`: they are the streams waiting,
        so as much as keeps a step from more than doubling). Until recompute has been
        measured, priced as the prompts that steady steps computed cost; the whole `budget`
        until either is measured."""
        if self.settings.fixed_tokens:
            return self.settings.fixed_tokens
        steady = self.steady_s(1)
        if steady is None or not self._join_cost().known:
            return budget
        return _most(*self._price(False)[:2], steady)

    def release_tokens(self, budget: int) -> int:
        """Prompt tokens that requests a drain held back may compute in the step being
        scheduled: what fits in `share x steady` (they wait for a first token; the streams
        running must not feel them), priced as `recompute_tokens` prices them, and no more
        than a step measured within the share computed (a few where none did); where even one
        token would not fit, what one steady step of extra time buys. A few tokens a step
        until a token's price is measured.

        A price per token holds over the sizes it was measured on only: a GPU step is bound
        by its pass over the weights up to some hundred tokens and by compute past them.
        Steady steps' prompts priced a token near nothing on an H200, and held prompts of
        194-1024 tokens made steps of 12-23 ms where steady ones take 5."""
        if self.settings.fixed_tokens:
            return self.settings.fixed_tokens
        steady = self.steady_s(1)
        if steady is None or not self._join_cost().known:
            return min(budget, _UNPRICED_RELEASE)
        fixed, per_token, _ = self._price(False)
        share_s = self.settings.share * steady
        fits = int((share_s - fixed) / per_token)
        if fits <= 0:
            return self.recompute_tokens(budget)
        # Of the sizes measured (steady steps' prompts, joined swap work), those whose steps
        # kept within the share and the steady steps' own spread; none did: a few tokens.
        within = share_s + self._spread(1)
        seen = max(self._prefill.largest_within(steady + within),
                   self._cost[False].largest_within(within))  # fmt: skip
        return min(fits, seen or _UNPRICED_RELEASE)

    def mixed_prompt_tokens(self, budget: int) -> int:
        """Prompt tokens (past one a request) that a step serving two weights versions may
        compute: as many as keep it within what one steady step in ten on one version takes,
        arrivals' prompts and all (the steps clients see now and then in steady serving),
        over what steps of two versions that compute no prompts take; priced as
        `release_tokens` prices them. Never fewer than `release_tokens` gives (the share:
        where a second version's pass alone goes past that, as on a GPU, prompts still move
        at its pace), and that until steps of two versions are measured.

        A step serving two versions pays a pass over each one's weights: a CPU with SmolLM2
        at 32 streams took 1.5x the steady median for it, and one that also computed an
        arrival's prompt of 150-300 tokens 1.6-1.9x the steady P99, the P99 of every
        two-version phase (migrate, drain, restart). It is also the room of the requests a
        restart takes back one at a time (the others decode on the old version meanwhile):
        given what a steady step's prompts were instead, a CPU at 128 streams recomputed
        256-367 tokens in steps that already read both weight sets, 1.6-1.8x the steady
        median."""
        release = self.release_tokens(budget)
        fits = self._two_version_fits(0.9)
        return release if fits is None else max(release, min(fits, budget))

    def arrival_tokens(self, budget: int, backlog: int) -> int:
        """Prompt tokens (past one a request) of arrivals that a step serving two weights
        versions may compute: `mixed_prompt_tokens`, or more where twice what steady steps
        on one version computed on average is more, or what computes the `backlog` (the
        arrivals' prompt tokens not yet computed) in `_CLEAR_STEPS` steps, as long as the
        step stays within `_CLEAR_CEILING` times the longest of the recent steady steps on
        one version. A prompt is computed in chunks over a few steps then (its first token
        comes later; the running streams do not wait), and the arrivals' work is spread
        evenly over the steps. Capped
        below what arrives, it would pile up and come all at once when the swap ends: in
        simulation 482 prompt tokens in the step after a restart; on a CPU at 128 streams,
        where steady steps' prompts were mostly prefix-cache hits and the new version's
        cache was cold, first tokens 28 s late and a step of 708 tokens after a migration.
        Clearing without a bound, arrivals waiting in a drain made steps of 479-608 tokens
        there, 1.8x the steady P99."""
        arrivals = self._arrival_prompts
        mean = 2 * sum(arrivals) // len(arrivals) if arrivals else 0
        clear = -(-backlog // _CLEAR_STEPS)
        ceiling = self._two_version_fits(1.0, _CLEAR_CEILING)
        if ceiling is not None:
            clear = min(clear, ceiling)
        return max(self.mixed_prompt_tokens(budget), min(max(mean, clear), budget))

    def _two_version_fits(self, quantile: float, times: float = 1.0) -> int | None:
        """Prompt tokens that keep a step serving two versions within `times` the `quantile`
        of recent steady periods on one version (1.0: the longest), over the median of steps
        of two versions that computed no prompts, priced as `release_tokens` prices them
        (may be negative); None until both kinds of step and the price are measured."""
        ones, decodes = self._steady.get(1, ()), self._decodes.get(2, ())
        if self.settings.fixed_tokens or len(ones) < _MIN_STEADY_SAMPLES:
            return None
        if len(decodes) < _MIN_STEADY_SAMPLES or not self._join_cost().known:
            return None
        periods = sorted(ones)
        envelope = times * periods[int(quantile * (len(periods) - 1))]
        fixed, per_token, _ = self._price(False)
        return int((envelope - statistics.median(decodes) - fixed) / per_token)

    def measuring(self, num_serving_versions: int) -> bool:
        """The step being scheduled must run without swap work: its kind's steady time is
        not measured yet, or it is the step in eight that keeps it measured."""
        if self.settings.fixed_tokens:
            return False
        return self.steady_s(num_serving_versions) is None or self._num_busy >= _FREE_EVERY - 1

    # ------------------------------------------------------------------------ step hooks

    def step_started(self, now: float) -> None:
        pass

    def scheduled(self, sched_out: SchedulerOutput, started: float) -> None:
        pass

    def step_ended(self, record: FinishedStep | None, end: float) -> None:
        """Measure the step that ended: a steady period, or the cost of its swap work."""
        last_end, self._last_end = self._last_end, end
        if record is None or record.sched_out.is_empty:
            return
        period = end - max(record.start, last_end if last_end is not None else record.start)
        self._num_steps += 1
        work = record.sched_out.swap_work
        if work is None:  # not scheduled to the end (a preemption): its kind is unknown
            return
        if work.num_tokens == 0:
            self._num_busy = 0
            key = work.num_serving_versions
            self._steady[key].append(period)
            steady = self.steady_s(key)
            self._earn(steady)
            # Tokens past one a request: the prompts this steady step computed.
            sched_out = record.sched_out
            prompts = sched_out.total_num_scheduled_tokens - len(sched_out.num_scheduled_tokens)
            if prompts == 0:
                self._decodes[key].append(period)
            if key == 1:
                self._arrival_prompts.append(prompts)
            if key == 1 and prompts > 0 and steady is not None:
                self._prompts.add(prompts, period - steady)
                self._prefill.add(prompts, period)
            return
        self._num_busy += 1
        if work.num_tokens == record.sched_out.total_num_scheduled_tokens:
            return  # nothing served in it: nothing to measure against
        steady = self.steady_s(work.num_serving_versions)
        if steady is None:
            return
        extra = period - steady
        # Past the share, and past what steady steps of its kind take now and then: a busy
        # machine's slow step is not the work's (a CPU's 1-2.6 s steps spaced a canary that
        # fitted the share 128 steps apart: 178 s for 11 steps' work).
        past_share = extra > self.settings.share * steady + self._spread(work.num_serving_versions)
        if past_share:
            self._past_share_at = self._num_steps
            self._stretch_past += 1
        self._cost[work.alone].add(work.num_tokens, extra)
        self._note_ceiling(work.alone, work.num_serving_versions, work.num_tokens, past_share,
                           steady)  # fmt: skip
        # Signed: a step's noise either way averages out (charging only the slow ones would
        # spend more than the share earns on a noisy machine); one outlier costs at most what
        # a spaced piece may.
        self._credit -= min(extra, self._cap(steady))
        self._earn(steady)

    # ------------------------------------------------------------------------------ internal

    def _note_stretch(self) -> None:
        """`pace` is asked: after more than `_STRETCH_GAP` steps without, a stretch of swap
        work begins."""
        if self._paced_at is None or self._num_steps - self._paced_at > _STRETCH_GAP:
            self._stretch_start, self._stretch_past = self._num_steps, 0
        self._paced_at = self._num_steps

    def _may_pass_share(self, alone: bool) -> bool:
        """A spaced piece may go in the step being scheduled: `spaced_every` steps since the
        last step past the share, and for a piece alone, the stretch's Nth such step at least
        N x `spaced_every` steps into it (the module docstring; a migration's pieces join a
        serving sub-batch and have a deadline to keep)."""
        every = self.settings.spaced_every
        if self._past_share_at is not None and self._num_steps - self._past_share_at < every:
            return False
        into = self._num_steps - self._stretch_start
        return not alone or into >= (self._stretch_past + 1) * every

    def _spread(self, num_serving_versions: int) -> float:
        """How far above their median one steady step in ten of that kind runs, of those that
        computed no prompts where enough did: under churning load the others' spread is the
        arrivals' prompts (a simulated CPU at 32 streams: a spread past a whole pass over the
        other slot's weights, so one-token pieces alone "fitted" and ran in every step, each
        doubling it), not the noise this allowance is for."""
        decodes = self._decodes.get(num_serving_versions, ())
        periods = sorted(decodes if len(decodes) >= _MIN_STEADY_SAMPLES
                         else self._steady[num_serving_versions])  # fmt: skip
        return periods[int(0.9 * (len(periods) - 1))] - statistics.median(periods)

    def _note_ceiling(self, alone: bool, num_serving_versions: int, num_tokens: int,
                      past_share: bool, steady: float) -> None:  # fmt: skip
        """Keep the ceiling of that kind of piece: a piece past the share sets it where it is
        smaller than the one that holds (or none holds: the first, or the first since the
        steady time moved); a piece as large as it that kept within the share drops it."""
        kind = (alone, num_serving_versions)
        if past_share:
            held = self._ceiling_at(alone, num_serving_versions, steady)
            if held is None or num_tokens < held:
                self._ceiling[kind] = (num_tokens, steady)
        elif kind in self._ceiling and num_tokens >= self._ceiling[kind][0]:
            del self._ceiling[kind]

    def _ceiling_at(self, alone: bool, num_serving_versions: int, steady: float) -> int | None:
        """The fewest tokens of a piece of that kind that went past the share, while the
        steady time is at most `_CEILING_HOLDS` times what it was then (more streams make
        longer steps with room for larger pieces); None: no such piece."""
        ceiling = self._ceiling.get((alone, num_serving_versions))
        if ceiling is None or steady > _CEILING_HOLDS * ceiling[1]:
            return None
        return ceiling[0]

    def _earn(self, steady: float | None) -> None:
        """Each busy step earns the share of its kind's steady time (None: not measured),
        up to what one spaced piece may cost."""
        if steady is None:
            return
        self._credit = min(self._cap(steady), self._credit + self.settings.share * steady)

    def _price(self, alone: bool) -> tuple[float, float, bool]:
        """(fixed seconds, seconds per token, whether a two-part fit gave them) of swap work
        alone on a slot, or joining a serving sub-batch.

        Joined tokens are prompt tokens to the sub-batch they join: one costs at least the
        slope of steady steps' periods over the prompt tokens they computed, where those vary
        enough to fit one. The pieces' own fit (and the prompts' in `_prompts`) take each
        step's time past the steady median, which the same step's other prompts move by as
        much as a piece costs: under a churning load their slopes fell near zero (a CPU at
        128 streams: 0.028 ms a token where one costs ~2 ms), and pieces doubled to 7-11x the
        share in simulation. The periods themselves, against all the prompt tokens in them,
        carry that variance as signal."""
        prefill = self._prefill
        if alone or not (prefill.known and prefill.resolved):
            cost = self._cost[alone] if alone else self._join_cost()
            return (*cost.fit(), cost.resolved)
        floor = prefill.fit()[1]
        joined = self._cost[False]
        if joined.known and joined.resolved:
            fixed, slope = joined.fit()
            return fixed, max(slope, floor), True
        return 0.0, floor, True

    def _join_cost(self) -> _Cost:
        """What tokens joining a serving sub-batch cost: as a swap's work measured it, else
        as the prompts of steady steps did."""
        return self._cost[False] if self._cost[False].known else self._prompts

    def _smallest(self, alone: bool) -> float:
        """What the smallest piece of that kind costs (its cost measured at least once).
        Until the fit tells the fixed part from the per-token one, an all-per-token fit
        would price it below what every piece so far has cost (a whole pass over the other
        slot's weights for a handful of tokens, on a GPU): at least the least but one."""
        fixed, per_token, resolved = self._price(alone)
        return fixed + per_token if resolved else max(per_token, self._cost[alone].cheapest)

    def _cap(self, steady: float) -> float:
        """The most a spaced piece may cost, in steps `steady` long: what `pace` waits for
        the credit to cover (a cap below it would starve the pieces)."""
        alone = self._cost[True]
        return self._spaced_cap(steady, self._smallest(True) if alone.known else 0.0)

    def _spaced_cap(self, steady: float, smallest: float) -> float:
        """The most a spaced piece may cost: `spaced_steps` steady steps, or the smallest
        piece if more."""
        return max(self.settings.spaced_steps * steady, smallest)


def _grown(cost: _Cost, within_s: float, ceiling: int | None) -> int:
    """The most tokens the next piece priced into the share may take: twice the largest piece
    that cost at most `within_s` (the share and the steady steps' spread), and 2; and no more
    than halfway from it to `ceiling`, the fewest tokens of a piece that went past it
    (`StepPacer._ceiling_at`).

    A price per token holds over the sizes it was measured on only. A GPU step is bound by its
    pass over the weights up to some hundred tokens and by compute past them: on an H100 at
    32 streams a migration's pieces doubled 64 -> 130 -> 262 at near 0.001 ms a token, the
    262-token step took 19 ms (two-version steps 12), and the next piece, twice the largest
    measured, took 485 tokens and 27 ms. Grown from the largest that kept within the share
    instead, and fallen back between the two sizes once a piece went past it, pieces find
    the knee in a few steps and stay under it."""
    fitted = cost.largest_within(within_s)
    grown = 2 * fitted + 2
    if ceiling is not None and ceiling > fitted:
        grown = min(grown, max(1, (fitted + ceiling) // 2))
    return grown


def _most(fixed: float, per_token: float, steady: float) -> int:
    """Tokens of work at `fixed + per_token x tokens` seconds that one steady step of extra
    time buys."""
    return max(1, int((max(steady, fixed + per_token) - fixed) / per_token))
