"""The swap controller: the engine thread's side of hot-swap, between two steps.

`SwapController` owns everything the engine does to weights versions; the weights subsystem
reaches it only through `sitsd.engine.swap_port.SwapPort`, whose calls run here:

    reserve_standby   release the standby slot to the stager once no request runs on it
    fill / release    the stager copied a version into it (or gave up on it); a version of
                      another structure (another precision) whose CUDA graphs the stager
                      could not capture beside serving (`SwapPort.capture_graphs`) has them
                      captured here first, between two steps
    prompt_logprobs   a canary prompt on one version, handed to the scheduler as low-priority
                      work in the next steps (`sitsd.engine.probes`); its log-probabilities
                      come back from the runner once its last chunk has been computed
    handle            a `SwapCommand`: commit a version

A commit, between two steps:

    two slots: activate the standby slot holding the version (an index flip: no copy)
    one slot:  copy the version over the only slot in place (the command's `InPlaceCopy`)
    then:      `SwapPolicies.switch(version, policy, keeps_old)`: new requests run on the
               version; in-flight ones drain, restart (a few a step while the old weights
               stay in their slot, all at once after a copy in place) or migrate

and reports `SwapEvent`s through the command's `on_event`: "migrating" (with progress after
each step) while shadows catch up, then "committed" (or "failed"). A migration commits at the
start of the step in which every shadow has caught up (the scheduler's flip phase). The event
carries the flip's own time and the serving pause: the gap between the end of the last step
before the flip and the start of the first step after it (flip included), and, to compare it
with, the median gap between two busy steps before it. The controller is a step hook
(`sitsd.engine.step.StepHooks`) to measure those, and tells the step function when steps must
run one at a time (`one_step_at_a_time`): a migration's last two steps (the shadows' catch-up
and the flip); the rest of a migration, a restart's steps and the step that measures a
drain's or a restart's pause run ahead.

Which version to stage, validate and commit, and when, is `sitsd.weights.swap`'s business.
"""

from __future__ import annotations

import functools
import logging
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sitsd.engine.messages import SwapCommand, SwapEvent
from sitsd.engine.observer import EngineObserver, StepRecord
from sitsd.engine.runner import ModelRunnerLike
from sitsd.engine.scheduler import Scheduler
from sitsd.engine.swap_policies import VersionSwitch
from sitsd.outputs import SchedulerOutput

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)

# Told a canary prompt's log-probabilities ([n, vocab] on the engine's device), or the error.
LogprobsDone = Callable[["torch.Tensor | None", "BaseException | None"], None]

_GAP_WINDOW = 64  # step gaps remembered, for the typical gap a commit's pause compares with
_IDLE_GAP_S = 0.1  # a longer gap between steps is the engine waiting for work


class StandbyBusy(Exception):
    """The standby slot still serves requests (a drain), or a commit is in flight."""

    def __init__(self, version: str, num_requests: int) -> None:
        super().__init__(f"the standby slot serves {num_requests} requests on {version}")
        self.version = version  # what the slot holds ("" while a commit is in flight)
        self.num_requests = num_requests


@dataclass
class _InFlight:
    command: SwapCommand
    policy: str
    switch: VersionSwitch
    flip_s: float = 0.0
    flipped: bool = False  # the flip is done; waiting for the next step to measure the pause


