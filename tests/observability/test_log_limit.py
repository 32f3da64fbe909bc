"""Log lines a client can cause pass at a bounded rate per key; the next one says how many were
dropped."""

from __future__ import annotations

import logging
import random

from sitsd.observability.log_limit import RateLimitedLog


class Clock:
    def __init__(self) -> None:
        self.now = random.uniform(0, 1e6)

    def __call__(self) -> float:
        return self.now


def test_each_key_gets_its_burst_per_interval_then_the_next_line_counts_the_dropped(caplog):
    caplog.set_level(logging.INFO, logger="test.limit")
    clock = Clock()
    burst, interval = random.randint(1, 6), random.uniform(1, 30)
    limited = RateLimitedLog(
        logging.getLogger("test.limit"), burst=burst, interval_s=interval, clock=clock
    )
    num_calls = burst + random.randint(1, 50)

    logged = [limited.log(logging.INFO, "a", "line %d", i) for i in range(num_calls)]
    other = limited.log(logging.INFO, "b", "other key")

    assert logged == [True] * burst + [False] * (num_calls - burst)
    assert other  # another key has a burst of its own
    assert [r.getMessage() for r in caplog.records] == [
        *(f"line {i}" for i in range(burst)),
        "other key",
    ]
    caplog.clear()
    clock.now += interval * 0.999
    assert not limited.log(logging.INFO, "a", "still inside the interval")
    clock.now += interval * 0.002
    assert limited.log(logging.INFO, "a", "next interval", extra={"field": 1})
    (record,) = caplog.records
    assert record.suppressed == num_calls - burst + 1
    assert record.field == 1
    assert 0.999 * interval <= record.suppressed_for_s <= 1.002 * interval


def test_a_disabled_level_is_neither_logged_nor_counted(caplog):
    caplog.set_level(logging.WARNING, logger="test.limit")
    limited = RateLimitedLog(logging.getLogger("test.limit"), burst=1, clock=Clock())
    assert not limited.log(logging.INFO, "k", "below the level")
    assert limited.log(logging.WARNING, "k", "first at the level")
    assert caplog.records[-1].getMessage() == "first at the level"
    assert not hasattr(caplog.records[-1], "suppressed")
