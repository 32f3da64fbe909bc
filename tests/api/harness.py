"""Runs an `ApiServer` on port 0 with a `FakeEngine` on a background event-loop thread.

Tests talk to it with ordinary synchronous gRPC clients, the way real clients do, and look at
the fake engine's records. Shared by `tests/api` and `tests/ctl`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from sitsd.api.server import ApiServer
from sitsd.config import ServerConfig
from tests.api.fake_engine import FakeEngine

T = TypeVar("T")

ADMIN_TOKEN = "test-admin-token"
MAX_TOKENS_DEFAULT = 20


class ServerThread:
    """An event loop on a daemon thread running one `ApiServer`; `stop()` ends both."""

    def __init__(self, *, admin_token: str = ADMIN_TOKEN) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="test-grpc-loop", daemon=True
        )
        self._thread.start()
        self.server: ApiServer = self.call(self._make_server(admin_token))
        self.port = self.call(self.server.start())
        self.address = f"127.0.0.1:{self.port}"
        self.engine: FakeEngine | None = None

    @staticmethod
    async def _make_server(admin_token: str) -> ApiServer:
        # grpc.aio objects belong to the loop they are created on.
        return ApiServer(
            ServerConfig(host="127.0.0.1", port=0),
            admin_token=admin_token,
            max_tokens_default=MAX_TOKENS_DEFAULT,
        )

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
        """Run `coro` on the server's loop and return its result."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)

    def attach(self, engine: FakeEngine) -> FakeEngine:
        """Start `engine` and serve with it (health SERVING)."""

        async def attach() -> None:
            await engine.start()
            await self.server.attach_engine(engine)

        self.call(attach())
        self.engine = engine
        return engine

    def stop(self) -> None:
        self.call(self.server.stop(0))
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
