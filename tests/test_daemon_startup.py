"""The daemon's start-up keeps the event loop free: every blocking step runs on another thread.

`sitsd.daemon.serve` runs here in this process, with real gRPC, /metrics and HTTP servers on
free ports, and a fake engine in place of the model (the engine's build has its own thread by
construction, `sitsd.builder.launch_engine`). Each step that reads files, imports or tokenizes
is wrapped to record the thread it ran on; none may be the loop's. Health is asked while the
daemon loads: it answers NOT_SERVING, then SERVING.
"""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import sitsd.builder
import sitsd.weights.startup
from sitsd import daemon
from sitsd.api.server import ApiServer
from sitsd.config import HttpConfig, ObservabilityConfig, ServerConfig, SitsdConfig
from tests.api.fake_engine import FakeEngine

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class PortlessEngine(FakeEngine):
    """The fake engine; the (replaced) swap manager needs no real port."""

    def swap_port(self) -> None:
        return None


class Recorder:
    """Wraps functions to note which thread each ran on."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.monkeypatch = monkeypatch
        self.threads: dict[str, threading.Thread] = {}

    def wrap(self, owner: object, name: str, replacement=None) -> None:
        original = getattr(owner, name)

        def recorded(*args, **kwargs):
            self.threads[name] = threading.current_thread()
            return (replacement or original)(*args, **kwargs)

        self.monkeypatch.setattr(owner, name, recorded)


def test_nothing_blocking_runs_on_the_loop_and_health_answers_while_loading(
    monkeypatch, tmp_path: Path
):
    recorder = Recorder(monkeypatch)
    loaded = threading.Event()  # the test lets the "model load" finish
    asked: list[int] = []  # health statuses seen while loading

    async def launch_engine(config, observer=None, weights_version=None, cancel=None):
        await asyncio.to_thread(loaded.wait, 60)
        engine = PortlessEngine()
        await engine.start()
        return engine

    recorder.wrap(daemon, "load_or_create_admin_token")
    recorder.wrap(sitsd.weights.startup, "choose_startup")
    recorder.wrap(sitsd.weights.startup, "create_swap_manager", lambda *a, **k: None)
    monkeypatch.setattr(sitsd.builder, "launch_engine", launch_engine)
    config = SitsdConfig(
        server=ServerConfig(port=0, state_dir=str(tmp_path), shutdown_grace_s=5),
        http=HttpConfig(port=0),
        observability=ObservabilityConfig(metrics_port=0),
    )

    monkeypatch.setattr(daemon, "ApiServer", RecordedServer)

    async def main() -> int:
        loop_thread = threading.current_thread()
        RecordedServer.started = asyncio.Queue()
        served = asyncio.ensure_future(daemon.serve(config))
        port = await RecordedServer.started.get()
        status = await asyncio.to_thread(check_health, port)
        asked.append(status)
        loaded.set()
        while await asyncio.to_thread(check_health, port) != SERVING:
            await asyncio.sleep(0.05)
        os.kill(os.getpid(), signal.SIGTERM)  # the daemon's handler: a graceful stop
        code = await served
        assert all(t is not loop_thread for t in recorder.threads.values()), recorder.threads
        return code

    assert asyncio.run(main()) == 0
    assert set(recorder.threads) == {
        "load_or_create_admin_token", "choose_startup", "create_swap_manager",
    }  # fmt: skip
    assert asked == [NOT_SERVING]


def check_health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        return stub.Check(health_pb2.HealthCheckRequest(), timeout=30).status


class RecordedServer(ApiServer):
    """The daemon's gRPC server, remembered so the test can find its port."""

    started: asyncio.Queue[int]

    async def start(self) -> int:
        port = await super().start()
        RecordedServer.started.put_nowait(port)
        return port
