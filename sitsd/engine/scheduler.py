"""Continuous batching: which requests compute how many tokens in the next step.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: each step, a request's
`num_computed_tokens` catches up with its `num_tokens` under the step's token budget. Two
policies (`SchedulerConfig.policy`) decide the order; `schedule()` runs them as named phases.

`fcfs`: running requests go first, in admission order; waiting requests are admitted in arrival
order while budget, batch slots and KV blocks last. When a running request cannot get a block,
the most recently admitted running request is preempted by recompute: its blocks are freed
(they stay in the prefix cache until evicted) and it goes back to the front of the queue.

`tiers` (the SLA tiers: rules in `sitsd.engine.tiers`, phases in `sitsd.engine.tier_phases`),
the same rule plus:
  1. caps: the batch controller refreshes each tier's batch cap from its live P99s;
  2. running: gold first, then silver, then bronze (oldest first within a tier), so block
     pressure preempts the newest bronze work first;
  3. gold steps: while gold has prompt tokens to compute, lower tiers' prompt chunks are cut
     to `lower_tier_prefill_allowance` (the step stays within `gold_step_tokens`);
  4. admission: waiting requests by queue deadline (aging); a tier at its cap is skipped; a
     gold request that finds no slot or blocks preempts running bronze, then silver work
     (newest first, each request at most `max_tier_preemptions` times); once a request is
     blocked, only gold may still be admitted behind it;
  5. shedding and admission control (`overdue_requests`, `admission_refusal`, called by the
     engine core): a request whose expected queue wait exceeds its tier's maximum is refused,
     one still waiting for its first token past it is dropped; both become RESOURCE_EXHAUSTED.
Preempted requests keep their arrival time, hence their place, and their full blocks stay in
the prefix cache, so resuming them mostly recomputes less than one block.

Weights versions (hot-swap): every request runs on one version, and a step's batch may hold two
(the runner runs one sub-batch per version). `switch_weights`, called by the engine core between
steps when a swap commits, applies the swap policy to the requests in flight: `drain` leaves
those that started on the old version, `restart` preempts them onto the new one, `migrate` gives
each a shadow (`sitsd.engine.migration`) that the `shadows` phase, last in a step, schedules
under a per-step allowance less the prefill already in the step; the `flip` phase, first in a
step, moves them all to their shadows' blocks once every shadow has caught up. Requests that
have not started yet move to the new version at once.

Asynchronous scheduling (`SchedulerConfig.async_scheduling`): `schedule()` may run while the
last step it scheduled is still computing. Its phase 0 then counts that step's tokens as
computed and a token it samples as a pending output (`Request.num_pending_outputs`), so a
decode is scheduled for the position of a token the host has not seen (the runner reads it on
the device); `update_from_output` of that step then appends tokens without advancing again. A
request whose pending token is its last (max_tokens, the context) is not scheduled again.

What the model computes is the runner's business; stop strings and text are the detokenizer's;
the engine core (`core.py`) drives one `schedule()` -> execute -> `update_from_output()` cycle
per step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sitsd.config import SchedulerConfig, TiersConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.migration import Migration
from sitsd.engine.request import Request, RequestStatus
from sitsd.engine.swap_phases import SwapPhases
from sitsd.engine.tier_phases import TierPhases
from sitsd.engine.tiers import (
    BatchController,
    TierTracker,
    lower_tier_prefill_allowance,
)
from sitsd.engine.waiting_queue import FcfsQueue, TierQueue
from sitsd.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from sitsd.types import FinishReason, TokenLogprob

POLICIES = ("tiers", "fcfs")
_STEP_TIME_SMOOTHING = 0.2  # weight of the newest step in the step-time moving average


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one request from one step, and whether that finished it."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    weights_version: str = ""  # the version that computed them (a request may flip later)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked


class Scheduler(SwapPhases, TierPhases):
    """Owns the waiting queue and the running batch; the only writer of `Request` state."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
        tiers: TiersConfig | None = None,
        controller: BatchController | None = None,
        migration_tokens_per_step: int = 128,
    ) -> None:
        """Args:
        config: batch limits and the policy ("tiers" or "fcfs").
        kv_cache: the block allocator.
        max_model_len: context length; a request reaching it finishes with LENGTH.
        clock: monotonic seconds; the same clock as requests' arrival times.
        tiers: the tiers' targets and limits (default: the SITS table).
        controller: the batch controller of the tiers policy (default: the built-in P99 one).
        migration_tokens_per_step: the most tokens migration shadows compute in one step.
        """
        if config.policy not in POLICIES:
            raise ValueError(f"scheduling policy must be one of {POLICIES}, got {config.policy!r}")
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self._now = clock
        self.tiers_config = tiers or TiersConfig()
        self.tiered = config.policy == "tiers"
        if self.tiered and controller is None:
            from sitsd.plugins.p99_caps import P99BatchController

            controller = P99BatchController(self.tiers_config, config.max_num_seqs)
        self.tracker = TierTracker(
            self.tiers_config, config.max_num_seqs, controller if self.tiered else None
        )
        self.requests: dict[str, Request] = {}
        self.waiting: FcfsQueue | TierQueue = (
            TierQueue(self._queue_key) if self.tiered else FcfsQueue()
        )
        self.running: list[Request] = []
        self.num_preemptions = 0
        self.step_time_s = 0.0  # moving average of schedule() -> update_from_output()
        self._step_started: float | None = None
        # Told to the runner with the next SchedulerOutput, so it can drop their state.
        self._finished_req_ids: set[str] = set()
        self._preempted_req_ids: set[str] = set()  # preempted between steps (swap restarts)
        self.migration: Migration | None = None  # the migrate policy at work
        self.last_migration: Migration | None = None  # the one that completed last, for the core
        self.migration_tokens_per_step = migration_tokens_per_step
        self._lower_prefill: int | None = None  # this step's lower-tier prompt allowance
        # Asynchronous scheduling: the last scheduled step whose output is not in yet.
        self._ahead: SchedulerOutput | None = None

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already scheduled")
        self.requests[request.req_id] = request
        self.waiting.push(request)

    def finish_request(self, req_id: str, reason: FinishReason) -> Request | None:
        """Finish a live request (abort, stop string, error): free its blocks. None if unknown."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request, reason)
        return request

    def has_work(self) -> bool:
        # A pending migration completes at the start of a step, even one with nothing to run.
        return bool(self.waiting or self.running or self.migration is not None)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. See the module docstring for the rules."""
        now = self._step_started = self._now()
        out = SchedulerOutput(
            finished_req_ids=self._finished_req_ids, preempted_req_ids=self._preempted_req_ids
        )
        self._finished_req_ids, self._preempted_req_ids = set(), set()
        if self._ahead is not None:
            self._apply_ahead(self._ahead)  # phase 0: the step still running counts as done
        if self.migration is not None and self.migration.ready:
            self._flip_migration(out)  # phase 0: migrated requests take their shadows' KV
        self.tracker.refresh(now)  # phase 1: P99 estimates and, with tiers, caps
        if self.tiered:
            self.running.sort(key=lambda r: r.tier.rank)  # stable: oldest first within a tier
            self._lower_prefill = lower_tier_prefill_allowance(
                self.running, self.waiting, self.tiers_config.gold_step_tokens
            )
        preempted = self._schedule_running(out)  # phase 2
        # Not after a preemption: the freed blocks went to running requests, and admitting now
        # would thrash.
        if not preempted:
            if self.tiered:
                self._admit_by_tier(out)  # phase 3
            else:
                self._admit_fcfs(out)
            if self.migration is not None:
                self._schedule_shadows(out)  # phase 4: migration shadows, in what is left
        if out.is_empty:
            # Not launched: the runner hears of these with the next step that runs.
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

    def _budget(self, out: SchedulerOutput) -> int:
        return self.config.max_num_batched_tokens - out.total_num_scheduled_tokens

    def _schedule_running(self, out: SchedulerOutput) -> bool:
        """Running requests in list order; preempt from the end when blocks run out."""
        preempted = False
        i = 0
        while i < len(self.running) and self._budget(out) > 0:
            request = self.running[i]
            left = request.num_tokens + request.num_pending_outputs - request.num_computed_tokens
            num_new = self._allowed(request, min(left, self._budget(out)))
            if num_new == 0 or self._finishes_pending(request):
                # A lower-tier prompt chunk left for a step without gold's, or a request whose
                # pending token is its last.
                i += 1
                continue
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running[-1]
                self._preempt(victim, out)
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

    def _admit_fcfs(self, out: SchedulerOutput) -> None:
        """Admit the queue's head while budget, batch slots and blocks last."""
        while (
            self.waiting and self._budget(out) > 0 and len(self.running) < self.config.max_num_seqs
        ):
            if self._admit(self.waiting.peek(), out) is None:
                break

    def _admit(self, request: Request, out: SchedulerOutput) -> int | None:
        """Move a waiting request into the batch; None if its first chunk's blocks don't fit."""
        if self._budget(out) <= 0:
            return None
        computed_blocks = self.kv_cache.get_computed_blocks(request)
        num_hit = len(computed_blocks) * self.kv_cache.block_size
        num_new = self._allowed(request, min(request.num_tokens - num_hit, self._budget(out)))
        if num_new == 0:
            return None
        new_block_ids = self.kv_cache.allocate_slots(request, num_new, computed_blocks)
        if new_block_ids is None:
            return None
        self.waiting.remove(request)
        if request.num_cached_tokens < 0:  # first admission: count the prefix-cache lookup
            request.num_cached_tokens = num_hit
            self.kv_cache.record_lookup(request.num_prompt_tokens, num_hit)
            request.first_scheduled_time = self._now()
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

    @staticmethod
    def _unschedule(request: Request, out: SchedulerOutput) -> None:
        """Take a request scheduled earlier in this step back out of `out`."""
        Scheduler._unschedule_id(request.req_id, out)

    @staticmethod
    def _unschedule_id(req_id: str, out: SchedulerOutput) -> None:
        num = out.num_scheduled_tokens.pop(req_id, 0)
        out.total_num_scheduled_tokens -= num
        out.cached_reqs = [c for c in out.cached_reqs if c.req_id != req_id]
        out.new_reqs = [n for n in out.new_reqs if n.req_id != req_id]

    def _take_back(self, request: Request, out: SchedulerOutput | None) -> None:
        """Free a running request's blocks and queue it to be recomputed (its place kept)."""
        self.running.remove(request)
        self.kv_cache.free(request)
        if self.migration is not None and request.req_id in self.migration.shadows:
            self._drop_shadow(request, out)
            request.weights_version = self.migration.to_version  # recomputed on the new ones
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        self.waiting.push_preempted(request)
        if out is None:
            self._preempted_req_ids.add(request.req_id)
        else:
            out.preempted_req_ids.add(request.req_id)

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self._take_back(request, out)
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.tracker.num_preempted[request.tier] += 1
        # Block-pressure victims come from the end of `running`, which this step has not
        # scheduled yet; tier victims scheduled already are taken out by `_unschedule`.

    def _count(self, out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.num_scheduled_tokens[request.req_id] = num_new
        out.total_num_scheduled_tokens += num_new
        self._charge_allowance(request, num_new)

    # ---------------------------------------------------------------------------- the update

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[TokenUpdate]:
        """Advance computed tokens, append sampled tokens, finish what hit a stop condition."""
        if self.migration is not None:
            self.migration.advance(sched_out, self.kv_cache)
        if self._ahead is sched_out:
            self._ahead = None  # updated before anything was scheduled after it
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                if not sched_out.applied_ahead:
                    request.num_computed_tokens += num_tokens
                self.kv_cache.cache_full_blocks(request)
        now = self._now()
        if self._step_started is not None:
            elapsed = now - self._step_started
            a = _STEP_TIME_SMOOTHING if self.step_time_s else 1.0
            self.step_time_s += a * (elapsed - self.step_time_s)
        updates = []
        logprobs = runner_out.logprobs or [None] * len(runner_out.req_ids)
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
            version = request.weights_version
            if reason is not None:
                self.finish_request(req_id, reason)
            accepted_logprobs = token_logprobs[: len(accepted)] if token_logprobs else None
            updates.append(TokenUpdate(request, accepted, reason, version, accepted_logprobs))
        return updates

    def _finishes_pending(self, request: Request) -> bool:
        """Its pending output is its last token (max_tokens or the context): nothing to add."""
        if not request.num_pending_outputs:
            return False
        return (
            request.num_output_tokens + request.num_pending_outputs >= request.params.max_tokens
            or request.num_tokens + request.num_pending_outputs >= self.max_model_len
        )

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

    def _release(self, request: Request, reason: FinishReason) -> None:
        self.kv_cache.free(request)
        if self.migration is not None:
            self._drop_shadow(request, None)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_req_ids.add(request.req_id)

    def expired_req_ids(self, now: float) -> list[str]:
        """Live requests whose deadline has passed."""
        return [
            r.req_id for r in self.requests.values() if r.deadline is not None and r.deadline <= now
        ]
