"""The one way the benchmarks time work, and the percentiles they report.

- `median_ms(fn)`: warm-up calls, then `repeats` calls timed one at a time; the median in
  milliseconds. The clock is CUDA events on the current stream where there is a GPU (GPU time
  from the start event to the end event: a call whose launch the GPU waits for counts the
  wait) and `time.perf_counter` otherwise. `clock="host"` takes the host's time of a call on
  a GPU too (a wrapper's checks and launches, its kernels left queued). `flush_l2` writes a
  buffer larger than the L2 before each call, so that no call finds its inputs there.
- `graph_ms(calls)`: one CUDA graph holding `calls` back to back, replayed and timed with
  `median_ms`: the median replay over the number of calls, without launch overhead (the
  runtime decodes in graphs).
- `now()`: the host clock, for the benchmarks that take timestamps inside a run (a first
  token, a token's arrival, a step's host share).
- `percentile`: nearest rank, the rule of the daemon's estimator and of `sitsctl bench`.

What a time means (bytes, FLOPs, tokens per second) is each benchmark's business; the hardware
floors they divide by are `bench.floors`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Literal

import torch

from sitsd.ctl.bench_report import percentile

__all__ = ["Clock", "graph_ms", "median_ms", "now", "percentile", "samples_ms"]

Clock = Literal["cuda", "host"]
# Written before each call with `flush_l2`: past the L2 of any GPU so far (an H200 has 60 MiB),
# the size `triton.testing.do_bench` flushes.
L2_FLUSH_BYTES = 256 * 2**20


def now() -> float:
    """Seconds on the host clock the benchmarks share (`time.perf_counter`)."""
    return time.perf_counter()


def default_clock() -> Clock:
    """CUDA events where there is a GPU, the host clock otherwise."""
    return "cuda" if torch.cuda.is_available() else "host"


def samples_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 20,
    clock: Clock | None = None,
    flush_l2: bool = False,
) -> list[float]:
    """Milliseconds of each of `repeats` calls of `fn`, after `warmup` untimed calls."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    clock = clock or default_clock()
    for _ in range(warmup):
        fn()
    if clock == "host":
        return _host_samples_ms(fn, repeats)
    flush = torch.empty(L2_FLUSH_BYTES, dtype=torch.int8, device="cuda") if flush_l2 else None
    times = []
    for _ in range(repeats):
        if flush is not None:
            flush.zero_()  # queued ahead of the start event: the GPU runs it while fn launches
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return times


def _host_samples_ms(fn: Callable[[], object], repeats: int) -> list[float]:
    # GPU work queued before the first call or by the last one would run into the next
    # measurement: the GPU starts and ends idle, outside the timed calls.
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    if on_gpu:
        torch.cuda.synchronize()
    return times


def median_ms(
    fn: Callable[[], object],
    *,
    warmup: int = 3,
    repeats: int = 20,
    clock: Clock | None = None,
    flush_l2: bool = False,
) -> float:
    """Median milliseconds of one call of `fn` (see `samples_ms` and the module docstring)."""
    return statistics.median(
        samples_ms(fn, warmup=warmup, repeats=repeats, clock=clock, flush_l2=flush_l2)
    )


def graph_ms(calls: Sequence[Callable[[], object]], *, replays: int = 10) -> float:
    """Median milliseconds per call of one CUDA graph holding `calls` back to back.

    The calls run once on a side stream first (as torch's CUDA-graph docs warm up), then are
    captured; the graph is replayed once untimed and `replays` times timed.
    """
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    return median_ms(graph.replay, warmup=1, repeats=replays, clock="cuda") / len(calls)
