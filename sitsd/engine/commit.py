"""Swap commits on the engine thread: flip the active weight slot between two steps.

`CommitControl` handles a `SwapCommand` taken from the engine inbox, between two steps:

    two slots: activate the standby slot holding the version (an index flip: no copy)
    one slot:  copy the version over the only slot in place (the command's `copy_in_place`)
    then:      `Scheduler.switch_weights(version, policy)`: new requests run on the version;
               in-flight ones drain, restart or migrate

and reports `SwapEvent`s through the command's `on_event`: "migrating" (with progress after
each step) while shadows catch up, then "committed" (or "failed"). A migration commits at the
start of the step in which every shadow has caught up (the scheduler's flip phase). The event
carries the flip's own time and the serving pause: the gap between the end of the last step
before the flip and the start of the first step after it (flip included), and, to compare it
with, the median gap between two busy steps before it.

Which version goes in which slot, and validating it, is `sitsd.weights.swap`'s business.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from sitsd.engine.messages import SwapCommand
from sitsd.engine.observer import EngineObserver
from sitsd.engine.scheduler import Scheduler
from sitsd.engine.swap_phases import VersionSwitch
from sitsd.outputs import SchedulerOutput

log = logging.getLogger(__name__)

_GAP_WINDOW = 64  # step gaps remembered, for the typical gap a commit's pause compares with
_IDLE_GAP_S = 0.1  # a longer gap between steps is the engine waiting for work


class WeightSlotsLike(Protocol):
    """What the engine needs of the runner's weight slots (`sitsd.runtime.weight_slots`)."""

    versions: list[str | None]
    active: int

    @property
    def num_slots(self) -> int: ...

    @property
    def standby(self) -> int | None: ...

    @property
    def active_version(self) -> str: ...

    def index_of(self, version: str) -> int | None: ...

    def activate(self, version: str) -> None: ...

    def release(self, index: int) -> None: ...

    def fill(self, index: int, version: str) -> None: ...


@dataclass(frozen=True)
class SwapEvent:
    """Progress of one commit, as the engine thread reports it."""

    kind: str  # "migrating", "committed" or "failed"
    version: str  # the version being committed
    policy: str  # the policy applied (restart when one slot forced it)
    from_version: str = ""  # the version in-flight requests ran on
    num_migrating: int = 0  # requests whose KV is being recomputed
    num_caught_up: int = 0  # of those, shadows caught up with their request
    num_restarted: int = 0  # requests recomputed from their tokens on the new weights
    num_draining: int = 0  # requests left to finish on the old weights
    flip_s: float = 0.0  # the flip itself (the in-place copy with one slot)
    pause_s: float = 0.0  # longest time between two steps around the flip
    typical_gap_s: float = 0.0  # the median time between two busy steps before the commit
    message: str = ""  # why it failed


@dataclass
class _InFlight:
    command: SwapCommand
    policy: str
    switch: VersionSwitch
    flip_s: float = 0.0
    gap_s: float = 0.0  # the step gap the flip happened in
    flipped: bool = False  # the flip is done; waiting for the next step to measure the pause


