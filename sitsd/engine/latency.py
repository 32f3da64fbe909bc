"""Streaming latency percentiles per SLA tier, over a sliding time window.

The estimator is a time-windowed sample buffer: a ring of `(time, value)` pairs holding the
samples of the last `window_s` seconds, at most `max_samples` of them. A quantile is exact over
what the ring holds (sort on query, nearest-rank). Cost: O(1) amortised per sample, O(n log n)
per query, where queries come once per controller interval (0.5 s by default), not per token.
Error: none while the ring holds the whole window; when more than `max_samples` samples arrive
within one window the oldest are dropped first, so the estimate then covers the most recent
`max_samples` samples (a shorter window), never a biased subset of them. Memory is bounded by
`max_samples` floats per series.

Why not a sketch (DDSketch, t-digest): at engine-step rates (tens of tokens per second per
request, a few thousand samples per window) exact order statistics are cheap, and a sliding
window over a sketch needs bucket rotation that adds its own staleness. What the percentiles
drive is `sitsd.engine.tiers`' business.
"""

from __future__ import annotations

import math
from collections import deque


class SlidingWindowQuantile:
    """Exact quantiles of the samples seen in the last `window_s` seconds."""

    def __init__(self, window_s: float, max_samples: int = 4096) -> None:
        """Args:
        window_s: samples older than this (relative to the latest `now`) are forgotten.
        max_samples: at most this many samples are kept; the oldest go first.
        """
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)

    def add(self, now: float, value: float) -> None:
        """Record `value` observed at time `now` (times must not go backwards)."""
        self._samples.append((now, value))

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._samples and self._samples[0][0] < horizon:
            self._samples.popleft()

    def count(self, now: float) -> int:
        """How many samples the window holds at `now`."""
        self._expire(now)
        return len(self._samples)

    def quantile(self, q: float, now: float) -> float | None:
        """The nearest-rank `q`-quantile (0 < q <= 1) of the window; None when it is empty."""
        self._expire(now)
        if not self._samples:
            return None
        values = sorted(v for _, v in self._samples)
        rank = max(1, math.ceil(q * len(values)))  # nearest rank: P99 of 100 samples is the 99th
        return values[rank - 1]


class TierLatency:
    """TTFT and inter-token latency windows of one tier."""

    def __init__(self, window_s: float, max_samples: int = 4096) -> None:
        self.ttft = SlidingWindowQuantile(window_s, max_samples)
        self.itl = SlidingWindowQuantile(window_s, max_samples)

    def p99(self, now: float) -> tuple[float | None, float | None, int, int]:
        """(TTFT P99, ITL P99, TTFT samples, ITL samples) over the window at `now`."""
        ttft, itl = self.ttft.quantile(0.99, now), self.itl.quantile(0.99, now)
        return ttft, itl, self.ttft.count(now), self.itl.count(now)
