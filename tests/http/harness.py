"""The HTTP app served by the real `HttpServer` on port 0 over a `FakeEngine`, on a background
event-loop thread; tests call it with the `openai` client and plain `urllib`, as clients do."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from opentelemetry import trace

from sitsd.api.inference import EngineRef
from sitsd.config import HttpConfig
from sitsd.http.app import ApiKeys, create_app
from sitsd.http.server import HttpServer
from sitsd.http.structured import GrammarChecker
from sitsd.http.telemetry import HttpTelemetry
from sitsd.observability.metrics import Metrics
from tests.api.fake_engine import FakeEngine
from tests.http.requests import request

__all__ = ["MAX_TOKENS_DEFAULT", "HttpThread", "request"]

T = TypeVar("T")
MAX_TOKENS_DEFAULT = 20


class HttpThread:
    """An event loop on a daemon thread serving one app; `stop()` ends both."""

    def __init__(self, api_keys: tuple[str, ...] = (), tracer: trace.Tracer | None = None) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self.engines = EngineRef()
        self.metrics = Metrics("fake-model")
        app = create_app(
            self.engines,
            telemetry=HttpTelemetry(self.metrics, tracer),
            api_keys=ApiKeys(api_keys),
            max_tokens_default=MAX_TOKENS_DEFAULT,
            check_grammar=GrammarChecker(),
        )
        self.server = HttpServer(app, HttpConfig(host="127.0.0.1", port=0), "127.0.0.1")
        self.port = self.call(self.server.start())
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.engine: FakeEngine | None = None

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30.0) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def attach(self, engine: FakeEngine) -> FakeEngine:
        async def attach() -> None:
            await engine.start()
            self.engines.attach(engine)

        self.call(attach())
        self.engine = engine
        return engine

    def stop(self) -> None:
        self.call(self.server.stop())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
