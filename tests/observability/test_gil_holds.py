"""GilHoldMonitor: a thread that keeps the interpreter in a C call is logged, with its frame."""

from __future__ import annotations

import logging
import threading
import time

from sitsd.observability.gil_holds import GilHoldMonitor


def hold_the_interpreter(count: int, took: list[float], monitor: GilHoldMonitor) -> None:
    seen = monitor.num_late
    began = time.monotonic()
    sum(range(count))  # one C call: the interpreter is not let go until it returns
    took.append(time.monotonic() - began)
    if took[-1] < 5 * monitor.warn_s:  # too short to be sure of a warning: the test goes on
        return
    # Still here, running Python, when the probe looks (another thread may get the interpreter
    # first once the hold ends); a deadline as the last guard.
    deadline = time.monotonic() + 60.0
    while monitor.num_late == seen and time.monotonic() < deadline:
        pass


def test_a_thread_that_keeps_the_interpreter_is_logged_with_where_it_was(caplog):
    warn_s = 0.02
    monitor = GilHoldMonitor(warn_s, interval_s=0.002, warn_every_s=0.0)
    took: list[float] = []
    count = 1 << 16
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.gil_holds"):
        monitor.start()
        try:
            deadline = time.monotonic() + 60.0
            while monitor.max_late_s == 0.0 and time.monotonic() < deadline:
                time.sleep(0.001)  # the probe has woken once: it sleeps when a hold begins
            # Holds twice as long each time, until one lasts 5x the warning (however fast
            # this machine sums).
            while not took or took[-1] < 5 * warn_s:
                count *= 2
                caplog.clear()
                holder = threading.Thread(
                    target=hold_the_interpreter, args=(count, took, monitor), name="holder"
                )
                holder.start()
                holder.join()
        finally:
            monitor.stop()
    hold_s = took[-1]
    assert monitor.num_late >= 1
    # The probe asleep when the hold began waited for at least most of it.
    assert monitor.max_late_s >= hold_s - 2 * monitor.interval_s - warn_s
    records = [r for r in caplog.records if r.name == "sitsd.observability.gil_holds"]
    assert records, "the hold was logged"
    slowest = max(records, key=lambda r: r.gil_wait_ms)
    assert slowest.gil_wait_ms >= 4 * warn_s * 1e3
    assert "holder at test_gil_holds.py" in slowest.getMessage()
    assert "hold_the_interpreter" in slowest.getMessage()


def test_a_stopped_monitor_leaves_no_thread():
    monitor = GilHoldMonitor(0.05)
    monitor.start()
    assert any(t.name == "sitsd-gil-holds" for t in threading.enumerate())
    monitor.stop()
    assert not any(t.name == "sitsd-gil-holds" for t in threading.enumerate())
