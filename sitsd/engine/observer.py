"""The engine core's observer hook: what telemetry (or anything else) is told, and when.

`EngineCore` calls an `EngineObserver` on its own thread at fixed points of the loop:

    on_engine_started(model, weights_version)   once, when the loop starts
    on_request_added(request, place)            after the scheduler queued it (and where)
    on_request_refused(request, now, refusal)   admission control refused it: never queued
    on_request_preempted(request, now, preemption)
                                                after `schedule()` took its blocks back (why,
                                                and for whom)
    on_step(step)                               after `update_from_output()`, before deltas
    on_request_finished(request, now)           once per queued request, whatever ended it
                                                (`request.end_reason` says what)
    on_request_migrated(request, start, end, from_version, to_version)
                                                a swap moved its KV to new weights (migrate)
    on_status(status)                           after every loop turn (idle turns too)

Every request is told of once as it ends: refused, or added and then finished. Hooks run on
the engine thread between steps, so they must be cheap and must not block; the one exception
is `on_request_refused` for the API's early check (`EngineCore.admission_refusal`), which runs
on the API's thread and must touch no per-request state. What they record (metrics, spans,
logs) is `sitsd.observability`'s business. The core wraps the observer in `GuardedObserver`:
a failing hook is logged and ignored, never costs a request. `NullObserver` is the default and
does nothing.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from sitsd.engine.admission import QueuePlace, Refusal
from sitsd.engine.request import Request
from sitsd.engine.scheduler import TokenUpdate
from sitsd.outputs import EngineStatus, Preemption, SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class HostTimes:
    """Where the engine thread's time went in the turn that ended with a step's update, in
    seconds: with asynchronous scheduling that turn scheduled and launched the next step; in
    turn, the step itself. The rest of the turn (delivering deltas, the status snapshot, the
    inbox) is what the step's period leaves over these and the wait for the device."""

    schedule_s: float = 0.0  # `Scheduler.schedule()` of the step launched in the turn
    launch_s: float = 0.0  # the runner's launch of it (on a CPU: computing it)
    update_s: float = 0.0  # applying this step's tokens (`update_from_output`)


@dataclass(slots=True)
class StepRecord:
    """One engine step, as an observer sees it. Times are `time.monotonic()`."""

    sched_out: SchedulerOutput  # what was computed (req_id -> tokens, new/preempted requests)
    updates: list[TokenUpdate]  # sampled tokens per request (requests mid-prefill have none)
    start: float  # before `schedule()`
    end: float  # after `update_from_output()`
    index: int = 0  # the step's number since the engine started (1 = the first)
    # Seconds the engine thread waited for the device's tokens of this step (0 on a CPU, where
    # the runner computes inside its launch): the rest of a step's period is the host's.
    wait_s: float = 0.0
    host: HostTimes = field(default_factory=HostTimes)  # the host's share, by part


class EngineObserver(Protocol):
    """What the engine core tells an observer; see the module docstring for when."""

    def on_engine_started(self, model: str, weights_version: str) -> None: ...

    def on_request_added(self, request: Request, place: QueuePlace) -> None: ...

    def on_request_refused(self, request: Request, now: float, refusal: Refusal) -> None: ...

    def on_request_preempted(
        self, request: Request, now: float, preemption: Preemption
    ) -> None: ...

    def on_step(self, step: StepRecord) -> None: ...

    def on_request_finished(self, request: Request, now: float) -> None: ...

    def on_request_migrated(
        self, request: Request, start: float, end: float, from_version: str, to_version: str
    ) -> None: ...

    def on_status(self, status: EngineStatus) -> None: ...


class NullObserver:
    """Observes nothing (the default)."""

    def on_engine_started(self, model: str, weights_version: str) -> None:
        pass

    def on_request_added(self, request: Request, place: QueuePlace) -> None:
        pass

    def on_request_refused(self, request: Request, now: float, refusal: Refusal) -> None:
        pass

    def on_request_preempted(self, request: Request, now: float, preemption: Preemption) -> None:
        pass

    def on_step(self, step: StepRecord) -> None:
        pass

    def on_request_finished(self, request: Request, now: float) -> None:
        pass

    def on_request_migrated(
        self, request: Request, start: float, end: float, from_version: str, to_version: str
    ) -> None:
        pass

    def on_status(self, status: EngineStatus) -> None:
        pass


class GuardedObserver:
    """Forwards every hook to `observer`; a hook that raises is logged (once) and ignored."""

    def __init__(self, observer: EngineObserver) -> None:
        self.observer = observer
        self._failed: set[str] = set()

    def _call(self, name: str, hook: Callable[[], None]) -> None:
        try:
            hook()
        except Exception:
            if name not in self._failed:  # once per hook: a broken hook would fail every step
                self._failed.add(name)
                log.exception("engine observer hook %s failed (logged once)", name)

    def on_engine_started(self, model: str, weights_version: str) -> None:
        observer = self.observer
        self._call("on_engine_started", lambda: observer.on_engine_started(model, weights_version))

    def on_request_added(self, request: Request, place: QueuePlace) -> None:
        self._call("on_request_added", lambda: self.observer.on_request_added(request, place))

    def on_request_refused(self, request: Request, now: float, refusal: Refusal) -> None:
        observer = self.observer
        self._call("on_request_refused", lambda: observer.on_request_refused(request, now, refusal))

    def on_request_preempted(self, request: Request, now: float, preemption: Preemption) -> None:
        observer = self.observer
        self._call(
            "on_request_preempted",
            lambda: observer.on_request_preempted(request, now, preemption),
        )

    def on_step(self, step: StepRecord) -> None:
        self._call("on_step", lambda: self.observer.on_step(step))

    def on_request_finished(self, request: Request, now: float) -> None:
        self._call("on_request_finished", lambda: self.observer.on_request_finished(request, now))

    def on_request_migrated(
        self, request: Request, start: float, end: float, from_version: str, to_version: str
    ) -> None:
        observer = self.observer
        self._call(
            "on_request_migrated",
            lambda: observer.on_request_migrated(request, start, end, from_version, to_version),
        )

    def on_status(self, status: EngineStatus) -> None:
        self._call("on_status", lambda: self.observer.on_status(status))
