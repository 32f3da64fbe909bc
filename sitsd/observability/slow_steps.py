"""Slow engine steps: a step far longer than the engine's recent ones holds up every stream at
once. `SlowStepLog` keeps the recent periods between busy steps (the inter-token latency with
asynchronous scheduling), and logs a warning for a step whose period is `factor` times their
median and at least `min_s` (at most one per `warn_every_s`), with what the step carried
(tokens, prompt chunks, versions, a swap's work, migrated or preempted requests) and how its
period split between the engine thread's own work (scheduling, the runner's launch, the
update, and the rest of the loop's turn) and its wait for the device, so a stall a benchmark
sees can be told apart: a step that did more, or one that did the usual and took longer (on
the host: a garbage collection, `sitsd.observability.gc_pauses`, or another thread holding the
interpreter or a driver lock; or on the device: other work sharing it).

When the telemetry observer calls it is `sitsd.observability.telemetry`'s business.
"""

from __future__ import annotations

import logging
import statistics
from collections import deque

from sitsd.engine.observer import StepRecord
from sitsd.outputs import SwapWork

log = logging.getLogger(__name__)

_WINDOW = 128  # busy periods the median is taken over
_REFRESH_EVERY = 32  # steps between two medians (cheap enough for every step)
_IDLE_GAP_S = 0.005  # a step that started this long after the last one ended: after idling


class SlowStepLog:
    """Logs engine steps much slower than the recent ones (engine thread)."""

    def __init__(self, factor: float = 3.0, min_s: float = 0.02, warn_every_s: float = 1.0) -> None:
        """Args:
        factor: a step this many times the recent median period is slow...
        min_s: ...and this long at least.
        warn_every_s: at most one warning per this long (every slow step is counted).
        """
        self.factor = factor
        self.min_s = min_s
        self.warn_every_s = warn_every_s
        self.num_slow = 0
        self._periods: deque[float] = deque(maxlen=_WINDOW)
        self._median: float | None = None  # of `_periods`, every `_REFRESH_EVERY` of them
        self._num_periods = 0
        self._last_end: float | None = None
        self._last_warning = float("-inf")

    def observe(self, step: StepRecord) -> None:
        last_end, self._last_end = self._last_end, step.end
        if last_end is None or step.start - last_end > _IDLE_GAP_S:
            return  # the first step, or one after the engine idled: no period
        period = step.end - last_end
        median = self._median
        if median is not None and period >= max(self.factor * median, self.min_s):
            self.num_slow += 1
            if step.end - self._last_warning >= self.warn_every_s:
                self._last_warning = step.end
                self._warn(step, period, median)
        self._periods.append(period)
        self._num_periods += 1
        if self._num_periods % _REFRESH_EVERY == 0:
            self._median = statistics.median(self._periods)

    def _warn(self, step: StepRecord, period: float, median: float) -> None:
        out = step.sched_out
        num_requests = len(out.num_scheduled_tokens)
        work = out.swap_work
        fields = {
            "step_index": step.index,
            "step_ms": round(period * 1e3, 2),
            "median_step_ms": round(median * 1e3, 2),
            "num_requests": num_requests,
            "num_tokens": out.total_num_scheduled_tokens,
            "num_new_requests": len(out.new_reqs),
            "num_migrated": len(out.migrated),
            "num_preempted": len(out.preempted_req_ids),
            "swap_work_tokens": work.num_tokens if work is not None else 0,
            "swap_work_alone": work.alone if work is not None else False,
            "swap_work_limit": work.limit if work is not None else "",
            "swap_work_token_ms": round(work.per_token_s * 1e3, 3) if work is not None else 0.0,
            "swap_work_smallest_ms": round(work.smallest_s * 1e3, 3) if work is not None else 0.0,
            "serving_versions": work.num_serving_versions if work is not None else 0,
            "scheduled_ahead": out.applied_ahead,
            "device_wait_ms": round(step.wait_s * 1e3, 2),
            "host_ms": round((period - step.wait_s) * 1e3, 2),
            "schedule_ms": round(step.host.schedule_s * 1e3, 2),
            "launch_ms": round(step.host.launch_s * 1e3, 2),
            "update_ms": round(step.host.update_s * 1e3, 2),
        }
        host = step.host
        other_s = period - step.wait_s - host.schedule_s - host.launch_s - host.update_s
        fields["other_host_ms"] = round(other_s * 1e3, 2)
        log.warning(
            "engine step %d took %.1f ms (%.1fx the recent median): %d requests, %d tokens, "
            "%d of a swap's work%s; %.1f ms waiting for the device, %.1f ms on the host "
            "(scheduling %.1f, launch %.1f, update %.1f, the rest %.1f)",
            step.index,
            period * 1e3,
            period / median,
            num_requests,
            out.total_num_scheduled_tokens,
            fields["swap_work_tokens"],
            _limit_text(work),
            step.wait_s * 1e3,
            (period - step.wait_s) * 1e3,
            host.schedule_s * 1e3,
            host.launch_s * 1e3,
            host.update_s * 1e3,
            other_s * 1e3,
            extra=fields,
        )


def _limit_text(work: SwapWork | None) -> str:
    """` (share, 1.25 ms a token, the smallest piece 1.3 ms)`: what set the size of the
    step's swap work."""
    if work is None or not work.limit:
        return ""
    price = f", {work.per_token_s * 1e3:.3g} ms a token" if work.per_token_s else ""
    if work.smallest_s:
        price += f", the smallest piece {work.smallest_s * 1e3:.3g} ms"
    return f" ({work.limit}{price})"
