"""Start the real `sitsd serve` as a subprocess and wait until it serves; stop it with a signal."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[2]
LISTENING = re.compile(r"listening on (\S+):(\d+)")
HTTP_LISTENING = re.compile(r"http on (http://\S+/v1)")
# The deadline of a test's call or wait that is not about time: only a hung daemon reaches it,
# however busy the machine (a loaded 2-core CI runner takes minutes where an idle one takes
# seconds). The calls and waits end as soon as their condition holds.
LAST_GUARD_S = 600.0


def process_env(state_dir: Path) -> dict[str, str]:
    """Environment for sitsd/sitsctl processes: this checkout importable, state in `state_dir`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SITSD_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    env["SITSD_STATE_DIR"] = str(state_dir)
    return env


class DaemonProcess:
    """`python -m sitsd serve --port 0 ...`; its stdout and stderr are collected in `log_lines`.

    /metrics and the HTTP API get free ports too (`--metrics-port 0`, `--http-port 0`) unless
    the flags choose them.
    """

    def __init__(self, state_dir: Path, *flags: str) -> None:
        self.state_dir = state_dir
        self.env = process_env(state_dir)
        self.log_lines: list[str] = []
        if "--metrics-port" not in flags and "--no-metrics" not in flags:
            flags = ("--metrics-port", "0", *flags)
        if "--http-port" not in flags and "--no-http" not in flags:
            flags = ("--http-port", "0", *flags)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "sitsd",
                "serve",
                "--port",
                "0",
                "--state-dir",
                str(state_dir),
                *flags,
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,  # the log lines (JSON: stdout is not a terminal)
            stderr=subprocess.STDOUT,
            text=True,
            env=self.env,
        )
        # A reader thread: an unread pipe would fill up and block the daemon's logging.
        self._reader = threading.Thread(target=self._read_output, daemon=True)
        self._reader.start()
        self.port = 0

    def _read_output(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log_lines.append(line)

    @property
    def log(self) -> str:
        return "".join(self.log_lines)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def http_url(self) -> str:
        """Base URL of the OpenAI-compatible API (`.../v1`), from the start-up log."""
        match = HTTP_LISTENING.search(self.log)
        assert match, f"no 'http on' line in the log:\n{self.log}"
        return match.group(1)

    def wait_for_port(self, timeout: float = 300.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            match = LISTENING.search(self.log)
            if match:
                self.port = int(match.group(2))
                return self.port
            self._check_alive(deadline, "a 'listening on' line")
            time.sleep(0.05)

    def wait_until_serving(self, timeout: float = 600.0) -> None:
        """Wait for the port, then for health SERVING.

        A check that times out or finds the server unreachable is asked again: a daemon
        loading its model on a busy machine may answer late. `timeout` is the last guard only.
        """
        deadline = time.monotonic() + timeout
        self.wait_for_port(timeout)
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                if self._health(health) == health_pb2.HealthCheckResponse.SERVING:
                    return
                self._check_alive(deadline, "health SERVING")
                time.sleep(0.1)

    @staticmethod
    def _health(health: health_pb2_grpc.HealthStub) -> int | None:
        """The health status, or None when the check timed out or found no server (yet)."""
        retry = (grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.UNAVAILABLE)
        try:
            return health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        except grpc.RpcError as exc:
            if exc.code() not in retry:
                raise
            return None

    def _check_alive(self, deadline: float, waiting_for: str) -> None:
        if self.proc.poll() is not None:
            raise AssertionError(
                f"sitsd exited ({self.proc.returncode}) before {waiting_for}:\n{self.log}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(f"no {waiting_for} from sitsd in time:\n{self.log}")

    def admin_token(self) -> str:
        return (self.state_dir / "admin-token").read_text().strip()

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM and wait for the exit status (killed if it does not exit in time)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self._reader.join(5)


@contextlib.contextmanager
def serving(state_dir: Path, *flags: str) -> Iterator[DaemonProcess]:
    """A daemon serving for the `with` block; on leaving, SIGTERM must make it exit 0."""
    process = DaemonProcess(state_dir, *flags)
    try:
        process.wait_until_serving()
        yield process
    finally:
        assert process.terminate() == 0, process.log


def tiers_file(directory: Path, text: str) -> str:
    """Write a `--tiers` file into `directory`; its path, for the flag."""
    path = directory / "tiers.yaml"
    path.write_text(text)
    return str(path)
