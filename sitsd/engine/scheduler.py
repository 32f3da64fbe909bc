"""Continuous batching: which requests compute how many tokens in the next step.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: each step, a request's
`num_computed_tokens` catches up with its `num_tokens` under the step's token budget; a
running request that finds no free block preempts from the end of the batch (by recompute:
its blocks are freed, the full ones stay in the prefix cache until evicted, and it goes back
to the queue keeping its place). `schedule()` runs the step's phases:

    0. ahead     asynchronous scheduling: the step still computing counts as done
       flip      a migration whose shadows all caught up flips, in a step scheduled in turn
                 (`swaps.flip_if_ready`)
    1. caps      the tiers' live P99s, once per control interval; the policy sets caps, the
                 order of the running requests and this step's prompt allowance
    2. running   running requests in the policy's order, preempting from the end for blocks
    3. admission the policy admits waiting requests (`policy.admit`), possibly preempting;
                 while live requests run on two weights versions, the prompt tokens of
                 phases 2 and 3 stay within the pacer's `arrival_tokens` (`_mixed_room`)
    4. swap work a swap's work, in what the step has left and the pacer allows: migration
                 shadows, then canary probes (`sitsd.engine.swap_work`); requests a swap
                 restarted recompute in phases 2 and 3, within the pacer's recompute tokens
                 (`swaps.start_step`, in phase 1, which also takes back the next requests a
                 restart takes a few at a time)

Its composed parts decide, it moves: the scheduling policy (`sitsd.engine.policy`: FCFS, or
the SLA tiers of `sitsd.engine.tier_policy`) answers order, caps, chunk sizes, admission and
preemption victims; the swap policies (`sitsd.engine.swap_policies`) switch requests in
flight to a new weights version; the canary's probes (`sitsd.engine.probes`) wait for room in
a step; the pacer (`sitsd.engine.pacing`) says how many tokens of a swap's work a step may
take. They act through the primitives of `sitsd.engine.batch`, so this class stays the one
writer of request state. The per-tier statistics (latency windows, counters: every request
has a tier under either policy) are a `TierTracker`.

Asynchronous scheduling (`SchedulerConfig.async_scheduling`): `schedule()` may run while the
last step it scheduled is still computing. Its phase 0 then counts that step's tokens as
computed and a token it samples as a pending output (`Request.num_pending_outputs`), so a
decode is scheduled for the position of a token the host has not seen (the runner reads it on
the device); `update_from_output` of that step then appends tokens without advancing again. A
request whose pending token is its last (max_tokens, the context) is not scheduled again.

What the model computes is the runner's business; stop strings and text are the output
processor's; the engine core (`core.py`) drives one `schedule()` -> execute ->
`update_from_output()` cycle per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sitsd.config import SchedulerConfig, TiersConfig
from sitsd.engine.admission import QueueSnapshot, Refusal
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.pacing import PacingSettings, StepPacer
from sitsd.engine.policy import make_policy
from sitsd.engine.probes import Probes
from sitsd.engine.request import Request, RequestStatus
from sitsd.engine.swap_policies import SwapPolicies
from sitsd.engine.swap_work import SwapWorkPhase
from sitsd.engine.tiers import TierTracker
from sitsd.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    Preemption,
    PreemptionReason,
    SchedulerOutput,
    TierStats,
)
from sitsd.plugins.interface import BatchController
from sitsd.types import TIER_ORDER, FinishReason, TokenLogprob

_STEP_TIME_SMOOTHING = 0.2  # weight of the newest step in the step-time moving average


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one request from one step, and whether that finished it."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    weights_version: str = ""  # the version that computed them (a request may flip later)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked


class Scheduler:
    """Owns the waiting queue and the running batch; the only writer of `Request` state."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        tiers: TiersConfig | None = None,
        controller: BatchController | None = None,
        pacing: PacingSettings | None = None,
    ) -> None:
        """Args:
        config: batch limits and the policy ("tiers" or "fcfs").
        kv_cache: the block allocator.
        max_model_len: context length; a request reaching it finishes with LENGTH.
        clock: monotonic seconds; the same clock as requests' arrival times.
        tiers: the tiers' targets and limits (default: the SITS table).
        controller: the tiers policy's batch controller (default: the one `tiers` names).
        pacing: how much of a swap's work (migration, canary) a step may take.

        Raises:
            ValueError: an unknown policy or batch controller.
        """
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self._clock = clock
        self.tiers_config = tiers or TiersConfig()
        self.tracker = TierTracker(self.tiers_config, config.max_num_seqs)
        self.policy = make_policy(config, self.tiers_config, self.tracker, controller)
        pacing = pacing or PacingSettings()
        self.pacer = StepPacer(pacing)
        self.swaps = SwapPolicies(self, pacing.migration_deadline_steps,
                                  pacing.migration_deadline_s, pacing.drain_hold_s,
                                  pacing.restart_steps,
                                  0 if pacing.fixed_tokens else pacing.spaced_every)  # fmt: skip
        self.probes = Probes(self)
        self.swap_work = SwapWorkPhase(self, self.swaps, self.probes, self.pacer)
        self.requests: dict[str, Request] = {}
        self.waiting = self.policy.new_queue()
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_time_s = 0.0  # moving average of schedule() -> update_from_output()
        self._step_started: float | None = None
        # Told to the runner with the next SchedulerOutput, so it can drop their state.
        self._finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()  # preempted between steps (swap restarts)
        self._preemptions: list[Preemption] = []  # and why, for the next step's observers
        # Asynchronous scheduling: the last scheduled step whose output is not in yet.
        self._ahead: SchedulerOutput | None = None
        # Requests taken back while that step samples their next token, by req_id: the
        # version the token is computed on (a swap may have given the request another).
        self._in_flight_versions: dict[str, str] = {}
        # Prompt tokens (past one a request) the step being scheduled may still compute while
        # live requests run on two weights versions (`_mixed_room`); None: on one version.
        self._mixed_left: int | None = None
        self.arrival_room: int | None = None  # what the last step scheduled began with

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already scheduled")
        self.requests[request.req_id] = request
        self.waiting.push(request)

    def finish_request(self, req_id: str, reason: FinishReason) -> Request | None:
        """Finish a live request (abort, stop string, error): free its blocks. None if unknown
        (a canary probe's id fails the probe: its step failed)."""
        request = self.requests.pop(req_id, None)
        if request is None:
            self.probes.fail(req_id, f"its engine step failed ({reason.value})")
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self.kv_cache.free(request)
        self.swaps.drop_shadow(request, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_req_ids.add(request.req_id)
        return request

    def has_work(self) -> bool:
        # A pending migration completes at the start of a step, even one with nothing to run.
        return bool(
            self.waiting or self.running or self.swaps.migration is not None or self.probes.pending
        )

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    def expired_req_ids(self, now: float) -> list[str]:
        """Live requests whose deadline has passed."""
        return [
            r.req_id for r in self.requests.values() if r.deadline is not None and r.deadline <= now
        ]

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work, phase by phase (see the module docstring)."""
        now = self._step_started = self._clock()
        out = SchedulerOutput(
            finished_req_ids=self._finished_req_ids,
            preempted_req_ids=self._preempted_req_ids,
            preemptions=self._preemptions,
        )
        self._finished_req_ids, self._preempted_req_ids, self._preemptions = set(), set(), []
        ahead = self._ahead
        if ahead is not None:
            self._apply_ahead(ahead)  # 0: the step still running counts as done
        self.swaps.flip_if_ready(out, in_turn=ahead is None)  # 0: requests take shadows' KV
        self.policy.start_step(self, now, self.tracker.refresh(now))  # 1: caps, order
        self.swaps.start_step(self._swap_room(), out)  # 1: a swap's work, paced
        self.arrival_room = self._mixed_left = self._mixed_room()
        preempted = self._schedule_running(out)  # 2
        # Not after a preemption: the freed blocks went to running requests, and admitting now
        # would thrash.
        if not preempted:
            self.policy.admit(self, out)  # 3
            self.swap_work.schedule(out)  # 4: in what is left
        if out.is_empty:
            # Not launched: the runner hears of these with the next step that runs (observers
            # heard of `out.preemptions` already).
            self._finished_req_ids |= out.finished_req_ids
            self._preempted_req_ids |= out.preempted_req_ids
        elif self.config.async_scheduling:
            self._ahead = out
        return out

    def _apply_ahead(self, ahead: SchedulerOutput) -> None:
        """Asynchronous scheduling: count a launched step's tokens as computed now, and the
        tokens it samples as pending outputs, so this step can schedule what follows them."""
        self._ahead = None
        ahead.applied_ahead = True
        for req_id, num_tokens in ahead.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                continue
            request.num_computed_tokens += num_tokens
            if request.num_computed_tokens == request.num_tokens + request.num_pending_outputs:
                request.num_pending_outputs += 1  # its chunk reached the end: it samples

    def drop_ahead(self) -> None:
        """The engine finishes the launched step before scheduling again (a swap, a canary):
        its output is applied by `update_from_output` as in synchronous scheduling."""
        self._ahead = None

    def _schedule_running(self, out: SchedulerOutput) -> bool:
        """Running requests in list order; preempt from the end when blocks run out."""
        preempted = False
        i = 0
        while i < len(self.running) and self.budget(out) > 0:
            request = self.running[i]
            left = request.num_tokens + request.num_pending_outputs - request.num_computed_tokens
            num_new = self.policy.allowed(request, self._room(request, left, out))
            if num_new == 0 or self._finishes_pending(request):
                # A lower-tier prompt chunk left for a step without gold's, or a request whose
                # pending token is its last.
                i += 1
                continue
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running[-1]
                self.preempt(victim, out, PreemptionReason.BLOCKS, request)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # the request itself was the last and got preempted
            out.cached_reqs.append(
                CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens)
            )
            self._count(out, request, num_new)
            i += 1
        return preempted

    def _finishes_pending(self, request: Request) -> bool:
        """Its pending output is its last token (max_tokens or the context): nothing to add."""
        if not request.num_pending_outputs:
            return False
        return (
            request.num_output_tokens + request.num_pending_outputs >= request.params.max_tokens
            or request.num_tokens + request.num_pending_outputs >= self.max_model_len
        )

    def _swap_room(self) -> int:
        """Tokens that requests a swap held back may compute in the step being scheduled
        (the pacer is asked only while there are some): those a restart took back all at
        once, what one steady step of extra time buys (their streams wait for it); those a
        drain held, what fits in the share (they wait for a first token, the streams running
        must not feel them); those a restart takes back one at a time, what a step serving two
        versions may compute (`mixed_prompt_tokens`: each stream waits a step or two, the
        others must not feel it)."""
        swaps, pacer, budget = self.swaps, self.pacer, self.config.max_num_batched_tokens
        room = pacer.recompute_tokens(budget) if swaps.recomputing else budget
        if swaps.releasing:
            room = min(room, pacer.release_tokens(budget))
        if swaps.restarting:
            room = min(room, pacer.mixed_prompt_tokens(budget))
        return room

    def _mixed_room(self) -> int | None:
        """Prompt tokens of arrivals, past one a request, that the step being scheduled may
        compute while the live requests run on more than one weights version (a swap's
        drain, migration or restart; its own recompute is paced apart): the pacer's
        `arrival_tokens`, given the prompt tokens the arrivals have still to compute (a
        waiting one's prefix-cache hits counted in: an estimate from above). None: one
        version, no such limit."""
        requests = self.requests.values()
        if len({r.weights_version for r in requests}) < 2:
            return None
        swaps = self.swaps
        backlog = sum(max(0, r.num_tokens - r.num_computed_tokens - 1) for r in requests
                      if swaps.recompute_room(r) is None)  # fmt: skip
        return self.pacer.arrival_tokens(self.config.max_num_batched_tokens, backlog)

    def _room(self, request: Request, num_left: int, out: SchedulerOutput) -> int:
        """Tokens `request` may compute in this step before the policy's say: what it has
        left, within the step's budget and, held back by a swap (restart, drain), that room;
        else, while requests run on two weights versions, one and what is left of the
        step's room for prompts (`_mixed_room`: a prompt is computed in chunks then)."""
        num = min(num_left, self.budget(out))
        room = self.swaps.recompute_room(request)
        if room is not None:
            return max(0, min(num, room))
        if self._mixed_left is not None:
            return min(num, 1 + max(0, self._mixed_left))
        return num

    def _count(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.num_scheduled_tokens[request.req_id] = num_new
        out.total_num_scheduled_tokens += num_new
        if self._mixed_left is not None and self.swaps.recompute_room(request) is None:
            self._mixed_left -= num_new - 1
        self.policy.charge(request, num_new)
        self.swaps.charge(request, num_new)

    # ------------------------------------------------- primitives (`sitsd.engine.batch.Batch`)

    def now(self) -> float:
        return self._clock()

    def budget(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.total_num_scheduled_tokens

    def kept_out(self, request: Request) -> bool:
        # A request taken back while the step ahead samples its token waits for that token:
        # readmitted now, it would start without it.
        return (
            bool(request.num_pending_outputs)
            or self.swaps.holds(request)
            or self.swaps.paced_out(request)
        )

    def try_admit(self, request: Request, out: SchedulerOutput) -> int | None:
        """Move a waiting request into the batch; None if its first chunk's blocks don't fit."""
        if self.budget(out) <= 0 or self.kept_out(request):
            return None
        computed_blocks = self.kv_cache.get_computed_blocks(request)
        num_hit = len(computed_blocks) * self.kv_cache.block_size
        num_new = self.policy.allowed(
            request, self._room(request, request.num_tokens - num_hit, out)
        )
        if num_new == 0:
            return None
        new_block_ids = self.kv_cache.allocate_slots(request, num_new, computed_blocks)
        if new_block_ids is None:
            return None
        self.waiting.remove(request)
        if request.num_cached_tokens < 0:  # first admission: count the prefix-cache lookup
            request.num_cached_tokens = num_hit
            self.kv_cache.record_lookup(request.num_prompt_tokens, num_hit)
            request.first_scheduled_time = self._clock()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        self.running.append(request)
        out.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                params=request.params,
                seed=request.seed,
                block_ids=self.kv_cache.block_ids(request),
                num_computed_tokens=num_hit,
                weights_version=request.weights_version,
            )
        )
        self._count(out, request, num_new)
        return num_new

    def unschedule(self, req_id: str, out: SchedulerOutput) -> None:
        num = out.num_scheduled_tokens.pop(req_id, 0)
        out.total_num_scheduled_tokens -= num
        out.cached_reqs = [c for c in out.cached_reqs if c.req_id != req_id]
        out.new_reqs = [n for n in out.new_reqs if n.req_id != req_id]

    def take_back(self, request: Request, out: SchedulerOutput | None) -> None:
        self._take_back(request, out, Preemption(request.req_id, PreemptionReason.SWAP))

    def _take_back(self, request: Request, out: SchedulerOutput | None, record: Preemption) -> None:
        if request.num_pending_outputs:  # the step launched ahead samples its next token
            self._in_flight_versions[request.req_id] = request.weights_version
        self.running.remove(request)
        self.kv_cache.free(request)
        migrating_to = self.swaps.drop_shadow(request, out)
        if migrating_to is not None:
            request.weights_version = migrating_to  # recomputed on the new weights
        self.swaps.taken_back(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.push_preempted(request)
        if out is None:
            self._preempted_req_ids.add(request.req_id)
            self._preemptions.append(record)
        else:
            out.preempted_req_ids.add(request.req_id)
            out.preemptions.append(record)

    def preempt(
        self,
        request: Request,
        out: SchedulerOutput,
        reason: PreemptionReason,
        for_request: Request,
    ) -> None:
        # Block-pressure victims come from the end of `running`, which this step has not
        # scheduled yet; tier victims scheduled already are taken out by `unschedule`.
        record = Preemption(request.req_id, reason, for_request.req_id, for_request.tier.value)
        self._take_back(request, out, record)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.tracker.num_preempted[request.tier] += 1

    def forget(self, req_id: str) -> None:
        self._finished_req_ids.add(req_id)

    # ---------------------------------------------------------------------------- the update

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[TokenUpdate]:
        """Advance computed tokens, append sampled tokens, finish what hit a stop condition."""
        self.swaps.advance(sched_out)
        self.probes.advance(sched_out)  # finished probes are reported to their owner
        if self._ahead is sched_out:
            self._ahead = None  # updated before anything was scheduled after it
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                if not sched_out.applied_ahead:
                    request.num_computed_tokens += num_tokens
                self.kv_cache.cache_full_blocks(request)
        now = self._clock()
        if self._step_started is not None:
            elapsed = now - self._step_started
            a = _STEP_TIME_SMOOTHING if self.step_time_s else 1.0
            self.step_time_s += a * (elapsed - self.step_time_s)
        updates = []
        logprobs: list[list[TokenLogprob]] | list[None] = runner_out.logprobs or [None] * len(
            runner_out.req_ids
        )
        for req_id, token_ids, token_logprobs in zip(
            runner_out.req_ids, runner_out.sampled_token_ids, logprobs
        ):
            request = self.requests.get(req_id)
            if request is None or not token_ids:
                continue
            if sched_out.applied_ahead and request.num_pending_outputs:
                request.num_pending_outputs -= 1
            accepted, reason = self._append_tokens(request, token_ids)
            if request.first_token_time is None:
                request.first_token_time = now
                self.tracker.record_ttft(request.tier, now, now - request.arrival_time)
            elif request.last_token_time is not None:
                self.tracker.record_itl(request.tier, now, now - request.last_token_time)
            request.last_token_time = now
            # A request taken back (a swap may give it a new version) while this step ran
            # ahead: the token is still the version's that computed it.
            version = self._in_flight_versions.pop(req_id, request.weights_version)
            if reason is not None:
                self.finish_request(req_id, reason)
            accepted_logprobs = token_logprobs[: len(accepted)] if token_logprobs else None
            updates.append(TokenUpdate(request, accepted, reason, version, accepted_logprobs))
        self._in_flight_versions.clear()  # all of this step's (none left by a failed one)
        return updates

    def _append_tokens(
        self, request: Request, token_ids: Iterable[int]
    ) -> tuple[list[int], FinishReason | None]:
        params = request.params
        accepted = []
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            accepted.append(token_id)
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return accepted, FinishReason.STOP
            if token_id in params.stop_token_ids:
                return accepted, FinishReason.STOP
            if request.num_output_tokens >= params.max_tokens:
                return accepted, FinishReason.LENGTH
            if request.num_tokens >= self.max_model_len:
                return accepted, FinishReason.LENGTH
        return accepted, None

    # ---------------------------------------------------------- admission control and status

    def admission_refusal(self, request: Request) -> Refusal | None:
        """Why `request` (not added yet) must be refused at once (the policy's rule), or None."""
        return self.policy.refusal(request, self, self.step_time_s)

    def overdue_requests(self, now: float) -> list[tuple[str, str]]:
        """(req_id, reason) of waiting requests the policy sheds now."""
        return self.policy.overdue(self, now)

    def queue_snapshot(self) -> QueueSnapshot:
        """The queue as admission control sees it (plain data, safe to hand to other threads)."""
        return self.policy.queue_snapshot(self, self.step_time_s)

    def tier_stats(self) -> tuple[TierStats, ...]:
        """Targets, caps, P99s (as of the last control interval) and counters, gold first."""
        running = {t: sum(1 for r in self.running if r.tier is t) for t in TIER_ORDER}
        waiting = {t: sum(1 for r in self.waiting if r.tier is t) for t in TIER_ORDER}
        fixed_cap = None if self.policy.uses_caps else self.config.max_num_seqs
        return self.tracker.stats(running, waiting, fixed_cap=fixed_cap)
