"""The event-loop lag monitor: a blocking call on the loop is measured and named."""

from __future__ import annotations

import asyncio
import logging
import time

from sitsd.observability.loop_lag import LoopLagMonitor


def test_a_blocking_call_on_the_loop_is_measured_and_logged(caplog):
    lags: list[float] = []

    async def run() -> LoopLagMonitor:
        monitor = LoopLagMonitor(lags.append, interval_s=0.01, warn_s=0.2)
        monitor.start()
        await asyncio.sleep(0.1)  # some on-time wake-ups first
        time.sleep(0.4)  # what an fsync behind a busy disk does to the loop
        await asyncio.sleep(0.1)
        await monitor.stop()
        return monitor

    with caplog.at_level(logging.WARNING, logger="sitsd.observability.loop_lag"):
        monitor = asyncio.run(run())
    assert 0.35 <= monitor.max_lag_s < 1.0
    assert max(lags) == monitor.max_lag_s
    assert sorted(lags)[len(lags) // 2] < 0.05  # most wake-ups were on time
    (record,) = [r for r in caplog.records if "event loop stalled" in r.getMessage()]
    assert record.lag_ms >= 350


def test_an_idle_loop_never_warns(caplog):
    async def run() -> None:
        monitor = LoopLagMonitor(interval_s=0.01, warn_s=0.5)  # room for a busy CI machine
        monitor.start()
        await asyncio.sleep(0.3)
        await monitor.stop()

    with caplog.at_level(logging.WARNING, logger="sitsd.observability.loop_lag"):
        asyncio.run(run())
    assert not [r for r in caplog.records if "event loop stalled" in r.getMessage()]
