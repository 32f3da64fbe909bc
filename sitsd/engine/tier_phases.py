"""The scheduler's SLA-tier phases: admission by tier, preemption by gold, gold steps, and
admission control.

`TierPhases` is part of `Scheduler` (a mixin, in its own file like `SwapPhases`: the scheduler
stays the single writer of request state). With the `tiers` policy it adds the admission phase
(waiting requests by queue key with aging, capped tiers skipped, gold preempting bronze then
silver), the gold-step allowance that cuts lower tiers' prompt chunks while gold has prompt
tokens to compute, and the checks the engine core makes outside a step: shedding
(`overdue_requests`), refusal at arrival (`admission_refusal`) and the tier statistics. The
rules are in `sitsd.engine.tiers`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from sitsd.engine.admission import (
    QueueSnapshot,
    refusal_reason,
    running_entry,
    waiting_entry,
)
from sitsd.engine.request import Request
from sitsd.engine.tiers import TIER_ORDER, TierTracker, queue_key
from sitsd.outputs import SchedulerOutput, TierStats
from sitsd.types import Tier

if TYPE_CHECKING:
    from sitsd.config import SchedulerConfig, TiersConfig
    from sitsd.engine.kv_cache_manager import KVCacheManager
    from sitsd.engine.waiting_queue import FcfsQueue, TierQueue


class TierPhases:
    """Scheduler methods for the SLA tiers (see the module docstring)."""

    if TYPE_CHECKING:  # the Scheduler state these methods work on
        config: SchedulerConfig
        tiers_config: TiersConfig
        tiered: bool
        tracker: TierTracker
        running: list[Request]
        waiting: FcfsQueue | TierQueue
        kv_cache: KVCacheManager
        step_time_s: float
        _lower_prefill: int | None
        _now: Callable[[], float]

        def _budget(self, out: SchedulerOutput) -> int: ...
        def _admit(self, request: Request, out: SchedulerOutput) -> int | None: ...
        def _unschedule(self, request: Request, out: SchedulerOutput) -> None: ...
        def _preempt(self, request: Request, out: SchedulerOutput) -> None: ...

    def _queue_key(self, request: Request) -> float:
        return queue_key(request.arrival_time, self.tiers_config.tier(request.tier.value))

    # --------------------------------------------------------------------- admission by tier

    def _admit_by_tier(self, out: SchedulerOutput) -> None:
        """Admit by queue deadline, skipping capped tiers; gold may preempt lower tiers."""
        blocked = False
        for request in self.waiting:
            no_budget = self._budget(out) <= 0
            if (blocked or no_budget) and request.tier is not Tier.GOLD:
                continue
            if self._tier_count(request.tier) >= self.tracker.caps[request.tier]:
                continue  # a capped tier waits for its own requests to finish
            num_new = None
            if not no_budget and len(self.running) < self.config.max_num_seqs:
                num_new = self._admit(request, out)
            if num_new is None and request.tier is Tier.GOLD:
                # Victims scheduled earlier in this step give their tokens back, too.
                num_new = self._admit_by_preemption(request, out)
            if num_new is None:
                blocked = True

    def _tier_count(self, tier: Tier) -> int:
        return sum(1 for r in self.running if r.tier is tier)

    def _admit_by_preemption(self, request: Request, out: SchedulerOutput) -> int | None:
        """Preempt lower-tier running work to make room for `request`; None if it can't."""
        victims = self._pick_victims(request, out)
        if not victims:
            return None
        for victim in victims:
            self._unschedule(victim, out)
            self._preempt(victim, out)
        if len(self.running) >= self.config.max_num_seqs:
            return None
        return self._admit(request, out)

    def _pick_victims(self, request: Request, out: SchedulerOutput) -> list[Request]:
        """The fewest lower-tier requests whose slot and blocks let `request` in (or none)."""
        new_ids = {n.req_id for n in out.new_reqs}  # admitted this step: never undone
        candidates = [
            r
            for r in reversed(self.running)  # newest first within a tier
            if r.tier.rank > request.tier.rank
            and r.num_preemptions < self.tiers_config.max_tier_preemptions
            and r.req_id not in new_ids
        ]
        candidates.sort(key=lambda r: -r.tier.rank)  # bronze, then silver
        kv = self.kv_cache
        num_new = min(request.num_tokens, max(self._budget(out), 1))
        need_slots = len(self.running) + 1 - self.config.max_num_seqs
        need_blocks = kv.blocks_needed(num_new) - kv.pool.num_free_blocks
        victims = []
        for victim in candidates:
            if need_slots <= 0 and need_blocks <= 0:
                break
            victims.append(victim)
            need_slots -= 1
            need_blocks -= kv.num_private_blocks(victim)
        return victims if need_slots <= 0 and need_blocks <= 0 else []

    def _allowed(self, request: Request, num_new: int) -> int:
        """`num_new` cut to this step's lower-tier prompt allowance where that applies."""
        if self._lower_prefill is None or request.tier is Tier.GOLD or num_new <= 1:
            return num_new
        return min(num_new, self._lower_prefill)

    def _charge_allowance(self, request: Request, num_new: int) -> None:
        """Count a scheduled chunk against this step's lower-tier prompt allowance."""
        if self._lower_prefill is not None and request.tier is not Tier.GOLD and num_new > 1:
            self._lower_prefill = max(0, self._lower_prefill - num_new)

    # ---------------------------------------------------------- admission control and status

    def overdue_requests(self, now: float) -> list[tuple[str, str]]:
        """(req_id, reason) of waiting requests without a first token yet that have waited
        past their tier's maximum queue wait since arrival (tiers policy): the engine drops them
        (RESOURCE_EXHAUSTED). Requests that streamed tokens are never dropped."""
        if not self.tiered:
            return []
        overdue = []
        for request in self.waiting:
            limit = self.tiers_config.tier(request.tier.value).max_queue_wait_s
            waited = now - request.arrival_time
            if request.num_output_tokens == 0 and waited > limit:
                self.tracker.num_shed[request.tier] += 1
                overdue.append(
                    (
                        request.req_id,
                        f"overloaded: waited {waited * 1000:.0f} ms in the queue, over the "
                        f"{request.tier.value} tier's {limit * 1000:.0f} ms; retry later",
                    )
                )
        return overdue

    def admission_refusal(self, request: Request) -> str | None:
        """Why `request` (not added yet) must be refused at once, or None to admit it.

        Refused: its expected queue wait (`sitsd.engine.admission`) exceeds its tier's maximum.
        """
        if not self.tiered or not self.tiers_config.admission_control:
            return None
        limit = self.tiers_config.tier(request.tier.value).max_queue_wait_s
        reason = refusal_reason(
            self.queue_snapshot(), request.tier, self._queue_key(request), limit
        )
        if reason is not None:
            self.tracker.num_refused[request.tier] += 1
        return reason

    def queue_snapshot(self) -> QueueSnapshot:
        """The queue as admission control sees it (plain data, safe to hand to other threads)."""
        return QueueSnapshot(
            enabled=self.tiered and self.tiers_config.admission_control,
            step_time_s=self.step_time_s,
            token_budget=self.config.max_num_batched_tokens,
            max_num_seqs=self.config.max_num_seqs,
            waiting=tuple(waiting_entry(r, self._queue_key(r)) for r in self.waiting),
            running=tuple(
                running_entry(r, self.tiers_config.max_tier_preemptions) for r in self.running
            ),
            caps=dict(self.tracker.caps),
        )

    def tier_stats(self) -> tuple[TierStats, ...]:
        """Targets, caps, P99s (as of the last control interval) and counters, gold first."""
        running = {t: self._tier_count(t) for t in TIER_ORDER}
        waiting = {t: sum(1 for r in self.waiting if r.tier is t) for t in TIER_ORDER}
        caps = None if self.tiered else self.config.max_num_seqs
        return self.tracker.stats(running, waiting, fixed_cap=caps)
