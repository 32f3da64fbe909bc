"""The HTTP front end served by uvicorn on the daemon's own event loop, beside gRPC.

`HttpServer` goes through the daemon's life in the steps the daemon drives, as the gRPC
`ApiServer` does (the two share one `EngineRef`, so both see the same loading / serving /
draining state):

    start()   bind host:port (port 0 = a free one, logged); /health answers 503 until warm
    stop()    stop accepting, wait up to the grace for answers in flight, then close

uvicorn runs without its signal handling (the daemon owns SIGTERM and SIGINT), without its
logging setup (`sitsd.observability` configures logging) and without an access log (requests
are counted and traced by `sitsd.http.telemetry`). What it serves is `sitsd.http.app`'s;
`start_http` builds the app from the daemon's config and starts it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import Iterator

import uvicorn
from fastapi import FastAPI
from opentelemetry import trace

from sitsd.api.inference import EngineRef
from sitsd.config import HttpConfig
from sitsd.http.app import ApiKeys, create_app, read_api_keys
from sitsd.http.structured import GrammarChecker
from sitsd.http.telemetry import HttpTelemetry
from sitsd.observability.metrics import Metrics

log = logging.getLogger("sitsd.http")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn's server minus its signal handlers: SIGTERM drains the whole daemon."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


class HttpServer:
    """Serves an ASGI app on the running event loop."""

    def __init__(self, app: FastAPI, config: HttpConfig, default_host: str) -> None:
        self._app = app
        self.host = config.host or default_host
        self._port = config.port
        self.port = 0
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, grace_s: float = 2.0) -> int:
        """Bind and serve; returns the bound port.

        Raises:
            OSError: the address cannot be bound.
        """
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((self.host, self._port))
        except OSError:
            sock.close()
            raise
        sock.listen(1024)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app, log_config=None, access_log=False, lifespan="off",
            timeout_graceful_shutdown=max(1, round(grace_s)), server_header=False,
        )  # fmt: skip
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]), name="sitsd-http")
        while not self._server.started:  # startup binds nothing (the socket is bound): quick
            if self._task.done():
                self._task.result()  # raises what stopped it
                raise OSError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)
        shown = f"[{self.host}]" if ":" in self.host else self.host
        log.info("http on http://%s:%d/v1", shown, self.port)
        return self.port

    async def stop(self) -> None:
        """Stop serving: answers in flight get the grace given to `start`, then are cut."""
        if self._server is None or self._task is None:
            return
        self._server.should_exit = True
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._server = self._task = None


async def start_http(
    config: HttpConfig,
    engines: EngineRef,
    *,
    default_host: str,
    max_tokens_default: int,
    metrics: Metrics | None = None,
    tracer: trace.Tracer | None = None,
    grace_s: float = 2.0,
) -> HttpServer:
    """Build the app on `engines` (shared with gRPC) and serve it; the running server.

    Raises:
        OSError: the API key file cannot be read, or the address cannot be bound.
        ValueError: the API key file holds no key.
    """
    keys = ApiKeys(read_api_keys(config.api_key_file) if config.api_key_file else ())
    app = create_app(
        engines, telemetry=HttpTelemetry(metrics, tracer), api_keys=keys,
        max_tokens_default=max_tokens_default, retry_after_s=config.retry_after_s,
        check_grammar=GrammarChecker(),
    )  # fmt: skip
    server = HttpServer(app, config, default_host)
    await server.start(grace_s)
    if keys.required:
        log.info("http: /v1/* needs an API key (from %s)", config.api_key_file)
    return server