class CommitControl:
    """Handles swap commands for the engine core; engine thread only."""

    def __init__(
        self,
        scheduler: Scheduler,
        slots: WeightSlotsLike,
        observer: EngineObserver,
        refresh_status: Callable[[], None] = lambda: None,
    ) -> None:
        """Args:
        scheduler: applies the policy to the requests in flight.
        slots: the runner's weight slots.
        observer: told of each migrated request.
        refresh_status: called before each event, so the engine's status shows its effect.
        """
        self.scheduler = scheduler
        self.slots = slots
        self.observer = observer
        self._refresh_status = refresh_status
        self._inflight: _InFlight | None = None
        self._last_step_end = time.monotonic()
        self._gaps: deque[float] = deque(maxlen=_GAP_WINDOW)  # recent gaps between busy steps

    @property
    def busy(self) -> bool:
        """A commit is in progress (a migration catching up, or a pause being measured)."""
        return self._inflight is not None

    def handle(self, command: SwapCommand) -> None:
        """Start committing `command.version` (between two steps)."""
        if self._inflight is not None:
            self._fail(command, f"a commit of {self._inflight.command.version} is in progress")
            return
        started = time.monotonic()
        policy = command.policy
        try:
            if command.copy_in_place is not None:
                self.slots.release(self.slots.active)
                command.copy_in_place()
                self.slots.fill(self.slots.active, command.version)
                policy = "restart"  # the old weights are gone: in-flight KV is recomputed
            elif self.slots.index_of(command.version) is None:
                raise ValueError(f"version {command.version} is not in a weight slot")
            self.slots.activate(command.version)
            switch = self.scheduler.switch_weights(command.version, policy)
        except Exception as exc:
            log.exception("commit of %s failed", command.version)
            self._fail(command, f"{type(exc).__name__}: {exc}")
            return
        inflight = _InFlight(command, policy, switch, flip_s=time.monotonic() - started)
        self._inflight = inflight
        if self.scheduler.migration is None:  # drain, restart, or nothing to migrate
            inflight.flipped = True
            if not self.scheduler.has_work():
                self._committed(inflight, pause_s=inflight.flip_s)
        else:
            self._emit(inflight, "migrating")

    def on_step_start(self, now: float) -> None:
        """Before `schedule()`: a flip waiting for its pause to be measured reports it."""
        if now - self._last_step_end < _IDLE_GAP_S:
            self._gaps.append(now - self._last_step_end)
        inflight = self._inflight
        if inflight is not None and inflight.flipped:
            self._committed(inflight, pause_s=max(now - self._last_step_end, inflight.flip_s))

    def after_schedule(self, sched_out: SchedulerOutput, started: float) -> None:
        """After `schedule()`: a migration that flipped in it commits (pause: gap + flip)."""
        inflight = self._inflight
        if inflight is None or sched_out.committed_version is None:
            return
        migration = self.scheduler.last_migration
        assert migration is not None
        now = time.monotonic()
        for entry in migration.shadows.values():
            self.observer.on_request_migrated(
                entry.original, entry.started, now, migration.from_version, migration.to_version
            )
        inflight.flip_s = migration.flip_s
        gap = started - self._last_step_end
        self._committed(
            inflight,
            pause_s=gap + migration.flip_s,
            num_restarted=inflight.switch.num_restarted + migration.num_restarted,
        )

    def after_step(self, now: float) -> None:
        """After a step: remember when it ended; report migration progress."""
        self._last_step_end = now
        inflight = self._inflight
        migration = self.scheduler.migration
        if inflight is not None and migration is not None and not inflight.flipped:
            self._emit(inflight, "migrating")

    def when_idle(self) -> None:
        """No step will run: a flip waiting for the next step reports its own time as pause."""
        inflight = self._inflight
        if inflight is not None and inflight.flipped:
            self._committed(inflight, pause_s=inflight.flip_s)

    # ------------------------------------------------------------------------------ internal

    def _committed(
        self, inflight: _InFlight, pause_s: float, num_restarted: int | None = None
    ) -> None:
        self._inflight = None
        caught_up = inflight.switch.num_migrating
        self._emit(inflight, "committed", caught_up, pause_s, num_restarted)

    def _emit(
        self,
        inflight: _InFlight,
        kind: str,
        num_caught_up: int | None = None,
        pause_s: float = 0.0,
        num_restarted: int | None = None,
    ) -> None:
        switch, migration = inflight.switch, self.scheduler.migration
        if num_caught_up is None:
            num_caught_up = migration.num_caught_up if migration is not None else 0
        event = SwapEvent(
            kind=kind,
            version=inflight.command.version,
            policy=inflight.policy,
            from_version=switch.from_version or "",
            num_migrating=switch.num_migrating,
            num_caught_up=num_caught_up,
            num_restarted=switch.num_restarted if num_restarted is None else num_restarted,
            num_draining=switch.num_draining,
            flip_s=inflight.flip_s,
            pause_s=pause_s,
            typical_gap_s=statistics.median(self._gaps) if self._gaps else 0.0,
        )
        self._send(inflight.command, event)

    def _fail(self, command: SwapCommand, message: str) -> None:
        self._send(command, SwapEvent("failed", command.version, command.policy, message=message))

    def _send(self, command: SwapCommand, event: SwapEvent) -> None:
        try:
            self._refresh_status()
            command.on_event(event)
        except Exception:  # the caller's problem; never the engine thread's
            log.exception("swap event callback failed")
