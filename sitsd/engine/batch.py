"""The scheduler's primitives, as its composed parts see them.

The scheduler (`sitsd.engine.scheduler`) is the only writer of request state. Its parts, the
scheduling policy (`policy.py`, `tier_policy.py`) and the weights-version part
(`versions.py`), never touch a request's blocks or status themselves: they ask for one of the
primitives below, which keep the batch, the queue and the KV cache consistent. What to admit,
whom to preempt and when to switch versions is the parts' decision; how is the scheduler's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request
from sitsd.outputs import PreemptionReason, SchedulerOutput


class WaitingQueue(Protocol):
    """Waiting requests in a policy's order (`sitsd.engine.waiting_queue`)."""

    def push(self, request: Request) -> None: ...

    def push_preempted(self, request: Request) -> None: ...

    def peek(self) -> Request: ...

    def remove(self, request: Request) -> None: ...

    def __iter__(self) -> Iterator[Request]: ...  # a snapshot: removing while iterating is fine

    def __len__(self) -> int: ...

    def __bool__(self) -> bool: ...


class Batch(Protocol):
    """The running batch, the queue, and the moves that change them (`Scheduler` is one)."""

    config: SchedulerConfig
    kv_cache: KVCacheManager
    requests: dict[str, Request]  # every live request, by id
    running: list[Request]  # in the policy's order: block pressure preempts from the end
    waiting: WaitingQueue

    def now(self) -> float:
        """The scheduler's clock (the same as requests' arrival times)."""
        ...

    def budget(self, out: SchedulerOutput) -> int:
        """Tokens left in this step's budget."""
        ...

    def try_admit(self, request: Request, out: SchedulerOutput) -> int | None:
        """Move a waiting request into the batch with its first chunk; the chunk's tokens, or
        None when the budget or the blocks for it are missing, or a swap keeps it out of this
        step (`kept_out`; batch slots are the caller's to check)."""
        ...

    def kept_out(self, request: Request) -> bool:
        """`request` must wait for a later step: it was taken back while the step ahead
        samples its token (readmitted now, it would start without that token), or a swap
        keeps it out (a drain holds it, or it is one the drain held, or one a restart took
        back, and this step's share of their prompts is spent). The requests behind it may
        go ahead (they are the arrivals of a steady load), and nothing is preempted for it."""
        ...

    def preempt(
        self,
        request: Request,
        out: SchedulerOutput,
        reason: PreemptionReason,
        for_request: Request,
    ) -> None:
        """Take a running request's blocks back to make room for `for_request`; it is
        recomputed later (a counted preemption; `out.preemptions` says why and for whom)."""
        ...

    def take_back(self, request: Request, out: SchedulerOutput | None) -> None:
        """Free a running request's blocks and queue it to be recomputed, keeping its place:
        a swap restarts it (not counted as a preemption; `out` None: between steps)."""
        ...

    def unschedule(self, req_id: str, out: SchedulerOutput) -> None:
        """Take a request scheduled earlier in this step back out of `out`."""
        ...

    def forget(self, req_id: str) -> None:
        """Tell the runner, with the next step, to drop its state for `req_id`."""
        ...
