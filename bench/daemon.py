"""`sitsd serve` in a subprocess, for the benchmarks that drive the real daemon.

Free ports (`--port 0 --metrics-port 0 --http-port 0`), the log in a file, the address and
/metrics URL once health says SERVING, the admin token, the process's RSS, and a stop that
never hangs. This
checkout comes first on the daemon's PYTHONPATH (the caller's entries, such as the GPU
machine's wheels, follow). The daemon ends with the benchmark that started it, even one killed
before its `stop()` (`start_tied`): a daemon left behind would share the next run's cores.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from collections.abc import Sequence
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

REPO_ROOT = Path(__file__).resolve().parents[1]
LISTENING = re.compile(r"listening on (\S+):(\d+)")
METRICS = re.compile(r"metrics on http://(\S+):(\d+)/metrics")


def split_cores(pin: bool = True) -> tuple[set[int] | None, set[int] | None]:
    """(the daemon's cores, the clients' cores): all but the last core, and the last, so that
    clients on the same machine do not take the daemon's CPU (as clients on another machine
    would not); (None, None), any core for both, when `pin` is off or there is one core."""
    cores = sorted(os.sched_getaffinity(0))
    if not pin or len(cores) < 2:
        return None, None
    return set(cores[:-1]), set(cores[-1:])


_PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent thread ends


def start_tied(
    command: Sequence[str], cpus: set[int] | None = None, **popen: object
) -> subprocess.Popen[bytes]:
    """`subprocess.Popen(command, **popen)`, on `cpus` (None: any core), SIGTERMed by the
    kernel when the thread that called this ends, however it ends (on Linux; elsewhere it
    outlives a killed caller). Call it from the thread that lives as long as the child should."""
    prctl = ctypes.CDLL(None, use_errno=True).prctl if sys.platform == "linux" else None
    parent = os.getpid()

    def in_child() -> None:  # between fork and exec: no imports, no allocation to speak of
        if cpus is not None:
            os.sched_setaffinity(0, cpus)
        if prctl is not None:
            prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
            if os.getppid() != parent:  # the caller ended before the line above
                os._exit(1)

    return subprocess.Popen(command, preexec_fn=in_child, **popen)  # type: ignore[call-overload]


class BenchDaemon:
    """A started `sitsd serve`; `wait_until_serving()` before use, `stop()` after."""

    def __init__(
        self,
        state_dir: Path,
        flags: Sequence[str],
        log_path: Path | None = None,
        cpus: set[int] | None = None,
        wrap: Sequence[str] = (),
    ):
        """`cpus`: the cores the daemon (every thread of it) may run on; None: any. `wrap`: a
        command the daemon runs under (a profiler that starts its child, `profiler_wrap`)."""
        state_dir.mkdir(parents=True, exist_ok=True)
        path = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH")) if p)
        self.env = {**os.environ, "PYTHONPATH": path, "SITSD_STATE_DIR": str(state_dir)}
        self.state_dir = state_dir
        self.log_path = log_path or state_dir / f"daemon-{time.monotonic_ns()}.log"
        self._log = self.log_path.open("w")
        # Where the HTTP API's packages are missing (the GPU machine's own python), without it.
        http = ["--http-port", "0"] if importlib.util.find_spec("uvicorn") else ["--no-http"]
        command = [*wrap, sys.executable, "-m", "sitsd", "serve", "--port", "0",
                   "--metrics-port", "0", *http, "--state-dir", str(state_dir),
                   *flags]  # fmt: skip
        self._wrapped = bool(wrap)
        self.proc = start_tied(command, cpus, stdout=self._log, stderr=subprocess.STDOUT,
                               env=self.env, cwd=REPO_ROOT)  # fmt: skip
        self.address = self.metrics_url = ""

    def log_text(self) -> str:
        return self.log_path.read_text()

    def wait_until_serving(self, timeout: float = 600.0) -> BenchDaemon:
        """Wait for health SERVING (the model loaded and warm); raises if the daemon exits."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"sitsd exited:\n{self.log_text()}")
            text = self.log_text()
            listening, metrics = LISTENING.search(text), METRICS.search(text)
            if listening and metrics and self._serving(f"127.0.0.1:{listening.group(2)}"):
                self.address = f"127.0.0.1:{listening.group(2)}"
                self.metrics_url = f"http://127.0.0.1:{metrics.group(2)}/metrics"
                return self
            time.sleep(0.2)
        raise RuntimeError(f"sitsd did not start serving in {timeout:.0f} s:\n{self.log_text()}")

    @staticmethod
    def _serving(address: str) -> bool:
        with grpc.insecure_channel(address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.RpcError:
                return False
        return status.status == health_pb2.HealthCheckResponse.SERVING

    def histograms(self, name: str, label: str = "") -> dict[str, list[tuple[float, float]]]:
        """{label value: [(bucket bound, cumulative count)]} of histogram `name` in the live
        /metrics, its series summed per value of `label` ("" sums them all)."""
        return parse_histograms(self.metrics_text(), name, label)

    def metrics_text(self, names: Sequence[str] = ()) -> str:
        """The live /metrics as text (parse it later, with `parse_histograms`, where parsing
        must not hold the GIL while a load's client thread times tokens); only the samples
        `names` when given (the daemon renders no more: rendering holds its interpreter,
        which its engine's steps wait for)."""
        query = urllib.parse.urlencode([("name[]", name) for name in names])
        url = f"{self.metrics_url}?{query}" if query else self.metrics_url
        with urllib.request.urlopen(url, timeout=10) as response:
            return response.read().decode()

    def token(self) -> str:
        return (self.state_dir / "admin-token").read_text().strip()

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return float("nan")

    def stop(self) -> None:
        if self._wrapped:  # the daemon is the wrapper's child: stopping it ends the wrapper
            for pid in _children(self.proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(120)  # a profiler writes its file after its child exits
        self.proc.terminate()
        try:
            self.proc.wait(60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def parse_histograms(text: str, name: str, label: str = "") -> dict[str, list[tuple[float, float]]]:
    """{label value: [(bucket bound, cumulative count)]} of histogram `name` in /metrics
    `text`, its series summed per value of `label` ("" sums them all)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, dict[float, float]] = {}  # label value -> bound -> count
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == f"{name}_bucket":
                key = sample.labels.get(label, "") if label else ""
                counts = out.setdefault(key, {})
                le = float(sample.labels["le"])  # series sharing a key add up
                counts[le] = counts.get(le, 0.0) + sample.value
    return {key: sorted(counts.items()) for key, counts in out.items()}


def bucket_quantile(
    rows: list[tuple[float, float]], q: float, since: list[tuple[float, float]] | None = None
) -> float | None:
    """Upper bound of the bucket that holds the `q`-quantile of cumulative histogram `rows`,
    counting only what came after the snapshot `since`; None when nothing did."""
    before = dict(since or [])
    counts = [(le, count - before.get(le, 0.0)) for le, count in rows]
    total = counts[-1][1] if counts else 0.0
    if total <= 0:
        return None
    return next(le for le, count in counts if count >= q * total)


def host_parts(entry: dict[str, object]) -> str:
    """`, host: scheduling 1.2, launch 3.4, update 0.5, rest 0.8 ms`: how a slow step's host
    time split, from the daemon's slow-step log entry (empty for a daemon that logs no split)."""
    names = ("schedule_ms", "launch_ms", "update_ms", "other_host_ms")
    numbers = [float(v) for v in (entry.get(n) for n in names) if isinstance(v, int | float)]
    if len(numbers) != len(names):
        return ""
    schedule, launch, update, rest = numbers
    return (f", host: scheduling {schedule:.1f}, launch {launch:.1f}, update {update:.1f}, "
            f"rest {rest:.1f} ms")  # fmt: skip


def profiler_wrap(out: Path) -> list[str]:
    """A py-spy command that records which threads of the daemon hold the interpreter, and
    where, into `out` (collapsed stacks; without pausing the daemon to sample it).

    Raises:
        RuntimeError: py-spy is not installed.
    """
    where = os.pathsep.join((str(Path(sys.executable).parent), os.environ.get("PATH", "")))
    py_spy = shutil.which("py-spy", path=where)  # beside this interpreter, or on PATH
    if py_spy is None:
        raise RuntimeError("--profile-daemon needs py-spy on PATH (pip install py-spy)")
    return [py_spy, "record", "--nonblocking", "--gil", "--threads", "--rate", "250",
            "--format", "raw", "-o", str(out), "--"]  # fmt: skip


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []
