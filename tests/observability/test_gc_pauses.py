"""GcPauseMonitor: every collection timed, a long one logged with its generation."""

from __future__ import annotations

import gc
import logging
import random

from sitsd.observability.gc_pauses import GcPauseMonitor


def cycles(n: int) -> None:
    """`n` two-object reference cycles, unreachable once this returns."""
    for _ in range(n):
        a: dict[str, object] = {"v": random.random()}
        b = {"a": a}
        a["b"] = b


def test_a_long_collection_is_timed_and_logged_with_its_generation(caplog):
    monitor = GcPauseMonitor(warn_s=0.0)
    num = random.randrange(20_000, 40_000)
    monitor.start()
    gc.disable()  # the cycles wait for the collection below
    try:
        cycles(num)
        with caplog.at_level(logging.WARNING, logger="sitsd.observability.gc_pauses"):
            freed = gc.collect()
    finally:
        gc.enable()
        monitor.stop()
    assert freed >= 2 * num
    assert monitor.num_collections >= 1
    assert monitor.max_pause_s > 0
    records = [r for r in caplog.records if r.name == "sitsd.observability.gc_pauses"]
    assert records, "the collection was logged"
    assert records[-1].gc_generation == 2
    assert records[-1].gc_collected >= 2 * num


def test_a_stopped_monitor_times_nothing():
    monitor = GcPauseMonitor()
    monitor.start()
    monitor.stop()
    gc.collect()
    assert monitor.num_collections == 0
    assert monitor._on_gc not in gc.callbacks