class SwapController:
    """The engine side of hot-swap; engine thread only (see the module docstring)."""

    def __init__(
        self,
        scheduler: Scheduler,
        runner: ModelRunnerLike,
        observer: EngineObserver,
        refresh_status: Callable[[], None],
    ) -> None:
        """Args:
        scheduler: its swap policies switch the requests in flight.
        runner: holds the weight slots and runs canary prompts.
        observer: told of each migrated request.
        refresh_status: called before each event, so the engine's status shows its effect.
        """
        self._scheduler = scheduler
        self._runner = runner
        self._slots = runner.slots
        self._observer = observer
        self._refresh_status = refresh_status
        self._inflight: _InFlight | None = None
        self._last_step_end = time.monotonic()
        self._gaps: deque[float] = deque(maxlen=_GAP_WINDOW)  # recent gaps between busy steps

    @property
    def busy(self) -> bool:
        """A commit is in progress (a migration catching up, or a pause being measured)."""
        return self._inflight is not None

    @property
    def one_step_at_a_time(self) -> bool:
        """Steps must not run ahead: a migration's shadows are close enough to catch up and
        flip (shadows compute only tokens the host knows, which a step ahead is always one
        past: `Migration`). The rest of a migration runs ahead, and so do a restart's steps
        (a request taken back while the step ahead samples its token keeps that token, on
        its old version) and the step after a drain's or a restart's flip, whose start
        measures the pause."""
        migration = self._scheduler.swaps.migration
        return migration is not None and migration.nearly_ready

    # ------------------------------------------------------------------ the port's calls

    def reserve_standby(self) -> int:
        """Release the standby slot to the stager; its index.

        Raises:
            StandbyBusy: requests still run on its version (drain), or a commit is in flight.
            RuntimeError: there is no standby slot (one weight slot).
        """
        slots = self._slots
        index = slots.standby
        if index is None:
            raise RuntimeError("one weight slot: there is no standby slot to stage into")
        held = slots.versions[index]
        num = self._scheduler.swaps.num_on_version(held) if held else 0
        if num or self.busy:
            raise StandbyBusy(held or "", num)
        self._release(index)
        return index

    def fill(self, index: int, version: str) -> None:
        """Slot `index` now holds `version` (its copy has completed); graphs captured again
        for it when its tensors moved (a version of another precision) and the stager did not
        capture them beside serving."""
        if self._slots.take_restructured(index):
            seconds = self._runner.recapture_graphs(index)
            log.warning("weight slot %d holds a new structure: graphs captured between two "
                        "steps in %.2fs, the streams waiting", index, seconds)  # fmt: skip
        self._slots.fill(index, version)

    def release(self, index: int) -> None:
        """Slot `index` holds no version (a rejected one must never serve)."""
        self._release(index)

    def prompt_logprobs(self, token_ids: list[int], version: str, on_done: LogprobsDone) -> None:
        """Queue a canary prompt on `version`: it runs as low-priority work in the next steps,
        then `on_done(log-probabilities of every position [n, vocab] float32, None)`, or
        `on_done(None, error)` when it could not run.

        Raises:
            KeyError: `version` is in no slot.
        """
        if self._slots.index_of(version) is None:
            raise KeyError(f"weights version {version!r} is in no slot ({self._slots.versions})")
        done = functools.partial(self._probe_done, on_done)
        self._scheduler.probes.add(token_ids, version, done)

    def handle(self, command: SwapCommand) -> None:
        """Start committing `command.version` (between two steps)."""
        if self._inflight is not None:
            self._fail(command, f"a commit of {self._inflight.command.version} is in progress")
            return
        started = time.monotonic()
        policy = command.policy
        slots = self._slots
        try:
            if command.in_place is not None:
                slots.release(slots.active)
                slots.copy_into(
                    slots.active, command.in_place.tensors,
                    chunk_bytes=command.in_place.chunk_bytes, source=command.in_place.source,
                )  # fmt: skip
                if slots.take_restructured(slots.active):
                    self._runner.recapture_graphs(slots.active)
                slots.fill(slots.active, command.version)
                policy = "restart"  # the old weights are gone: in-flight KV is recomputed
            elif slots.index_of(command.version) is None:
                raise ValueError(f"version {command.version} is not in a weight slot")
            slots.activate(command.version)
            keeps_old = command.in_place is None
            switch = self._scheduler.swaps.switch(command.version, policy, keeps_old)
        except Exception as exc:
            log.exception("commit of %s failed", command.version)
            self._fail(command, f"{type(exc).__name__}: {exc}")
            return
        inflight = _InFlight(command, policy, switch, flip_s=time.monotonic() - started)
        self._inflight = inflight
        if self._scheduler.swaps.migration is None:  # drain, restart, or nothing to migrate
            inflight.flipped = True
            if not self._scheduler.has_work():
                self._committed(inflight, pause_s=inflight.flip_s)
        else:
            self._emit(inflight, "migrating")

    # ------------------------------------------------------------------------ step hooks

    def step_started(self, now: float) -> None:
        """Before `schedule()`: a flip waiting for its pause to be measured reports it."""
        if now - self._last_step_end < _IDLE_GAP_S:
            self._gaps.append(now - self._last_step_end)
        inflight = self._inflight
        if inflight is not None and inflight.flipped:
            self._committed(inflight, pause_s=max(now - self._last_step_end, inflight.flip_s))

    def scheduled(self, sched_out: SchedulerOutput, started: float) -> None:
        """After `schedule()`: a migration that flipped in it commits (pause: gap + flip)."""
        inflight = self._inflight
        if inflight is None or sched_out.committed_version is None:
            return
        migration = self._scheduler.swaps.last_migration
        assert migration is not None, "a committed version comes from a migration"
        now = time.monotonic()
        for entry in migration.shadows.values():
            self._observer.on_request_migrated(
                entry.original, entry.started, now, migration.from_version, migration.to_version
            )
        inflight.flip_s = migration.flip_s
        gap = started - self._last_step_end
        self._committed(
            inflight,
            pause_s=gap + migration.flip_s,
            num_restarted=inflight.switch.num_restarted + migration.num_restarted,
        )

    def step_ended(self, record: StepRecord | None, end: float) -> None:
        """After a step: remember when it ended; report migration progress."""
        self._last_step_end = end
        inflight = self._inflight
        if (
            inflight is not None
            and self._scheduler.swaps.migration is not None
            and not inflight.flipped
        ):
            self._emit(inflight, "migrating")

    def when_idle(self) -> None:
        """No step will run: a flip waiting for the next step reports its own time as pause."""
        inflight = self._inflight
        if inflight is not None and inflight.flipped:
            self._committed(inflight, pause_s=inflight.flip_s)

    # ------------------------------------------------------------------------------ internal

    def _release(self, index: int) -> None:
        held = self._slots.versions[index]
        self._slots.release(index)
        if held is not None:  # nothing may run on a slot being rewritten
            self._scheduler.probes.fail_versions([held], f"version {held} left its weight slot")

    def _probe_done(self, on_done: LogprobsDone, probe_id: str, error: str | None) -> None:
        """A probe ended (the scheduler tells it): hand its log-probabilities over."""
        try:
            if error is None:
                on_done(self._runner.take_prompt_logprobs(probe_id), None)
            else:
                on_done(None, RuntimeError(f"the canary prompt could not run: {error}"))
        except Exception:  # the caller's problem; never the engine thread's
            log.exception("canary prompt callback failed")

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
        switch, migration = inflight.switch, self._scheduler.swaps.migration
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
