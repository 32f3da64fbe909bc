"""The engine core's asynchronous step (on by default with CUDA; `--no-async-scheduling`): the
next step is scheduled and launched while the last one runs, then the last one's tokens are
taken.

`StepAhead` is part of `EngineCore` (a mixin, in its own file to keep `core.py` readable). The
scheduler counts the running step's tokens as computed when it schedules the next one
(`Scheduler._apply_ahead`), the runner reads a token the running step is still sampling from
its output on the device, and a request that stops at EOS learns it one step late: the token
the next step computed for it is dropped. Swaps and engine calls first finish the step ahead
(`finish_ahead`) and run one step at a time.
"""

from __future__ import annotations

import dataclasses
import time
from typing import TYPE_CHECKING

from sitsd.outputs import ModelRunnerOutput, SchedulerOutput
from sitsd.types import RequestDelta

if TYPE_CHECKING:
    from sitsd.engine.commit import CommitControl
    from sitsd.engine.core import ModelRunnerLike, PendingStepLike
    from sitsd.engine.observer import EngineObserver
    from sitsd.engine.scheduler import Scheduler


class StepAhead:
    """EngineCore methods for asynchronous scheduling (see the module docstring)."""

    if TYPE_CHECKING:  # the EngineCore state these methods work on
        scheduler: Scheduler
        runner: ModelRunnerLike
        commits: CommitControl
        observer: EngineObserver
        _ahead: LaunchedStep | None

        def _flush_deferred(self) -> list[RequestDelta]: ...
        def _fail_step(self, exc: Exception, req_ids: list[str]) -> list[RequestDelta]: ...
        def _updates(
            self,
            sched_out: SchedulerOutput,
            runner_out: ModelRunnerOutput,
            start: float,
            defer: bool,
        ) -> list[RequestDelta]: ...

    def _step_ahead(self) -> list[RequestDelta]:
        """Asynchronous scheduling: schedule and launch the next step while the last one runs,
        then take the last one's tokens. Finishes (EOS, stop strings) are learnt one step late:
        a finished request's token from the next step is dropped."""
        start = time.monotonic()
        self.commits.on_step_start(start)
        sched_out = self.scheduler.schedule()  # counts the step still running as done
        self.commits.after_schedule(sched_out, start)
        for req_id in sched_out.preempted_req_ids:
            self.observer.on_request_preempted(self.scheduler.requests[req_id], start)
        ahead, self._ahead = self._ahead, None
        launched = None
        try:
            if not sched_out.is_empty:
                launched = LaunchedStep(sched_out, self.runner.launch(sched_out), start)
            deltas = self._flush_deferred()
            if ahead is None:
                self._ahead = launched
                if launched is None:
                    self.commits.after_step(time.monotonic())
                return deltas
            runner_out = ahead.pending.result()
        except Exception as exc:  # both steps fail, the engine keeps serving
            failed = [*(ahead.sched_out.num_scheduled_tokens if ahead else ()),
                      *sched_out.num_scheduled_tokens]  # fmt: skip
            self.scheduler.drop_ahead()
            return self._fail_step(exc, list(dict.fromkeys(failed)))
        self._ahead = launched
        if launched is None:
            self.scheduler.drop_ahead()
        return deltas + self._updates(ahead.sched_out, runner_out, ahead.started, defer=False)

    def finish_ahead(self) -> list[RequestDelta]:
        """Take the launched step's tokens now (before a swap, a call on the engine thread,
        or a step scheduled in turn); nothing when no step is ahead."""
        ahead, self._ahead = self._ahead, None
        self.scheduler.drop_ahead()
        if ahead is None:
            return []
        deltas = self._flush_deferred()
        try:
            runner_out = ahead.pending.result()
        except Exception as exc:
            return deltas + self._fail_step(exc, list(ahead.sched_out.num_scheduled_tokens))
        return deltas + self._updates(ahead.sched_out, runner_out, ahead.started, defer=False)


@dataclasses.dataclass(slots=True)
class LaunchedStep:
    """A step launched ahead of the last one's output (asynchronous scheduling)."""

    sched_out: SchedulerOutput
    pending: PendingStepLike
    started: float
