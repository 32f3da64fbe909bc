"""The SLA-tier scheduling policy: tier order with aging, caps, gold steps, gold preemption, and
admission control.

`TierPolicy` answers the scheduler's questions (`sitsd.engine.policy`) for the `tiers`
policy:

    order       waiting requests by queue key (arrival + the tier's aging offset)
    caps        once per control interval the batch controller turns the tiers' live P99s into
                per-tier caps; running requests go gold, silver, bronze (oldest first within
                a tier), so block pressure preempts the newest bronze work first
    chunks      while gold has prompt tokens to compute, lower tiers' prompt chunks are cut to
                what keeps the step within `gold_step_tokens`
    admission   by queue key; a tier at its cap is skipped; a gold request that finds no slot
                or blocks preempts running bronze, then silver work (newest first, each request
                at most `max_tier_preemptions` times); once a request is blocked, only gold may
                still be admitted behind it
and, outside a step: refusing a request whose expected queue wait (`sitsd.engine.admission`)
exceeds its tier's maximum, and shedding a waiting request with no token yet once it has
waited past it. The rules' numbers and the plugin loading are `sitsd.engine.tiers`'.
"""

from __future__ import annotations

from collections.abc import Mapping

from sitsd.config import TiersConfig
from sitsd.engine.admission import (
    QueueSnapshot,
    Refusal,
    refusal_reason,
    running_entry,
    waiting_entry,
    what_to_change,
)
from sitsd.engine.batch import Batch, WaitingQueue
from sitsd.engine.request import Request
from sitsd.engine.tiers import (
    TierTracker,
    load_batch_controller,
    lower_tier_prefill_allowance,
    queue_key,
)
from sitsd.engine.waiting_queue import TierQueue
from sitsd.outputs import PreemptionReason, SchedulerOutput
from sitsd.plugins.interface import BatchController, TierEstimate
from sitsd.types import Tier


