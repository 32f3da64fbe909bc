"""The daemon's life: build the parts in order, serve, shut down in reverse.

Start-up:  observability (logs, tracer/logger providers, metrics registry) -> admin token
           -> gRPC server up (health NOT_SERVING, Admin answers "loading") -> /metrics up
           -> HTTP API up (/health 503 until warm; same engine reference as gRPC)
           -> which weights to serve (the persisted active version, else --model) -> engine
           built on a thread (load, allocate, warm up) -> engine started -> swap manager and
           watched directory -> SERVING.
Shutdown (SIGTERM or SIGINT): health NOT_SERVING and new requests UNAVAILABLE (HTTP 503) ->
           watcher stopped -> in-flight requests finish (up to the grace period, then aborted)
           -> engine stopped -> HTTP API stopped -> gRPC server stopped -> /metrics stopped,
           spans and logs flushed -> exit 0. A second signal exits at once.
A model that fails to load is logged and the process exits 1, never hangs.

What the parts do is theirs: `sitsd.api.server` (gRPC), `sitsd.http` (the OpenAI-compatible
API), `sitsd.builder` (the engine),
`sitsd.weights.startup` (restart recovery, the swap manager), `sitsd.weights.watcher`,
`sitsd.observability` (metrics, traces, logs; it is the one place logging is configured).
"""

from __future__ import annotations

import asyncio
import gc
import importlib
import logging
import os
import secrets
import signal
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sitsd.api.server import ApiServer
from sitsd.api.telemetry import TelemetryInterceptor
from sitsd.config import ADMIN_TOKEN_FILE_NAME, ServerConfig, SitsdConfig
from sitsd.observability import Observability
from sitsd.observability.loop_lag import LoopLagMonitor

if TYPE_CHECKING:
    from sitsd.engine.async_engine import AsyncEngine
    from sitsd.http.server import HttpServer

log = logging.getLogger("sitsd.daemon")


# After the engine has ended every request, handlers only need to send their last message.
_SERVER_STOP_GRACE_S = 2.0
_EXIT_LOAD_FAILED = 1


def load_or_create_admin_token(config: ServerConfig) -> tuple[str, Path]:
    """The admin bearer token and the file it is in.

    An explicit `admin_token_file` must exist. Otherwise the token lives in
    `<state_dir>/admin-token`, created (random, mode 0600) when missing and reused after.

    Raises:
        ValueError: no state dir, or the token file is empty.
        OSError: the token file cannot be read or created.
    """
    if config.admin_token_file:
        path = Path(config.admin_token_file).expanduser()
    elif config.state_dir:
        path = Path(config.state_dir).expanduser() / ADMIN_TOKEN_FILE_NAME
        if not path.exists():
            _create_token_file(path)
    else:
        raise ValueError("set --state-dir or --admin-token-file")
    token = path.read_text().strip()
    if not token:
        raise ValueError(f"the admin token file {path} is empty")
    if path.stat().st_mode & 0o077:
        log.warning("the admin token file %s is readable by other users; chmod 600 it", path)
    return token, path


def _create_token_file(path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_urlsafe(32) + "\n")
    try:
        # link() fails if the file appeared meanwhile (another daemon): then that token wins.
        os.link(tmp, path)
    except FileExistsError:
        pass
    finally:
        tmp.unlink()


def run(config: SitsdConfig) -> int:
    """Run the daemon until a signal stops it; returns the process exit code."""
    obs = Observability.create(config.observability)
    obs.setup_logging()
    try:
        return asyncio.run(serve(config, obs))
    finally:
        obs.shutdown()  # flushes the spans and logs of the last requests


def freeze_startup_objects() -> int:
    """Move every object alive now out of the garbage collector's reach; how many there are.

    A full collection scans every tracked object: with torch, Triton, gRPC and the model loaded
    that is ~200k objects and 30-60 ms with every thread stopped, the engine's included, which
    clients see as one slow token for every request in flight. Start-up objects live as long
    as the daemon, so they need no scanning (`gc.freeze`, as CPython's docs suggest for this).
    """
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


async def serve(config: SitsdConfig, obs: Observability | None = None) -> int:
    """Start everything, serve until SIGTERM/SIGINT, shut down gracefully; the exit code."""
    obs = obs or Observability.create(config.observability)
    try:
        token, token_path = load_or_create_admin_token(config.server)
    except (OSError, ValueError) as exc:
        log.error("cannot set up the admin token: %s", exc)
        return _EXIT_LOAD_FAILED
    log.info("admin token in %s", token_path)
    stop = _install_signal_handlers()  # before anything is served: a signal then still drains
    server = ApiServer(
        config.server,
        admin_token=token,
        max_tokens_default=config.scheduler.max_tokens_default,
        interceptors=[TelemetryInterceptor(obs.metrics, obs.tracer)],
    )
    try:
        await server.start()
    except RuntimeError as exc:
        log.error("%s", exc)
        return _EXIT_LOAD_FAILED
    try:
        obs.start_metrics_server(config.server.host)
    except OSError as exc:
        log.error("cannot serve metrics on port %d: %s", config.observability.metrics_port, exc)
        await server.stop(0)
        return _EXIT_LOAD_FAILED
    try:
        http = await _start_http(config, server, obs)
    except (OSError, ValueError) as exc:
        log.error("cannot serve the HTTP API on port %d: %s", config.http.port, exc)
        await server.stop(0)
        return _EXIT_LOAD_FAILED
    loop_lag = LoopLagMonitor(obs.metrics.event_loop_lag.observe)
    loop_lag.start()
    try:
        started = await _start_weights(config, stop, obs)
        if started is None:
            if http is not None:
                await http.stop()
            await server.stop(0)
            return 0 if stop.is_set() else _EXIT_LOAD_FAILED
        engine, swaps, watcher = started
        await server.attach_engine(engine, swaps)
        log.info("garbage collector: %d start-up objects frozen", freeze_startup_objects())
        log.info("serving %s on port %d", engine.model_info.name, server.port)
        await stop.wait()
        if watcher is not None:
            await watcher.stop()
        await _shutdown(server, engine, config.server.shutdown_grace_s, http)
        return 0
    finally:
        await loop_lag.stop()


