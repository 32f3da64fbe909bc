"""SlowStepLog: a step far past the recent busy periods is logged with what it carried."""

from __future__ import annotations

import itertools
import logging
import random

from sitsd.engine.observer import HostTimes, StepRecord
from sitsd.observability.slow_steps import SlowStepLog
from sitsd.outputs import SchedulerOutput, SwapWork


def step(
    index: int,
    start: float,
    end: float,
    tokens: int = 8,
    swap: int = 0,
    wait: float = 0.0,
    host: HostTimes | None = None,
) -> StepRecord:
    out = SchedulerOutput()
    for i in range(tokens):
        out.num_scheduled_tokens[f"r{i}"] = 1
    out.total_num_scheduled_tokens = tokens + swap
    out.swap_work = SwapWork(swap, swap > 0, 1, "spaced" if swap else "", 0.00125 if swap else 0,
                             0.0051 if swap else 0)  # fmt: skip
    return StepRecord(out, [], start, end, index, wait, host or HostTimes())


def busy_steps(log: SlowStepLog, periods: list[float], t: float = 0.0) -> float:
    """Back-to-back steps of these periods (each starts as the last one ends); the end."""
    for i, period in enumerate(periods):
        log.observe(step(i + 1, t, t + period))
        t += period
    return t


def test_a_step_far_past_the_recent_ones_is_logged_with_its_swap_work(caplog):
    slow = SlowStepLog(factor=3.0, min_s=0.02)
    base = random.uniform(0.004, 0.006)
    t = busy_steps(slow, [base * random.uniform(0.9, 1.1) for _ in range(100)])
    long = random.uniform(0.03, 0.09)
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.slow_steps"):
        slow.observe(step(101, t, t + long, swap=37))
    (record,) = caplog.records
    assert record.step_index == 101
    assert abs(record.step_ms - long * 1e3) < 0.01
    assert record.swap_work_tokens == 37
    assert record.swap_work_alone
    assert record.swap_work_limit == "spaced"
    assert record.swap_work_token_ms == 1.25
    assert record.swap_work_smallest_ms == 5.1  # what the pacer weighed against the share
    assert "37 of a swap's work (spaced, 1.25 ms a token, the smallest piece 5.1 ms);" in (
        record.getMessage()
    )
    assert abs(record.median_step_ms - base * 1e3) < 0.15 * base * 1e3
    assert slow.num_slow == 1


def test_a_slow_step_says_how_long_it_waited_for_the_device_and_how_long_the_host_took(caplog):
    slow = SlowStepLog(factor=2.0, min_s=0.01)
    t = busy_steps(slow, [0.005] * 100)
    long, wait = random.uniform(0.02, 0.05), random.uniform(0.001, 0.015)
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.slow_steps"):
        slow.observe(step(101, t, t + long, wait=wait))
    (record,) = caplog.records
    assert abs(record.device_wait_ms - wait * 1e3) < 0.01
    assert abs(record.host_ms - (long - wait) * 1e3) < 0.01
    assert f"{wait * 1e3:.1f} ms waiting for the device" in record.getMessage()


def test_a_slow_step_splits_the_hosts_time_into_scheduling_launch_update_and_the_rest(caplog):
    slow = SlowStepLog(factor=2.0, min_s=0.01)
    t = busy_steps(slow, [0.005] * 100)
    wait = random.uniform(0.001, 0.005)
    host = HostTimes(*(random.uniform(0.001, 0.004) for _ in range(3)))
    rest = random.uniform(0.011, 0.02)  # past 2x the 5 ms steps, whatever the other parts
    long = wait + host.schedule_s + host.launch_s + host.update_s + rest
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.slow_steps"):
        slow.observe(step(101, t, t + long, wait=wait, host=host))
    (record,) = caplog.records
    assert abs(record.schedule_ms - host.schedule_s * 1e3) < 0.01
    assert abs(record.launch_ms - host.launch_s * 1e3) < 0.01
    assert abs(record.update_ms - host.update_s * 1e3) < 0.01
    assert abs(record.other_host_ms - rest * 1e3) < 0.02
    assert (
        f"(scheduling {host.schedule_s * 1e3:.1f}, launch {host.launch_s * 1e3:.1f}, "
        f"update {host.update_s * 1e3:.1f}, the rest {rest * 1e3:.1f})"
    ) in record.getMessage()


def test_steady_steps_and_a_step_after_idling_are_not_logged(caplog):
    slow = SlowStepLog(factor=3.0, min_s=0.02)
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.slow_steps"):
        t = busy_steps(slow, [random.uniform(0.009, 0.011) for _ in range(200)])
        slow.observe(step(201, t + 2.0, t + 2.01))  # the engine waited 2 s for work
        busy_steps(slow, [random.uniform(0.009, 0.011) for _ in range(50)], t + 2.01)
    assert not caplog.records
    assert slow.num_slow == 0


def test_warnings_come_at_most_one_per_interval_and_every_slow_step_is_counted(caplog):
    every = random.choice([0.05, 0.2])
    slow = SlowStepLog(factor=1.5, min_s=0.008, warn_every_s=every)
    t = busy_steps(slow, [0.005] * 100)
    ends = []
    with caplog.at_level(logging.WARNING, logger="sitsd.observability.slow_steps"):
        for i in range(40):  # a 12 ms step every 25 ms of 5 ms steps
            t = busy_steps(slow, [0.005] * 3, t)
            slow.observe(step(1000 + i, t, t + 0.012))
            t += 0.012
            ends.append(t)
    assert slow.num_slow == 40
    logged = [r.step_index - 1000 for r in caplog.records]
    assert logged[0] == 0
    # One warning per interval: each logged step is the first slow one `every` after the last.
    for a, b in itertools.pairwise(logged):
        assert ends[b] - ends[a] >= every
        assert ends[b - 1] - ends[a] < every
    spacing = ends[1] - ends[0]  # between two slow steps
    assert len(logged) >= int((ends[-1] - ends[0]) / (every + spacing))
