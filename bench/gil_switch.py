"""How long an engine-like step waits for the GIL next to a thread running Python, by switch
interval. The step makes 40 calls that release the GIL (20 small matmuls, 20 `sleep(0)`, as
a step's torch calls and device waits do), with `--python-ms` of pure Python spread between
them (the scheduler's and the update's share of a step); a second thread runs a pure-Python
loop, as the stager, the canary's comparison or a /metrics scrape does between two of its
waits. Each time the step asks for the GIL back, it waits until the busy thread has run for
the switch interval: the step's median and maximum time, alone and next to the busy thread,
at Python's default 5 ms and at the daemon's `--gil-switch-interval` default.

    python -m bench.gil_switch [--steps 50] [--intervals 0.005,0.0005] [--python-ms 1.5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch


def step(a: torch.Tensor, python_s: float = 0.0) -> float:
    started = time.perf_counter()
    for _ in range(20):
        until = time.thread_time() + python_s / 20
        while time.thread_time() < until:  # the step's own Python
            pass
        torch.mm(a, a)  # releases the GIL
        time.sleep(0)  # as a wait for the device does
    return time.perf_counter() - started


def busy(stop: threading.Event, rounds: list[int]) -> None:
    """Rounds of pure Python until `stop`; their count is appended to `rounds`."""
    x, count = 0, 0
    while not stop.is_set():
        for i in range(1000):
            x += i
        count += 1
    rounds.append(count)


def busy_rate(seconds: float) -> float:
    """The busy loop's rounds per second with the interpreter to itself."""
    stop, rounds = threading.Event(), []
    thread = threading.Thread(target=busy, args=(stop, rounds))
    thread.start()
    time.sleep(seconds)
    stop.set()
    thread.join()
    return rounds[0] / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--intervals", default="0.005,0.0005", help="switch intervals, seconds")
    parser.add_argument("--python-ms", type=float, default=0.0, help="the step's own Python")
    args = parser.parse_args()
    torch.set_num_threads(1)
    a = torch.randn(64, 64)
    python_s = args.python_ms / 1e3
    before = sys.getswitchinterval()
    print("switch interval | step alone (median) | next to a busy thread: median / max (ms)"
          " | the busy thread's rate beside the steps")  # fmt: skip
    try:
        for interval in (float(x) for x in args.intervals.split(",")):
            sys.setswitchinterval(interval)
            alone = statistics.median(step(a, python_s) for _ in range(args.steps))
            stop, rounds = threading.Event(), []
            thread = threading.Thread(target=busy, args=(stop, rounds))
            started = time.perf_counter()
            thread.start()
            try:
                times = [step(a, python_s) for _ in range(args.steps)]
            finally:
                stop.set()
                thread.join()
            rate = rounds[0] / (time.perf_counter() - started) / busy_rate(0.5)
            print(f"{interval * 1e3:8.2f} ms      | {alone * 1e3:10.2f} ms       | "
                  f"{statistics.median(times) * 1e3:.2f} / {max(times) * 1e3:.2f}"
                  f"        | {rate:.2f} of alone")  # fmt: skip
    finally:
        sys.setswitchinterval(before)


if __name__ == "__main__":
    main()
