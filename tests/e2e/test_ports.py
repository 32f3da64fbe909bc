"""A port another daemon holds is never shared: the second `sitsd serve` on it exits at once.

gRPC servers turn SO_REUSEPORT on by default, so a second daemon on a taken gRPC port used to
bind it as well and clients were spread over both. Every port (gRPC, /metrics, HTTP) must fail
the second daemon with one clear line and exit status 1, before it loads anything.
"""

from __future__ import annotations

import re
import time
from collections.abc import Iterator

import pytest

from tests.e2e.daemon_process import DaemonProcess

pytestmark = pytest.mark.slow

METRICS_LISTENING = re.compile(r"metrics on http://\S+:(\d+)/metrics")
HTTP_PORT = re.compile(r"http on http://\S+:(\d+)/v1")


@pytest.fixture(scope="module")
def first(tmp_path_factory) -> Iterator[tuple[DaemonProcess, dict[str, int]]]:
    """A daemon holding its three ports (still loading its model is enough)."""
    process = DaemonProcess(tmp_path_factory.mktemp("first"), "--model", "default")
    try:
        process.wait_for_port()
        ports = {"--port": process.port}
        for flag, pattern in (("--metrics-port", METRICS_LISTENING), ("--http-port", HTTP_PORT)):
            ports[flag] = int(wait_for_match(process, pattern))
        yield process, ports
    finally:
        assert process.terminate() == 0, process.log


def wait_for_match(process: DaemonProcess, pattern: re.Pattern[str]) -> str:
    deadline = time.monotonic() + 120
    while True:
        match = pattern.search(process.log)
        if match:
            return match.group(1)
        assert process.proc.poll() is None, process.log
        assert time.monotonic() < deadline, f"no {pattern.pattern!r} in:\n{process.log}"
        time.sleep(0.05)


@pytest.mark.parametrize(
    ("flag", "message"),
    [
        ("--port", "cannot listen on 127.0.0.1:{port}: the port is in use"),
        ("--metrics-port", "cannot serve metrics on port {port}: "),
        ("--http-port", "cannot serve the HTTP API on port {port}: "),
    ],
)
def test_a_second_daemon_on_a_taken_port_exits_1_with_one_clear_line(
    first, tmp_path, flag, message
):
    _, ports = first
    port = ports[flag]
    second = DaemonProcess(tmp_path, "--model", "default", flag, str(port))
    try:
        code = second.proc.wait(120)
    finally:
        second.terminate()
    assert code == 1, second.log
    assert message.format(port=port) in second.log
    assert "Traceback" not in second.log
    assert "loading model" not in second.log  # refused before anything was loaded