class TierPolicy:
    """The `tiers` policy; see the module docstring."""

    name = "tiers"
    uses_caps = True

    def __init__(
        self,
        config: TiersConfig,
        tracker: TierTracker,
        max_num_seqs: int,
        controller: BatchController | None = None,
    ) -> None:
        """Args:
        config: the tiers' targets and limits.
        tracker: the scheduler's per-tier statistics; this policy sets its caps.
        max_num_seqs: the batch size.
        controller: sets the caps (default: the one `config.controller` names).
        """
        self.config = config
        self.tracker = tracker
        self.controller = controller or load_batch_controller(config, max_num_seqs)
        self._lower_prefill: int | None = None  # this step's lower-tier prompt allowance

    def _queue_key(self, request: Request) -> float:
        return queue_key(request.arrival_time, self.config.tier(request.tier.value))

    # ------------------------------------------------------------------------------- phases

    def new_queue(self) -> WaitingQueue:
        return TierQueue(self._queue_key)

    def start_step(
        self, batch: Batch, now: float, estimates: Mapping[Tier, TierEstimate] | None
    ) -> None:
        if estimates is not None:  # a control interval has passed
            self.tracker.set_caps(self.controller.update(estimates, now))
        batch.running.sort(key=lambda r: r.tier.rank)  # stable: oldest first within a tier
        self._lower_prefill = lower_tier_prefill_allowance(
            batch.running, batch.waiting, self.config.gold_step_tokens
        )

    def allowed(self, request: Request, num_new: int) -> int:
        """`num_new` cut to this step's lower-tier prompt allowance where that applies."""
        if self._lower_prefill is None or request.tier is Tier.GOLD or num_new <= 1:
            return num_new
        return min(num_new, self._lower_prefill)

    def charge(self, request: Request, num_new: int) -> None:
        """Count a scheduled chunk against this step's lower-tier prompt allowance."""
        if self._lower_prefill is not None and request.tier is not Tier.GOLD and num_new > 1:
            self._lower_prefill = max(0, self._lower_prefill - num_new)

    def admit(self, batch: Batch, out: SchedulerOutput) -> None:
        """Admit by queue key, skipping capped tiers; gold may preempt lower tiers."""
        blocked = False
        for request in batch.waiting:
            no_budget = batch.budget(out) <= 0
            if (blocked or no_budget) and request.tier is not Tier.GOLD:
                continue
            if self._tier_count(batch, request.tier) >= self.tracker.caps[request.tier]:
                continue  # a capped tier waits for its own requests to finish
            if batch.kept_out(request):
                continue  # a swap's: nothing is preempted for it, the others go ahead
            num_new = None
            if not no_budget and len(batch.running) < batch.config.max_num_seqs:
                num_new = batch.try_admit(request, out)
            if num_new is None and request.tier is Tier.GOLD:
                # Victims scheduled earlier in this step give their tokens back, too.
                num_new = self._admit_by_preemption(batch, request, out)
            if num_new is None:
                blocked = True

    # --------------------------------------------------------------------------- preemption

    def _admit_by_preemption(
        self, batch: Batch, request: Request, out: SchedulerOutput
    ) -> int | None:
        """Preempt lower-tier running work to make room for `request`; None if it can't."""
        victims = self._victims(batch, request, out)
        if not victims:
            return None
        for victim in victims:
            batch.unschedule(victim.req_id, out)
            batch.preempt(victim, out, PreemptionReason.TIER, request)
        if len(batch.running) >= batch.config.max_num_seqs:
            return None
        return batch.try_admit(request, out)

    def _victims(self, batch: Batch, request: Request, out: SchedulerOutput) -> list[Request]:
        """The fewest lower-tier requests whose slot and blocks let `request` in (or none)."""
        new_ids = {n.req_id for n in out.new_reqs}  # admitted this step: never undone
        candidates = [
            r
            for r in reversed(batch.running)  # newest first within a tier
            if r.tier.rank > request.tier.rank
            and r.num_preemptions < self.config.max_tier_preemptions
            and r.req_id not in new_ids
        ]
        candidates.sort(key=lambda r: -r.tier.rank)  # bronze, then silver
        kv = batch.kv_cache
        num_new = min(request.num_tokens, max(batch.budget(out), 1))
        need_slots = len(batch.running) + 1 - batch.config.max_num_seqs
        need_blocks = kv.blocks_needed(num_new) - kv.pool.num_free_blocks
        victims = []
        for victim in candidates:
            if need_slots <= 0 and need_blocks <= 0:
                break
            victims.append(victim)
            need_slots -= 1
            need_blocks -= kv.num_private_blocks(victim)
        return victims if need_slots <= 0 and need_blocks <= 0 else []

    @staticmethod
    def _tier_count(batch: Batch, tier: Tier) -> int:
        return sum(1 for r in batch.running if r.tier is tier)

    # ---------------------------------------------------------------------- admission control

    def refusal(self, request: Request, batch: Batch, step_time_s: float) -> Refusal | None:
        """Why `request` (not added yet) must be refused at once, or None to admit it: its
        expected queue wait exceeds its tier's maximum."""
        if not self.config.admission_control:
            return None
        limit = self.config.tier(request.tier.value).max_queue_wait_s
        snapshot = self.queue_snapshot(batch, step_time_s)
        reason = refusal_reason(snapshot, request.tier, self._queue_key(request), limit)
        if reason is not None:
            self.tracker.num_refused[request.tier] += 1
        return reason

    def early_refusal(
        self, snapshot: QueueSnapshot, tier: Tier, arrival_time: float
    ) -> Refusal | None:
        """`refusal` on the API's thread, against the queue as of the last engine turn."""
        if not snapshot.enabled:
            return None
        tier_config = self.config.tier(tier.value)
        key = queue_key(arrival_time, tier_config)
        return refusal_reason(snapshot, tier, key, tier_config.max_queue_wait_s)

    def overdue(self, batch: Batch, now: float) -> list[tuple[str, str]]:
        """(req_id, reason) of waiting requests without a first token yet that have waited
        past their tier's maximum queue wait since arrival: the engine drops them
        (RESOURCE_EXHAUSTED). Requests that streamed tokens are never dropped."""
        overdue = []
        for request in batch.waiting:
            limit = self.config.tier(request.tier.value).max_queue_wait_s
            waited = now - request.arrival_time
            if request.num_output_tokens == 0 and waited > limit:
                self.tracker.num_shed[request.tier] += 1
                overdue.append(
                    (
                        request.req_id,
                        f"overloaded: waited {waited * 1000:.0f} ms in the queue, over the "
                        f"{request.tier.value} tier's {limit * 1000:.0f} ms; "
                        f"{what_to_change(request.tier)}",
                    )
                )
        return overdue

    def queue_snapshot(self, batch: Batch, step_time_s: float) -> QueueSnapshot:
        """The queue as admission control sees it (plain data, safe to hand to other threads)."""
        return QueueSnapshot(
            enabled=self.config.admission_control,
            step_time_s=step_time_s,
            token_budget=batch.config.max_num_batched_tokens,
            max_num_seqs=batch.config.max_num_seqs,
            waiting=tuple(waiting_entry(r, self._queue_key(r)) for r in batch.waiting),
            running=tuple(
                running_entry(r, self.config.max_tier_preemptions) for r in batch.running
            ),
            caps=dict(self.tracker.caps),
        )
