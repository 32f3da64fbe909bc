"""GilHoldMonitor: a thread that keeps the interpreter in a C call is logged, with its frame."""

from __future__ import annotations

import logging
import threading
import time

from sitsd.observability.gil_holds import GilHoldMonitor


def long_enough_sum(at_least_s: float) -> int:
    """A count whose `sum(range(count))` keeps the interpreter at least `at_least_s` here."""
    count = 1 << 16
    while True:
        began = time.monotonic()
        sum(range(count))
        if time.monotonic() - began >= at_least_s:
            return count
        count *= 2


def hold_the_interpreter(count: int, took: list[float], monitor: GilHoldMonitor) -> None:
    began = time.monotonic()
    sum(range(count))  # one C call: the interpreter is not let go until it returns
    took.append(time.monotonic() - began)
    # Still here, running Python, when the probe looks (another thread may get the interpreter
    # first once the hold ends); a deadline as the last guard.
    deadline = time.monotonic() + 60.0
    while monitor.num_late == 0 and time.monotonic() < deadline:
        pass


def test_a_thread_that_keeps_the_interpreter_is_logged_with_where_it_was(caplog):
    warn_s = 0.02
    count = long_enough_sum(10 * warn_s)
    monitor = GilHoldMonitor(warn_s, interval_s=0.002, warn_every_s=0.0)
    took: list[float] = []
    holder = threading.Thread(
        target=hold_the_interpreter, args=(count, took, monitor), name="holder"
    )
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.gil_holds"):
        monitor.start()
        try:
            while monitor.max_late_s == 0.0 and monitor._thread is not None:
                time.sleep(0.001)  # the probe has woken once: it sleeps when the hold begins
            holder.start()
            holder.join()
        finally:
            monitor.stop()
    (hold_s,) = took
    assert hold_s >= warn_s  # 10x when measured above; a slower machine holds it longer
    assert monitor.num_late >= 1
    # The probe asleep when the hold began waited for at least most of it.
    assert monitor.max_late_s >= hold_s - 2 * monitor.interval_s - warn_s
    records = [r for r in caplog.records if r.name == "sitsd.observability.gil_holds"]
    assert records, "the hold was logged"
    slowest = max(records, key=lambda r: r.gil_wait_ms)
    assert slowest.gil_wait_ms >= warn_s * 1e3
    assert "holder at test_gil_holds.py" in slowest.getMessage()
    assert "hold_the_interpreter" in slowest.getMessage()


def test_a_stopped_monitor_leaves_no_thread():
    monitor = GilHoldMonitor(0.05)
    monitor.start()
    monitor.stop()
    assert monitor._thread is None
    assert not any(t.name == "sitsd-gil-holds" for t in threading.enumerate())
