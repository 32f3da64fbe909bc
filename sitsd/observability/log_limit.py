"""Log lines that clients can cause, at a bounded rate: one bad client must not flood the log.

`RateLimitedLog` passes at most `burst` records of each key (an RPC and its error class, say)
per `interval_s` to its logger and counts the rest; the first record of the next interval
carries `suppressed` (how many were dropped) and `suppressed_for_s`, so nothing is lost from
the totals, only repeated lines. Keys are whatever the caller groups by; their number must be
bounded (methods x error classes), never a client's value. Which records go through a limit
is the caller's decision: failures of sitsd's own (INTERNAL) should not.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass


@dataclass
class _Window:
    started: float  # clock reading when this interval began
    num_logged: int = 0  # records passed on in this interval
    num_suppressed: int = 0  # records dropped since the last one passed on


class RateLimitedLog:
    """A logger's records, at most `burst` per key every `interval_s` (thread-safe)."""

    def __init__(
        self,
        logger: logging.Logger,
        *,
        burst: int = 5,
        interval_s: float = 10.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """Args:
        logger: where the records that pass go.
        burst: records per key and interval passed on.
        interval_s: the interval's length.
        clock: seconds, monotonic (tests pass their own).
        """
        self._logger = logger
        self._burst = burst
        self._interval_s = interval_s
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[Hashable, _Window] = {}

    def log(
        self,
        level: int,
        key: Hashable,
        message: str,
        *args: object,
        extra: Mapping[str, object] | None = None,
    ) -> bool:
        """Log `message % args` unless `key` used up its burst; whether it was logged."""
        if not self._logger.isEnabledFor(level):
            return False
        now = self._clock()
        with self._lock:
            window = self._windows.get(key)
            if window is None or now - window.started >= self._interval_s:
                dropped = window.num_suppressed if window is not None else 0
                since = now - window.started if window is not None else 0.0
                window = self._windows[key] = _Window(started=now)
            else:
                dropped, since = 0, 0.0
            if window.num_logged >= self._burst:
                window.num_suppressed += 1
                return False
            window.num_logged += 1
        fields = dict(extra or {})
        if dropped:
            fields.update(suppressed=dropped, suppressed_for_s=round(since, 3))
        self._logger.log(level, message, *args, extra=fields)
        return True
