"""Admission control: how long would a new request wait in the queue, given what is ahead?

The engine thread publishes a `QueueSnapshot` after every step (plain, immutable data), so the
API's threads can refuse a request at once (`AsyncEngine.add_request`); the engine thread checks
again against its live queue when the request reaches it, which also counts requests that
arrived since the last snapshot. The estimate, in engine steps times the measured step time:

- prefill: the prompt tokens of the requests queued ahead of it (queue key not larger; for
  gold, only the lower-tier ones that fit in the free slots, since gold passes the others by
  preemption) are computed at `token_budget - num_running` tokens per step (decodes take one
  token each);
- batch slots: when the batch is full, the k-th slot frees when the running request with the
  k-th fewest remaining tokens (`max_tokens` - generated: pessimistic, EOS may come sooner)
  finishes; gold does not wait for slots it can take by preempting bronze or silver;
- the tier's batch cap: the same, over the running requests of its own tier;

and the wait is the largest of the three. What to do with the estimate (refuse when it exceeds
the tier's `max_queue_wait_s`) is the scheduler's decision. A refusal (`Refusal`) keeps what
it saw, and `QueuePlace` says where any request stood when it arrived: what telemetry reports
of the wait.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

from sitsd.engine.request import Request
from sitsd.types import TIER_ORDER, Tier


@dataclass(frozen=True, slots=True)
class WaitingEntry:
    key: float  # queue key (see `sitsd.engine.tiers.queue_key`)
    tier: Tier
    num_prefill_tokens: int  # tokens it must compute before its first token (pessimistic)


@dataclass(frozen=True, slots=True)
class RunningEntry:
    tier: Tier
    num_remaining_steps: int  # steps until it finishes at the latest
    preemptable_by_gold: bool  # a lower tier with preemptions to spare


@dataclass(frozen=True)
class QueueSnapshot:
    """The queue as admission control needs it; built by `Scheduler.queue_snapshot()`."""

    enabled: bool = False  # admission control on (tiers policy)
    step_time_s: float = 0.0  # recent engine step duration (moving average); 0 = unknown
    token_budget: int = 1  # tokens per step
    max_num_seqs: int = 1
    waiting: tuple[WaitingEntry, ...] = ()  # in queue order
    running: tuple[RunningEntry, ...] = ()
    caps: dict[Tier, int] = field(default_factory=dict)  # per-tier batch caps


@dataclass(frozen=True, slots=True)
class QueuePlace:
    """Where a request stood in the queue when it arrived: whom it waited behind."""

    position: int  # waiting requests ahead of it in queue order
    num_ahead: dict[Tier, int]  # of those, by tier
    num_running: int  # requests in the batch it waited to join

    @staticmethod
    def behind(ahead: Iterable[Tier], num_running: int) -> QueuePlace:
        """The place behind requests of these tiers (in queue order)."""
        num_ahead = dict.fromkeys(TIER_ORDER, 0)
        for tier in ahead:
            num_ahead[tier] += 1
        return QueuePlace(sum(num_ahead.values()), num_ahead, num_running)


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why admission control refused a request, and what it saw then."""

    message: str  # for the client (RESOURCE_EXHAUSTED, HTTP 429)
    expected_wait_s: float  # the queue wait it expected
    limit_s: float  # the tier's maximum queue wait
    place: QueuePlace  # where the request would have queued


def waiting_entry(request: Request, key: float) -> WaitingEntry:
    """A waiting request as admission control counts it (prefix-cache hits not assumed)."""
    return WaitingEntry(key, request.tier, request.num_tokens - max(request.num_cached_tokens, 0))


def running_entry(request: Request, max_tier_preemptions: int) -> RunningEntry:
    """A running request: steps until it ends at `max_tokens`, and whether gold may take it."""
    return RunningEntry(
        request.tier,
        max(1, request.params.max_tokens - request.num_output_tokens),
        request.tier is not Tier.GOLD and request.num_preemptions < max_tier_preemptions,
    )


def _steps_until_free(remaining: list[int], num_needed: int) -> float:
    """Steps until `num_needed` slots held by requests with these remaining steps free up."""
    if num_needed <= 0:
        return 0.0
    if not remaining:
        return math.inf  # nothing will free a slot (a tier capped at zero)
    remaining = sorted(remaining)
    rounds, index = divmod(num_needed - 1, len(remaining))
    # Past one slot per running request, slots turn over again at the median pace.
    return remaining[index] + rounds * remaining[len(remaining) // 2]


def expected_queue_wait(snapshot: QueueSnapshot, tier: Tier, key: float) -> float:
    """Seconds a request of `tier` with queue key `key` is expected to wait before it runs.

    0 while no step has been timed yet: admission control starts with the first measurement.
    """
    if snapshot.step_time_s <= 0:
        return 0.0
    ahead = [w for w in snapshot.waiting if w.key <= key]  # ties: the earlier one goes first
    running = snapshot.running
    free_slots = snapshot.max_num_seqs - len(running)
    if tier is Tier.GOLD:
        # Lower tiers ahead of gold (aged ones) take the free slots first; once the batch is
        # full they are blocked and gold passes them by preempting lower-tier work.
        lower = [w for w in ahead if w.tier is not Tier.GOLD][: max(0, free_slots)]
        ahead = [w for w in ahead if w.tier is Tier.GOLD] + lower
    per_step = max(1, snapshot.token_budget - len(running))
    prefill_steps = math.ceil(sum(w.num_prefill_tokens for w in ahead) / per_step)

    num_needed = len(ahead) + 1 - free_slots
    if tier is Tier.GOLD:
        num_needed -= sum(1 for r in running if r.preemptable_by_gold)
    slot_steps = _steps_until_free([r.num_remaining_steps for r in running], num_needed)

    mine = [r.num_remaining_steps for r in running if r.tier is tier]
    cap = snapshot.caps.get(tier, snapshot.max_num_seqs)
    num_needed_in_tier = sum(1 for w in ahead if w.tier is tier) + 1 - (cap - len(mine))
    cap_steps = _steps_until_free(mine, num_needed_in_tier)
    return max(prefill_steps, slot_steps, cap_steps) * snapshot.step_time_s


def refusal_reason(
    snapshot: QueueSnapshot, tier: Tier, key: float, limit_s: float
) -> Refusal | None:
    """The refusal when the expected wait exceeds `limit_s`, else None."""
    wait = expected_queue_wait(snapshot, tier, key)
    if wait <= limit_s:
        return None
    message = (
        f"overloaded: expected queue wait {wait * 1000:.0f} ms exceeds the {tier.value} "
        f"tier's {limit_s * 1000:.0f} ms; {what_to_change(tier)}"
    )
    ahead = (w.tier for w in snapshot.waiting if w.key <= key)
    return Refusal(message, wait, limit_s, QueuePlace.behind(ahead, len(snapshot.running)))


def what_to_change(tier: Tier) -> str:
    """The end of a refusal's message: what the client, or the operator, can do about it."""
    return (
        "retry later, send it at a tier that may wait longer, or raise "
        f"tiers.{tier.value}.max_queue_wait_ms in the daemon's --tiers file"
    )
