"""Event-loop stalls: every token a client receives goes out through the daemon's asyncio loop,
so a callback that blocks it (a slow disk, a long computation) holds up every stream at once
while the engine keeps computing; no step span shows it. `LoopLagMonitor` sleeps `interval_s`
at a time on that loop, records how late it woke (`sitsd_event_loop_lag_seconds`) and logs a
warning when one wake-up was `warn_s` late or more (at most one per `warn_every_s`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

log = logging.getLogger(__name__)


class LoopLagMonitor:
    """Measures the running loop's lag from a task of its own."""

    def __init__(
        self,
        on_lag: Callable[[float], None] | None = None,
        interval_s: float = 0.05,
        warn_s: float = 0.25,
        warn_every_s: float = 1.0,
    ) -> None:
        """Args:
        on_lag: called with each wake-up's lag in seconds (the metric).
        interval_s: how long each sleep is.
        warn_s: the lag that makes a warning.
        warn_every_s: at most one warning per this long.
        """
        self.on_lag = on_lag
        self.interval_s = interval_s
        self.warn_s = warn_s
        self.warn_every_s = warn_every_s
        self.max_lag_s = 0.0  # the longest lag seen
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start measuring on the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._run(), name="loop-lag")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        last_warning = float("-inf")
        while True:
            due = loop.time() + self.interval_s
            await asyncio.sleep(self.interval_s)
            now = loop.time()
            lag = max(0.0, now - due)
            self.max_lag_s = max(self.max_lag_s, lag)
            if self.on_lag is not None:
                self.on_lag(lag)
            if lag >= self.warn_s and now - last_warning >= self.warn_every_s:
                last_warning = now
                log.warning(
                    "event loop stalled for %.0f ms: every stream waited (a blocking call on "
                    "the asyncio loop)",
                    lag * 1e3,
                    extra={"lag_ms": round(lag * 1e3, 1)},
                )
