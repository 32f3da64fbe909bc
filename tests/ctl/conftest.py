"""Fixtures: a fake-engine server on a background thread and a runner for `sitsctl` processes."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.api.fake_engine import FakeEngine
from tests.api.harness import ADMIN_TOKEN, ServerThread

REPO_ROOT = Path(__file__).resolve().parents[2]

RunCtl = Callable[..., subprocess.CompletedProcess[str]]


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.stop()


@pytest.fixture
def engine(server: ServerThread) -> FakeEngine:
    return server.attach(FakeEngine())


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(ADMIN_TOKEN + "\n")
    return path


@pytest.fixture
def ctl_env(tmp_path: Path) -> dict[str, str]:
    """The environment of a sitsctl process: no SITSD_* from the developer's shell."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITSD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["SITSD_STATE_DIR"] = str(tmp_path / "state")  # where the default token file would be
    return env


def ctl_command(address: str, *args: str) -> list[str]:
    return [sys.executable, "-m", "sitsd.ctl", "--address", address, *args]


@pytest.fixture
def run_ctl(server: ServerThread, ctl_env: dict[str, str]) -> RunCtl:
    """Run `sitsctl --address <the test server> ARGS...` to completion."""

    def run(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ctl_command(server.address, *args),
            capture_output=True,
            text=True,
            env=env or ctl_env,
            timeout=60,
        )

    return run
