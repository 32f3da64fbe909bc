"""Garbage-collector pauses: a collection stops every Python thread while it scans, the
engine's included, so every stream gets one slow token at once and no step span says why.
`GcPauseMonitor` times each collection through `gc.callbacks`, keeps the longest, and logs a
warning for one that took `warn_s` or more (at most one a second), with its generation and
what it freed, so a stall in a benchmark's inter-token latencies can be matched to one.

What the daemon freezes out of the collector's reach at start-up is `sitsd.daemon`'s business.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)

_WARN_EVERY_S = 1.0  # the most warnings a run of long collections writes: one a second


class GcPauseMonitor:
    """Times every garbage collection of the process while started."""

    def __init__(self, warn_s: float = 0.01) -> None:
        """Args:
        warn_s: a collection at least this long is logged as a warning.
        """
        self.warn_s = warn_s
        self.max_pause_s = 0.0  # the longest collection seen
        self.num_collections = 0
        self._started: float | None = None  # perf_counter() of the collection under way
        self._last_warning = float("-inf")

    def start(self) -> None:
        gc.callbacks.append(self._on_gc)

    def stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, info: dict[str, int]) -> None:
        now = time.perf_counter()
        if phase == "start":
            self._started = now
            return
        if self._started is None:  # started while a collection was under way
            return
        pause = now - self._started
        self._started = None
        self.num_collections += 1
        self.max_pause_s = max(self.max_pause_s, pause)
        if pause >= self.warn_s and now - self._last_warning >= _WARN_EVERY_S:
            self._last_warning = now
            log.warning(
                "garbage collection of generation %d took %.1f ms (every thread stopped; "
                "%d objects freed)",
                info.get("generation", -1),
                pause * 1e3,
                info.get("collected", 0),
                extra={
                    "gc_ms": round(pause * 1e3, 2),
                    "gc_generation": info.get("generation", -1),
                    "gc_collected": info.get("collected", 0),
                },
            )