async def _start_weights(
    config: SitsdConfig, stop: asyncio.Event, obs: Observability
) -> tuple[AsyncEngine, Any, Any] | None:
    """The engine on the weights to serve, its swap manager, and the watcher (or None).

    None if something failed (logged) or a signal came first.
    """
    from sitsd.weights.startup import choose_startup, create_swap_manager

    try:
        choice = choose_startup(config)
    except Exception as exc:  # a --model path that does not exist, an unreadable state file
        log.error("failed to load model %s: %s: %s", config.model.model, type(exc).__name__, exc)
        return None
    engine = await _load_engine(choice.config_for(config), stop, obs, choice.version)
    if engine is None:
        return None
    try:
        swaps = create_swap_manager(engine.swap_port(), engine.tokenizer, config, choice, obs)
        watcher = None
        if config.weights.watch_dir:
            from sitsd.weights.watcher import VersionWatcher

            watcher = VersionWatcher(
                config.weights.watch_dir, swaps, commit=config.weights.watch_commit,
                debounce_s=config.weights.watch_debounce_s, metrics=obs.metrics,
            )  # fmt: skip
            await watcher.start()
    except Exception as exc:  # a bad canary file, an unusable watch directory
        log.error("cannot set up hot-swap: %s: %s", type(exc).__name__, exc)
        await engine.shutdown(0)
        return None
    return engine, swaps, watcher


async def _load_engine(
    config: SitsdConfig, stop: asyncio.Event, obs: Observability, version: str | None
) -> AsyncEngine | None:
    """The built engine; None if loading failed (logged) or a signal came first."""
    started = time.monotonic()
    log.info("loading model %s", config.model.model)
    build = asyncio.ensure_future(_launch_engine(config, obs, version))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((build, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not build.done():
        log.info("stopped while loading the model")
        return None
    try:
        engine = build.result()
    except Exception as exc:
        log.error(
            "failed to load model %s: %s: %s",
            config.model.model,
            type(exc).__name__,
            exc,
            exc_info=exc,
        )
        return None
    log.info("model loaded in %.1fs", time.monotonic() - started)
    return engine


async def _launch_engine(
    config: SitsdConfig, obs: Observability, version: str | None
) -> AsyncEngine:
    """Build the engine on its own daemon thread, which then runs the step loop.

    Not `asyncio.to_thread`: `asyncio.run` joins its executor's threads on exit, so a SIGTERM
    during a minutes-long model load would wait for the load to finish.
    """
    # Imported here: it pulls in torch and the model code, which `sitsd --help` does not need;
    # and off the event loop: importing torch takes seconds on a busy machine, and the loop
    # answers health checks meanwhile.
    builder = await asyncio.to_thread(importlib.import_module, "sitsd.builder")
    return await builder.launch_engine(config, observer=obs.telemetry, weights_version=version)


def _install_signal_handlers() -> asyncio.Event:
    """An event set by the first SIGTERM/SIGINT; a second one exits the process at once."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def on_signal(signum: int) -> None:
        name = signal.Signals(signum).name
        if stop.is_set():
            log.warning("%s again: exiting without waiting for requests", name)
            os._exit(128 + signum)
        log.info("%s: shutting down (send it again to exit at once)", name)
        stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    return stop


async def _start_http(
    config: SitsdConfig, server: ApiServer, obs: Observability
) -> HttpServer | None:
    """The OpenAI-compatible API on the gRPC server's `EngineRef` (None with --no-http)."""
    if not config.http.enabled:
        return None
    from sitsd.http.server import start_http  # FastAPI and uvicorn: only when served

    return await start_http(
        config.http, server.engines, default_host=config.server.host,
        max_tokens_default=config.scheduler.max_tokens_default, metrics=obs.metrics,
        tracer=obs.tracer, grace_s=_SERVER_STOP_GRACE_S,
    )  # fmt: skip


async def _shutdown(
    server: ApiServer, engine: AsyncEngine, grace_s: float, http: HttpServer | None = None
) -> None:
    """Reverse of start-up: stop admitting, let requests finish, stop the engine and server."""
    started = time.monotonic()
    status = engine.status()
    log.info(
        "draining: %d requests in flight, waiting up to %.1fs",
        status.num_running + status.num_waiting,
        grace_s,
    )
    await server.drain()
    try:
        await engine.shutdown(grace_s)
    except Exception:  # still stop the server: clients must not hang on a half-dead daemon
        log.exception("stopping the engine failed")
    if http is not None:
        await http.stop()
    await server.stop(_SERVER_STOP_GRACE_S)
    log.info("stopped in %.1fs", time.monotonic() - started)
