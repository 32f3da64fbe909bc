"""Helpers for the observability tests: the Prometheus binaries, free ports, polling."""

from __future__ import annotations

import shutil
import socket
import time

INSTALL_HINT = (
    "is not installed: run `make test` (it installs Debian's `prometheus` package, which "
    "ships prometheus and promtool), or `apt-get install -y prometheus`"
)


def require_binary(name: str) -> str:
    """The path of `name`; fails (never skips) with how to install it."""
    path = shutil.which(name)
    if path is None:
        raise AssertionError(f"{name} {INSTALL_HINT}")
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, timeout: float, what: str = "condition", interval: float = 0.05):
    """Poll `predicate` until it returns something truthy; that value, or fail after `timeout`."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not met within {timeout:.0f}s")
        time.sleep(interval)
