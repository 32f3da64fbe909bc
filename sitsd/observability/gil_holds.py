"""Interpreter holds: the engine's step is Python between its device calls, so another thread
that keeps the interpreter (a C call that does not let go of it, such as a driver call inside
torch, or busy Python) stretches every step it overlaps, and neither the step's own timing nor
the event loop's lag says who. `GilHoldMonitor` runs a thread that sleeps `interval_s` at a time
and, woken, must take the interpreter back before it can read the clock: how late it wakes is
how long it waited for the interpreter (plus the operating system's wake-up, tens of
microseconds). A wake-up `warn_s` late or more is logged (at most one per `warn_every_s`) with
where the other busy threads were when the probe got the interpreter back (the one that had
held it is among them, at the call it made).

It costs a thread waking every `interval_s` (hundreds of wake-ups a second): off unless asked
for (`--gil-hold-warn-ms`), for diagnosing stalls.
"""

from __future__ import annotations

import logging
import sys
import threading
import time
import traceback

log = logging.getLogger(__name__)

# Frames of a thread waiting for work: not the holder.
_IDLE_FILES = ("threading.py", "selectors.py", "queue.py", "thread.py", "base_events.py")


class GilHoldMonitor:
    """Measures how late a sleeping thread gets the interpreter back (see the module docstring)."""

    def __init__(self, warn_s: float, interval_s: float = 0.002, warn_every_s: float = 1.0) -> None:
        """Args:
        warn_s: a wake-up this late or more is logged.
        interval_s: how long each sleep is.
        warn_every_s: at most one warning per this long.
        """
        self.warn_s = warn_s
        self.interval_s = interval_s
        self.warn_every_s = warn_every_s
        self.max_late_s = 0.0  # the latest wake-up seen
        self.num_late = 0  # wake-ups `warn_s` late or more
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="sitsd-gil-holds", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5.0)
            self._thread = None

    def _run(self) -> None:
        last_warning = float("-inf")
        me = threading.get_ident()
        while not self._stop.is_set():
            due = time.monotonic() + self.interval_s
            time.sleep(self.interval_s)
            now = time.monotonic()
            late = max(0.0, now - due)
            self.max_late_s = max(self.max_late_s, late)
            if late < self.warn_s:
                continue
            self.num_late += 1
            if now - last_warning < self.warn_every_s:
                continue
            last_warning = now
            log.warning(
                "the interpreter was held %.1f ms: a thread kept it while others waited (%s)",
                late * 1e3,
                running_frames(me),
                extra={"gil_wait_ms": round(late * 1e3, 2)},
            )


def running_frames(exclude: int) -> str:
    """Each other thread not waiting for work: its name and innermost Python frame."""
    names = {t.ident: t.name for t in threading.enumerate()}
    out = []
    for ident, frame in sys._current_frames().items():
        where = traceback.extract_stack(frame, limit=1)[-1]
        file = where.filename.rsplit("/", 1)[-1]
        if ident != exclude and file not in _IDLE_FILES:
            out.append(f"{names.get(ident, ident)} at {file}:{where.lineno} {where.name}")
    return "; ".join(out) or "no other thread running Python"
