"""Scheduling policies: what the scheduler asks, phase by phase, and the FCFS answers.

The scheduler (`sitsd.engine.scheduler`) keeps the one rule of continuous batching: each
step, a request's computed tokens catch up with its known tokens under the step's token
budget, and a running request that finds no block preempts from the end of the batch. A
policy answers the questions that rule leaves open, at named phases of `schedule()`:

    order       `new_queue()`: the order waiting requests line up in
    caps        `start_step(batch, ...)`: batch caps, the order of the running requests (whose end
                block pressure preempts first), this step's prompt-chunk allowance
    chunks      `allowed(request, num_new)` / `charge(...)`: tokens a request may compute now
    admission   `admit(batch, out)`: which waiting requests enter the batch, and which running
                ones are preempted to make room (the preemption victims)
and outside a step, for admission control: `refusal` (a new request, on the engine thread),
`early_refusal` (the same on the API's thread, against the last `queue_snapshot`), `overdue`
(requests to shed).

`FcfsPolicy` is arrival order, no caps, no admission control; the SLA tiers are
`sitsd.engine.tier_policy.TierPolicy`. `make_policy` builds the configured one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Protocol

from sitsd.config import SchedulerConfig, TiersConfig
from sitsd.engine.admission import QueueSnapshot, Refusal
from sitsd.engine.batch import Batch, WaitingQueue
from sitsd.engine.request import Request
from sitsd.engine.tiers import TierTracker
from sitsd.engine.waiting_queue import FcfsQueue
from sitsd.outputs import SchedulerOutput
from sitsd.plugins.interface import BatchController, TierEstimate
from sitsd.types import Tier

POLICIES = ("tiers", "fcfs")


class SchedulingPolicy(Protocol):
    """The scheduler's questions; see the module docstring for when each is asked."""

    name: str  # "fcfs" or "tiers"
    uses_caps: bool  # the tier statistics report the controller's caps (else the batch size)

    def new_queue(self) -> WaitingQueue: ...

    def start_step(
        self, batch: Batch, now: float, estimates: Mapping[Tier, TierEstimate] | None
    ) -> None:
        """`estimates`: the tiers' live P99s when a control interval has passed, else None."""
        ...

    def allowed(self, request: Request, num_new: int) -> int: ...

    def charge(self, request: Request, num_new: int) -> None: ...

    def admit(self, batch: Batch, out: SchedulerOutput) -> None: ...

    def refusal(self, request: Request, batch: Batch, step_time_s: float) -> Refusal | None: ...

    def early_refusal(
        self, snapshot: QueueSnapshot, tier: Tier, arrival_time: float
    ) -> Refusal | None:
        """`refusal` on another thread, against a snapshot of the last engine turn."""
        ...

    def overdue(self, batch: Batch, now: float) -> list[tuple[str, str]]: ...

    def queue_snapshot(self, batch: Batch, step_time_s: float) -> QueueSnapshot: ...


class FcfsPolicy:
    """Arrival order; the queue's head is admitted while budget, slots and blocks last (one a
    swap keeps out of the step is passed over)."""

    name = "fcfs"
    uses_caps = False

    def new_queue(self) -> WaitingQueue:
        return FcfsQueue()

    def start_step(
        self, batch: Batch, now: float, estimates: Mapping[Tier, TierEstimate] | None
    ) -> None:
        pass  # running requests stay in admission order: block pressure preempts the newest

    def allowed(self, request: Request, num_new: int) -> int:
        return num_new

    def charge(self, request: Request, num_new: int) -> None:
        pass

    def admit(self, batch: Batch, out: SchedulerOutput) -> None:
        for request in batch.waiting:
            if batch.budget(out) <= 0 or len(batch.running) >= batch.config.max_num_seqs:
                return
            if batch.kept_out(request):
                continue  # a swap's: the arrivals behind it go ahead as in a steady load
            if batch.try_admit(request, out) is None:
                return

    def refusal(self, request: Request, batch: Batch, step_time_s: float) -> Refusal | None:
        return None

    def early_refusal(
        self, snapshot: QueueSnapshot, tier: Tier, arrival_time: float
    ) -> Refusal | None:
        return None

    def overdue(self, batch: Batch, now: float) -> list[tuple[str, str]]:
        return []

    def queue_snapshot(self, batch: Batch, step_time_s: float) -> QueueSnapshot:
        return QueueSnapshot()  # admission control is off


def make_policy(
    config: SchedulerConfig,
    tiers: TiersConfig,
    tracker: TierTracker,
    controller: BatchController | None = None,
) -> SchedulingPolicy:
    """The policy `config.policy` names; the tiers policy with `controller` (default: the one
    the tiers file names, `sitsd.engine.tiers.load_batch_controller`).

    Raises:
        ValueError: an unknown policy, or no batch controller of that name.
    """
    from sitsd.engine.tier_policy import TierPolicy  # the one policy that needs the plugins

    if config.policy == "fcfs":
        return FcfsPolicy()
    if config.policy == "tiers":
        return TierPolicy(tiers, tracker, config.max_num_seqs, controller)
    raise ValueError(f"scheduling policy must be one of {POLICIES}, got {config.policy!r}")
