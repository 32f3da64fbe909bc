"""bench_push's timeline reads the daemon's own log lines back: an IPC push's parts (the line
`sitsd.weights.push_ipc` writes), its end, and the stall warnings around it, placed on the
clients' clock beside the longest inter-token gaps."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest

from sitsd.weights.push_ipc import PARTS_LINE

pytestmark = pytest.mark.usefixtures("bench_package")  # `bench` importable (tests/conftest.py)


def line(event: str, at: float, **fields: object) -> str:
    stamp = datetime.fromtimestamp(at, UTC).isoformat().replace("+00:00", "Z")
    return json.dumps({"event": event, "timestamp": stamp, **fields})


def test_a_push_s_parts_gaps_and_warnings_land_at_their_offsets_from_its_start(rng):
    from bench.bench_push import ipc_timelines
    from bench.load import Stream

    start = 1.8e9 + rng.randrange(10**6)  # the daemon's start of the push, wall clock
    perf = rng.uniform(100, 1000)  # the same instant on the clients' clock
    # Every part ends a quarter past a whole millisecond: no rounding lands on a half.
    opened, copied, let_go = 2.0, float(rng.randrange(40, 80)), float(rng.randrange(2, 8))  # ms
    open_at = rng.randrange(5, 20) + 0.25
    parts_end = (open_at + opened + copied + let_go) / 1e3
    total = parts_end + 0.05
    log = "\n".join([
        "not a json line",
        line("engine step 7 took 12.0 ms", start + 0.004, step_ms=12.04, num_tokens=32,
             swap_work_tokens=0, device_wait_ms=7.5),
        line("the interpreter was held 6.0 ms", start + 0.009, gil_wait_ms=6.04),
        line(PARTS_LINE % ("push-2-ipc", 1, opened, 0, 291, copied, let_go), start + parts_end),
        line(f"weight push push-2-ipc over ipc: committed in {total:.3f} s (receive "
             f"{parts_end:.3f} s, validate 0.040 s, commit 0.008 s)", start + total),
        line("event loop stalled for 6 ms", start + 5.0, lag_ms=6.2),  # another push's time
    ])  # fmt: skip
    times = [perf - 0.05 + 0.005 * i for i in range(60)]
    gap_at = rng.randrange(15, 40)
    times[gap_at:] = [t + 0.010 for t in times[gap_at:]]  # one 15 ms gap
    (parts, warnings) = ipc_timelines(log, [Stream(started=perf - 1, times=times)], start - perf)
    assert parts.startswith("push-2-ipc: open +")
    assert f"open +{open_at:.0f}, " in parts
    assert f"copied +{open_at + opened + copied:.0f}, " in parts
    assert f"let go +{parts_end * 1e3:.0f}, " in parts
    assert f"committed +{total * 1e3:.0f} ms" in parts
    offset = round((times[gap_at] - perf) * 1e3)
    assert f"15.0 ms at {offset:+d}" in parts
    assert warnings == (
        "    the daemon's warnings (at the end of each): step 12.0 ms (32 tokens, 0 of a "
        "swap's; 7.5 ms waiting for the device) at +4, interpreter held 6.0 ms at +9"
    )


def test_steady_cut_into_windows_gives_each_window_s_own_p99():
    from bench.bench_push import window_p99s
    from bench.load import Stream

    # Two streams, a token every 5 ms; one 25 ms gap in the third 100 ms window.
    times = [round(0.005 * i, 6) for i in range(200)]
    slow = [t if t < 0.24 else t + 0.02 for t in times]
    p99s = window_p99s([Stream(0, times), Stream(0, slow)], 0.0, 1.0, 0.1)
    assert len(p99s) == 10
    assert abs(p99s[2] - 25.0) < 1e-6
    assert all(abs(p - 5.0) < 1e-6 for i, p in enumerate(p99s) if i != 2)
    assert window_p99s([Stream(0, times)], 0.0, 1.0, 0.0) == []
