"""A process the benchmarks start for the daemon ends when the benchmark is killed."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait unreaped for a while)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


@pytest.mark.skipif(sys.platform != "linux", reason="the parent-death signal is Linux's")
def test_a_tied_child_is_terminated_when_its_caller_is_sigkilled():
    # A stand-in for a benchmark: starts a long child through start_tied and waits.
    benchmark = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(
            """
            import subprocess, sys, time
            from bench.daemon import start_tied
            child = start_tied([sys.executable, "-c", "import time; time.sleep(3600)"])
            print(child.pid, flush=True)
            time.sleep(3600)
            """
        )],
        cwd=REPO_ROOT, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    child = 0
    try:
        assert benchmark.stdout is not None
        child = int(benchmark.stdout.readline())
        assert _running(child)
        benchmark.send_signal(signal.SIGKILL)  # no finally, no stop(): as a killed run
        benchmark.wait(60)
        deadline = time.monotonic() + 120  # a last guard: the kernel signals it at once
        while _running(child):
            assert time.monotonic() < deadline, "the child outlived its caller"
            time.sleep(0.05)
    finally:
        benchmark.kill()
        if child and _running(child):
            os.kill(child, signal.SIGKILL)


@pytest.mark.usefixtures("bench_package")  # `bench` importable (tests/conftest.py)
def test_a_slow_steps_host_split_is_read_from_the_daemons_log_entry():
    from bench.daemon import host_parts

    entry = {"step_ms": 14.0, "schedule_ms": 1.26, "launch_ms": 6.04, "update_ms": 0.5,
             "other_host_ms": 2.0}  # fmt: skip
    assert host_parts(entry) == ", host: scheduling 1.3, launch 6.0, update 0.5, rest 2.0 ms"
    del entry["launch_ms"]  # a daemon from before the split
    assert host_parts(entry) == ""
