"""Driving a scheduler and a runner step by step the way the engine core does, without its
thread: in turn (schedule, launch, result, update) or ahead (step N+1 scheduled and launched
before step N's result is applied: asynchronous scheduling)."""

from __future__ import annotations

from collections.abc import Callable

from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler, TokenUpdate


def drive(
    sched: Scheduler,
    runner,
    arrivals: list[tuple[int, Request]],
    ahead: bool,
    on_update: Callable[[TokenUpdate], None],
    between_steps: Callable[[], None] = lambda: None,
    max_steps: int = 5000,
) -> None:
    """Run until every request is done. `arrivals`: (step, request), sorted, each added at
    its step; `between_steps` runs before each `schedule()` (aborts, say)."""
    pending = list(arrivals)
    launched = None  # (SchedulerOutput, its pending result) of the step ahead
    step = 0
    while pending or sched.has_work() or launched is not None:
        while pending and pending[0][0] <= step:
            sched.add_request(pending.pop(0)[1])
        between_steps()
        step += 1
        so = sched.schedule()
        nxt = (so, runner.launch(so)) if not so.is_empty else None
        done = launched if ahead else nxt
        if ahead:
            launched = nxt
            if nxt is None:
                sched.drop_ahead()
        if done is not None:
            for update in sched.update_from_output(done[0], done[1].result()):
                on_update(update)
        assert step < max_steps, "requests did not finish"
