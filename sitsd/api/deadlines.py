"""A call's deadline as the server sees it, and whether a client that left was giving up at it.

A client starts its deadline's clock before it sends the call; the server starts its own when
the call arrives, so the server's deadline passes later, by the call's one-way latency. A
client that gives up at its deadline (gRPC cancels the stream, an HTTP client closes the
connection) is therefore seen leaving a little before the server's deadline: ~7 ms on an idle
machine, more on a busy one, where a plain "has the deadline passed?" called most of those
calls cancelled. `CallDeadline.explains_leaving` counts a client that leaves within `slack_s`
of the deadline as one that ran out of time: `DEADLINE_SLACK_S`, or a quarter of the call's
timeout when that is shorter, so a client that cancels well before its deadline stays a
cancellation.

Both front ends use it: `sitsd.api` (the servicer's abort cause, the telemetry interceptor's
error class) and `sitsd.http` (the `x-sitsd-timeout-ms` deadline, whose clients often time out
at the same moment).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

DEADLINE_SLACK_S = 0.5  # a client leaving this close to its deadline ran out of time


@dataclass(frozen=True, slots=True)
class CallDeadline:
    """When a call's deadline passes on the server's clock (`time.monotonic()`), if it has one."""

    at: float | None = None  # None: the call has no deadline
    slack_s: float = 0.0  # how early a client leaving still counts as its deadline

    @staticmethod
    def after(remaining_s: float | None, now: float | None = None) -> CallDeadline:
        """The deadline `remaining_s` from `now` (None: no deadline)."""
        if remaining_s is None:
            return CallDeadline()
        now = time.monotonic() if now is None else now
        return CallDeadline(now + remaining_s, min(DEADLINE_SLACK_S, max(remaining_s, 0.0) / 4))

    def passed(self, now: float | None = None) -> bool:
        """The deadline has passed on the server's clock."""
        return self.at is not None and _now(now) >= self.at

    def explains_leaving(self, now: float | None = None) -> bool:
        """A client leaving now is giving up at its deadline (see the module docstring)."""
        return self.at is not None and _now(now) >= self.at - self.slack_s


def _now(now: float | None) -> float:
    return time.monotonic() if now is None else now
