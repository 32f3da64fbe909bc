"""The engine step: schedule -> execute -> update -> deltas, one step at a time or one ahead.

The engine core (`core.py`) picks one step function when it is built and calls it every turn:

`InTurnStep` (CPU, or `--no-async-scheduling`): schedule, launch, wait for the tokens, update.
On a GPU `launch` only queues the work, so the last step's deltas are detokenized while the
device computes (their updates were deferred; a stop string is then found one step late and
the extra token discarded); on a CPU the runner computes inside `launch` and deltas go out at
once.

`AheadStep` (asynchronous scheduling, the default on CUDA) composes an `InTurnStep`: it
schedules and launches step N+1 before it takes step N's tokens, so the GPU never waits for
the host's update and scheduling. The scheduler counts the running step's tokens as computed,
the runner reads a token the running step is still sampling on the device, and a request that
stops at EOS learns it one step late: the token the next step computed for it is dropped.
When a swap needs it (`StepPacing.one_step_at_a_time`: a migration's catch-up and flip) it
finishes the step ahead, whose tokens go out at once, and runs in turn; swap commands and
engine calls finish it first too (`finish_ahead`).

Both report to `StepHooks` at named points (the swap controller and the observer listen):
`step_started` before scheduling, `scheduled` after, `step_ended` after the update (or after a
step with nothing to run). A step that raises fails its requests; the engine serves on.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from sitsd.engine.observer import EngineObserver, HostTimes, StepRecord
from sitsd.engine.output import OutputProcessor
from sitsd.engine.runner import ModelRunnerLike, PendingStepLike
from sitsd.engine.scheduler import Scheduler
from sitsd.outputs import ModelRunnerOutput, SchedulerOutput
from sitsd.types import EndReason, RequestDelta

log = logging.getLogger("sitsd.engine.core")


class StepHooks(Protocol):
    """Told of each step at named points (engine thread; keep it cheap)."""

    def step_started(self, now: float) -> None: ...

    def scheduled(self, sched_out: SchedulerOutput, started: float) -> None: ...

    def step_ended(self, record: StepRecord | None, end: float) -> None:
        """`record` None: the step had nothing to run."""
        ...


class StepPacing(Protocol):
    """Whether steps must run one at a time now (a swap's commit: `SwapController`)."""

    @property
    def one_step_at_a_time(self) -> bool: ...


class ObserverHooks:
    """Step hooks that tell an `EngineObserver` of preemptions and finished steps."""

    def __init__(self, observer: EngineObserver, scheduler: Scheduler) -> None:
        self._observer = observer
        self._scheduler = scheduler

    def step_started(self, now: float) -> None:
        pass

    def scheduled(self, sched_out: SchedulerOutput, started: float) -> None:
        requests = self._scheduler.requests
        for preemption in sched_out.preemptions:
            request = requests.get(preemption.req_id)
            if request is not None:  # a swap restart may have finished since
                self._observer.on_request_preempted(request, started, preemption)

    def step_ended(self, record: StepRecord | None, end: float) -> None:
        if record is not None:
            self._observer.on_step(record)


class HookList:
    """Several `StepHooks`, told in order."""

    def __init__(self, hooks: Sequence[StepHooks]) -> None:
        self._hooks = tuple(hooks)

    def step_started(self, now: float) -> None:
        for hook in self._hooks:
            hook.step_started(now)

    def scheduled(self, sched_out: SchedulerOutput, started: float) -> None:
        for hook in self._hooks:
            hook.scheduled(sched_out, started)

    def step_ended(self, record: StepRecord | None, end: float) -> None:
        for hook in self._hooks:
            hook.step_ended(record, end)


@dataclass(frozen=True)
class StepParts:
    """What a step works with."""

    scheduler: Scheduler
    runner: ModelRunnerLike
    output: OutputProcessor
    hooks: StepHooks


class InTurnStep:
    """One step at a time: schedule, launch, wait for its tokens, update."""

    def __init__(self, parts: StepParts) -> None:
        self.parts = parts
        self.num_steps = 0  # steps that ran (had tokens to compute)
        # Deltas wait for the next launch where that overlaps the device's work.
        self._defers = parts.runner.overlaps_host_work

    @property
    def has_pending(self) -> bool:
        """A launched step's tokens are still to be taken (never, in turn)."""
        return False

    def __call__(self) -> list[RequestDelta]:
        sched_out, started = self.schedule()
        if sched_out.is_empty:
            return self.nothing_to_run()
        output = self.parts.output
        scheduled = time.monotonic()
        try:
            pending = self.parts.runner.launch(sched_out)  # execute: only queued on a GPU
            launch_s = time.monotonic() - scheduled
            deltas = output.flush()  # the last step's tokens, while the device computes
            runner_out, wait_s = timed_result(pending)
        except Exception as exc:  # the batch fails, the engine keeps serving
            return self.fail(exc, list(sched_out.num_scheduled_tokens))
        return deltas + self.update(sched_out, runner_out, started, self._defers, wait_s,
                                    scheduled - started, launch_s)  # fmt: skip

    def finish_ahead(self) -> list[RequestDelta]:
        return []

    def ahead_reads(self, version: str) -> bool:
        """A step launched ahead reads `version`'s weights (never: none is, in turn)."""
        return False

    # ------------------------------------------------- the parts (`AheadStep` uses them too)

    def schedule(self) -> tuple[SchedulerOutput, float]:
        """This step's work, and when the step started."""
        started = time.monotonic()
        hooks = self.parts.hooks
        hooks.step_started(started)
        sched_out = self.parts.scheduler.schedule()
        hooks.scheduled(sched_out, started)
        return sched_out, started

    def nothing_to_run(self) -> list[RequestDelta]:
        self.parts.hooks.step_ended(None, time.monotonic())
        return self.parts.output.flush()

    def update(
        self,
        sched_out: SchedulerOutput,
        runner_out: ModelRunnerOutput,
        started: float,
        defer: bool,
        wait_s: float = 0.0,
        schedule_s: float = 0.0,
        launch_s: float = 0.0,
    ) -> list[RequestDelta]:
        """Apply a finished step's tokens; their deltas now, or deferred to the next launch.
        `wait_s`: how long the engine thread waited for them; `schedule_s`, `launch_s`: the
        turn's scheduling and launch, if it had any (`HostTimes`, with the update's time)."""
        parts = self.parts
        self.num_steps += 1
        began = time.monotonic()
        updates = parts.scheduler.update_from_output(sched_out, runner_out)
        end = time.monotonic()
        host = HostTimes(schedule_s, launch_s, end - began)
        record = StepRecord(sched_out, updates, started, end, self.num_steps, wait_s, host)
        parts.hooks.step_ended(record, end)
        if defer and parts.scheduler.has_work():
            parts.output.defer(updates)
            return []
        return parts.output.deltas(updates)

    def fail(self, exc: Exception, req_ids: list[str]) -> list[RequestDelta]:
        """A step raised: its requests fail, with the error in their last delta."""
        log.exception("model step failed; failing its %d requests", len(req_ids), exc_info=exc)
        message = f"internal error in the model step: {type(exc).__name__}: {exc}"
        output = self.parts.output
        deltas = output.flush()
        failed = [output.finish(r, EndReason.ERROR, message) for r in req_ids]
        return deltas + [d for d in failed if d is not None]


@dataclass(slots=True)
class _Launched:
    """A step launched ahead of the last one's output."""

    sched_out: SchedulerOutput
    pending: PendingStepLike
    started: float


class AheadStep:
    """Asynchronous scheduling: launch the next step before taking the last one's tokens."""

    def __init__(self, in_turn: InTurnStep, pacing: StepPacing) -> None:
        self._in_turn = in_turn
        self._pacing = pacing
        self._ahead: _Launched | None = None  # launched, its tokens not taken yet

    @property
    def num_steps(self) -> int:
        return self._in_turn.num_steps

    @property
    def has_pending(self) -> bool:
        return self._ahead is not None

    def __call__(self) -> list[RequestDelta]:
        if self._pacing.one_step_at_a_time:  # a swap needs steps in turn
            if self._ahead is not None:  # its tokens go out now, not after a step in turn
                return self.finish_ahead()
            scheduler = self._in_turn.parts.scheduler
            return self._in_turn() if scheduler.has_work() else []
        in_turn, parts = self._in_turn, self._in_turn.parts
        sched_out, started = in_turn.schedule()  # counts the step still running as done
        scheduled = time.monotonic()
        ahead, self._ahead = self._ahead, None
        launched = None
        try:
            if not sched_out.is_empty:
                launched = _Launched(sched_out, parts.runner.launch(sched_out), started)
            launch_s = time.monotonic() - scheduled
            deltas = parts.output.flush()
            if ahead is None:  # the first step of a run: nothing to take yet
                self._ahead = launched
                if launched is None:
                    parts.hooks.step_ended(None, time.monotonic())
                return deltas
            runner_out, wait_s = timed_result(ahead.pending)
        except Exception as exc:  # both steps fail, the engine keeps serving
            failed = [*(ahead.sched_out.num_scheduled_tokens if ahead else ()),
                      *sched_out.num_scheduled_tokens]  # fmt: skip
            parts.scheduler.drop_ahead()
            return in_turn.fail(exc, list(dict.fromkeys(failed)))
        self._ahead = launched
        if launched is None:
            parts.scheduler.drop_ahead()
        return deltas + in_turn.update(ahead.sched_out, runner_out, ahead.started, False, wait_s,
                                       scheduled - started, launch_s)  # fmt: skip

    def ahead_reads(self, version: str) -> bool:
        """The step launched ahead reads `version`'s weights (a step whose versions were not
        all scheduled, as after a preemption, may read any)."""
        ahead = self._ahead
        if ahead is None:
            return False
        read = ahead.sched_out.weights_versions
        return read is None or version in read

    def finish_ahead(self) -> list[RequestDelta]:
        """Take the launched step's tokens now (before a swap, a call on the engine thread,
        or a step scheduled in turn); nothing when no step is ahead."""
        in_turn = self._in_turn
        ahead, self._ahead = self._ahead, None
        in_turn.parts.scheduler.drop_ahead()
        if ahead is None:
            return []
        deltas = in_turn.parts.output.flush()
        try:
            runner_out, wait_s = timed_result(ahead.pending)
        except Exception as exc:
            return deltas + in_turn.fail(exc, list(ahead.sched_out.num_scheduled_tokens))
        return deltas + in_turn.update(ahead.sched_out, runner_out, ahead.started, False, wait_s)


def timed_result(pending: PendingStepLike) -> tuple[ModelRunnerOutput, float]:
    """A launched step's tokens, and the seconds this thread waited for them."""
    began = time.monotonic()
    runner_out = pending.result()
    return runner_out, time.monotonic() - began
