"""GilHoldMonitor: a thread that keeps the interpreter in a C call is logged, with its frame."""

from __future__ import annotations

import ctypes
import logging
import threading
import time

from sitsd.observability.gil_holds import GilHoldMonitor

HOLD_S = 0.2
# A C function called through PyDLL keeps the interpreter for as long as it runs: libc's usleep
# holds it at least HOLD_S, whatever else the machine does (a Python-level timer around a C call
# would also count the time the thread then waits to get the interpreter back).
_LIBC = ctypes.PyDLL(None)


def hold_the_interpreter(monitor: GilHoldMonitor) -> None:
    seen = monitor.num_late
    _LIBC.usleep(ctypes.c_uint(int(HOLD_S * 1e6)))
    # Still here, running Python, when the probe looks (another thread may get the interpreter
    # first once the hold ends); a deadline as the last guard.
    deadline = time.monotonic() + 60.0
    while monitor.num_late == seen and time.monotonic() < deadline:
        pass


def test_a_thread_that_keeps_the_interpreter_is_logged_with_where_it_was(caplog):
    warn_s = 0.02
    monitor = GilHoldMonitor(warn_s, interval_s=0.002, warn_every_s=0.0)
    holder = threading.Thread(target=hold_the_interpreter, args=(monitor,), name="holder")
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.gil_holds"):
        monitor.start()
        try:
            deadline = time.monotonic() + 60.0
            while monitor.max_late_s == 0.0 and time.monotonic() < deadline:
                time.sleep(0.001)  # the probe has woken once: it sleeps when the hold begins
            holder.start()
            holder.join()
        finally:
            monitor.stop()
    assert monitor.num_late >= 1
    # The probe, asleep or waiting when the hold began, got the interpreter back after it.
    assert monitor.max_late_s >= HOLD_S - 2 * monitor.interval_s
    records = [r for r in caplog.records if r.name == "sitsd.observability.gil_holds"]
    assert records, "the hold was logged"
    slowest = max(records, key=lambda r: r.gil_wait_ms)
    assert slowest.gil_wait_ms >= (HOLD_S - 2 * monitor.interval_s) * 1e3
    assert "holder at test_gil_holds.py" in slowest.getMessage()
    assert "hold_the_interpreter" in slowest.getMessage()


def test_a_stopped_monitor_leaves_no_thread():
    monitor = GilHoldMonitor(0.05)
    monitor.start()
    assert any(t.name == "sitsd-gil-holds" for t in threading.enumerate())
    monitor.stop()
    assert not any(t.name == "sitsd-gil-holds" for t in threading.enumerate())
