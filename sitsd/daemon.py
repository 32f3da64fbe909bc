"""The daemon's life: build the parts in order, serve, shut down in reverse.

Start-up:  observability (logs, tracer/logger providers, metrics registry) -> start-up checks
           (`sitsd.preflight`: every flag that can be checked without the model) -> the
           engine's and the HTTP API's code imported (before the event loop: importing torch
           holds the GIL for seconds) -> signal handlers -> admin token -> gRPC server up
           (health NOT_SERVING, Admin answers "loading") -> /metrics up -> HTTP API up
           (/health 503 until warm; same engine reference as gRPC) -> which weights to serve
           (the persisted active version, else --model) -> engine built on a thread (load,
           allocate, warm up) -> engine started -> swap manager and watched directory ->
           SERVING. Nothing blocking runs on the event loop: file reads and the load run on
           threads, and nothing on them holds the GIL for long.
Shutdown (SIGTERM or SIGINT): health NOT_SERVING and new requests UNAVAILABLE (HTTP 503) ->
           watcher stopped -> in-flight requests finish (up to the grace period, then aborted)
           -> engine stopped -> HTTP API stopped -> gRPC server stopped -> /metrics stopped,
           spans and logs flushed -> exit 0. A second signal exits at once. A signal during
           start-up stops it cleanly (exit 0): a model load stops at its next step, and the
           daemon waits for that (up to the grace period) before it exits.
A start-up that fails (a flag that cannot work, a port in use, a model that does not load) is
logged and the process exits 1, never hangs; the user's errors in one line, without traceback.

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
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sitsd.api.server import ApiServer
from sitsd.api.telemetry import TelemetryInterceptor
from sitsd.config import ADMIN_TOKEN_FILE_NAME, ConfigError, ServerConfig, SitsdConfig
from sitsd.observability import Observability
from sitsd.observability.gc_pauses import GcPauseMonitor
from sitsd.observability.gil_holds import GilHoldMonitor
from sitsd.observability.loop_lag import LoopLagMonitor
from sitsd.weights import CheckpointError

if TYPE_CHECKING:
    from sitsd.engine.async_engine import AsyncEngine
    from sitsd.http.server import HttpServer
    from sitsd.weights.push import WeightPushes
    from sitsd.weights.startup import StartupChoice
    from sitsd.weights.swap import SwapManager
    from sitsd.weights.watcher import VersionWatcher

log = logging.getLogger("sitsd.daemon")


# After the engine has ended every request, handlers only need to send their last message.
_SERVER_STOP_GRACE_S = 2.0
_EXIT_FAILED = 1  # any start-up failure; usage errors (argparse) exit 2


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
    set_gil_switch_interval(config.server.gil_switch_interval_s)
    try:
        from sitsd.preflight import check_startup  # the plugin lookup imports the engine's tiers

        check_startup(config)  # before anything is imported, bound or loaded: fails at once
    except (ConfigError, OSError) as exc:
        log.error("%s", exc)
        obs.shutdown()
        return _EXIT_FAILED
    try:
        import_heavy_modules(config)
        return asyncio.run(serve(config, obs))
    except _LoadAbandoned:
        # A model load that would not stop is still in native code on its thread: Python's
        # finalization would race it (std::terminate, exit 134). Flush, then leave at once.
        obs.shutdown()
        logging.shutdown()
        os._exit(0)
    finally:
        obs.shutdown()  # flushes the spans and logs of the last requests
        # Frozen objects are never freed at exit, and Triton's bindings then print dozens of
        # "nanobind: leaked" lines on stderr: hand them back to the collector first.
        gc.unfreeze()
        for signum in (signal.SIGTERM, signal.SIGINT):  # the loop's handlers are gone
            signal.signal(signum, signal.SIG_IGN)  # a signal now changes nothing: exiting


def set_gil_switch_interval(seconds: float) -> None:
    """How long a thread running Python keeps the GIL from one that asks for it.

    The engine's thread gives the GIL up at every wait for the device and every torch call
    that releases it; when another thread is running Python then (the stager between two
    copies, the canary's comparison, the event loop streaming tokens, a /metrics scrape), the
    engine waits up to this interval to get it back, at every such point of the step. At
    Python's 5 ms a step of 40 such points went from 2 ms to 208 ms (median) next to one busy
    Python thread; at 0.5 ms to 26 ms, at 0.1 ms to 9.4 ms, the busy thread keeping 0.8 of its
    pace (`python -m bench.gil_switch`). On a GPU each swap's verification and validation
    began with a step of 10-36 ms whose host time went to the runner's launch, its calls into
    torch (an H100), and each IPC push with a 12-13 ms host step (an H200).
    """
    sys.setswitchinterval(seconds)


def import_heavy_modules(config: SitsdConfig) -> None:
    """Import the engine (torch, Triton, the model) and the HTTP API before the event loop runs.

    Importing torch runs seconds of C code that holds the GIL: on a worker thread it still
    stopped the event loop, and health checks timed out instead of answering NOT_SERVING.
    Until the gRPC port is bound a probe is refused at once (UNAVAILABLE), which probes and
    `sitsctl health --wait` retry.
    """
    started = time.monotonic()
    importlib.import_module("sitsd.builder")
    if config.http.enabled:
        importlib.import_module("sitsd.http.server")
    log.info("engine code imported in %.1fs", time.monotonic() - started)


def freeze_startup_objects() -> int:
    """Move every object alive now out of the garbage collector's reach; how many there are.

    A full collection scans every tracked object: with torch, Triton, gRPC and the model loaded
    that is ~200k objects and 30-60 ms with every thread stopped, the engine's included, which
    clients see as one slow token for every request in flight. Start-up objects live as long
    as the daemon, so they need no scanning (`gc.freeze`, as CPython's docs suggest for this).
    No collection runs first: it would stop the event loop (and every thread) for as long, and
    `gc.freeze` itself only moves lists; the little garbage start-up left in cycles stays.
    """
    gc.freeze()
    return gc.get_freeze_count()


class _LoadAbandoned(Exception):
    """The daemon stopped during a model load that did not stop within the grace period."""


async def serve(config: SitsdConfig, obs: Observability | None = None) -> int:
    """Start everything, serve until SIGTERM/SIGINT, shut down gracefully; the exit code.

    Nothing blocking runs on the event loop (health checks are answered from the start): file
    reads, imports of the heavy parts and the model load run on threads. A signal at any
    point stops start-up cleanly (exit 0).
    """
    obs = obs or Observability.create(config.observability)
    stop = _install_signal_handlers()
    try:
        token, token_path = await asyncio.to_thread(load_or_create_admin_token, config.server)
    except (OSError, ValueError) as exc:
        log.error("cannot set up the admin token: %s", exc)
        return _EXIT_FAILED
    log.info("admin token in %s", token_path)
    servers = await _start_servers(config, obs, token)
    if servers is None:
        return _EXIT_FAILED
    server, http = servers
    ocfg = config.observability
    warn_s = ocfg.loop_lag_warn_ms / 1e3
    # Woken at least as often as the lag it warns of (a stall shorter than the sleep could fall
    # between two wake-ups).
    loop_lag = LoopLagMonitor(obs.metrics.event_loop_lag.observe, interval_s=min(0.05, warn_s),
                              warn_s=warn_s, warn_every_s=ocfg.stall_warn_every_s)  # fmt: skip
    loop_lag.start()
    gc_pauses = GcPauseMonitor()  # a collection stops the engine's thread too: logged
    gc_pauses.start()
    gil_holds = None
    if ocfg.gil_hold_warn_ms > 0:  # a probe thread: for diagnosing stalls, off by default
        gil_holds = GilHoldMonitor(ocfg.gil_hold_warn_ms / 1e3,
                                   warn_every_s=ocfg.stall_warn_every_s)  # fmt: skip
        gil_holds.start()
    try:
        started = None if stop.is_set() else await _start_weights(config, stop, obs)
        if started is None:
            await _stop_servers(server, http)
            return 0 if stop.is_set() else _EXIT_FAILED
        engine, swaps, pushes, watcher = started
        await server.attach_engine(engine, swaps, pushes)
        log.info("garbage collector: %d start-up objects frozen", freeze_startup_objects())
        log.info("serving %s on port %d", engine.model_info.name, server.port)
        await stop.wait()
        if watcher is not None:
            await watcher.stop()
        await _shutdown(server, engine, config.server.shutdown_grace_s, http)
        if pushes is not None:
            pushes.close()  # a trainer's memory kept mapped is the trainer's again
        return 0
    finally:
        if gil_holds is not None:
            gil_holds.stop()
        gc_pauses.stop()
        await loop_lag.stop()


async def _start_servers(
    config: SitsdConfig, obs: Observability, token: str
) -> tuple[ApiServer, HttpServer | None] | None:
    """gRPC (health NOT_SERVING), /metrics and the HTTP API up; None if one failed (logged)."""
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
        return None
    try:
        obs.start_metrics_server(config.server.host)
    except OSError as exc:
        log.error("cannot serve metrics on port %d: %s", config.observability.metrics_port, exc)
        await server.stop(0)
        return None
    try:
        http = await _start_http(config, server, obs)
    except (OSError, ValueError) as exc:
        log.error("cannot serve the HTTP API on port %d: %s", config.http.port, exc)
        await server.stop(0)
        return None
    return server, http


async def _stop_servers(server: ApiServer, http: HttpServer | None) -> None:
    if http is not None:
        await http.stop()
    await server.stop(0)


async def _start_weights(
    config: SitsdConfig, stop: asyncio.Event, obs: Observability
) -> tuple[AsyncEngine, SwapManager, WeightPushes, VersionWatcher | None] | None:
    """The engine on the weights to serve, its swap manager, trainers' pushes, and the
    watcher (or None).

    None if something failed (logged) or a signal came first.
    """
    try:
        choice = await asyncio.to_thread(_choose_startup, config)
    except Exception as exc:  # a --model path that does not exist, an unreadable state file
        log.error("failed to load model %s: %s: %s", config.model.model, type(exc).__name__, exc)
        return None
    engine = await _load_engine(choice.config_for(config), stop, obs, choice.version)
    if engine is None:
        return None
    try:
        swaps = await asyncio.to_thread(_create_swap_manager, engine, config, choice, obs)
        pushes = await asyncio.to_thread(_create_weight_pushes, swaps, config, obs)
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
    return engine, swaps, pushes, watcher


def _choose_startup(config: SitsdConfig) -> StartupChoice:
    from sitsd.weights.startup import choose_startup

    return choose_startup(config)


def _create_swap_manager(
    engine: AsyncEngine, config: SitsdConfig, choice: StartupChoice, obs: Observability
) -> SwapManager:
    # Off the loop: it imports the staging code and reads and tokenizes the canary prompts.
    from sitsd.weights.startup import create_swap_manager

    return create_swap_manager(engine.swap_port(), engine.tokenizer, config, choice, obs)


def _create_weight_pushes(
    swaps: SwapManager, config: SitsdConfig, obs: Observability
) -> WeightPushes:
    # Off the loop: it imports the push transports.
    from sitsd.weights.startup import create_weight_pushes

    return create_weight_pushes(swaps, config, obs)


async def _load_engine(
    config: SitsdConfig, stop: asyncio.Event, obs: Observability, version: str | None
) -> AsyncEngine | None:
    """The built engine; None if loading failed (logged) or a signal came first.

    A signal cancels the build, which stops at its next step; the daemon waits for that (up
    to the shutdown grace), so no thread is left in the middle of the load when it exits.

    Raises:
        _LoadAbandoned: the load did not stop within the grace period.
    """
    started = time.monotonic()
    log.info("loading model %s", config.model.model)
    cancel = threading.Event()
    build = asyncio.ensure_future(_launch_engine(config, obs, version, cancel))
    stopped = asyncio.ensure_future(stop.wait())
    await asyncio.wait((build, stopped), return_when=asyncio.FIRST_COMPLETED)
    stopped.cancel()
    if not build.done() or stop.is_set():
        cancel.set()
        log.info("stopped while loading the model; waiting for the load to stop")
        done, _ = await asyncio.wait((build,), timeout=config.server.shutdown_grace_s)
        if not done:
            raise _LoadAbandoned
        if build.exception() is None:  # it was built just before it could stop
            await build.result().shutdown(0)
        return None
    try:
        engine = build.result()
    except (ConfigError, CheckpointError) as exc:  # the user's to fix: one line says what
        log.error("failed to load model %s: %s", config.model.model, exc)
        return None
    except Exception as exc:
        log.error(
            "failed to load model %s: %s: %s", config.model.model, type(exc).__name__, exc,
            exc_info=exc,
        )  # fmt: skip
        return None
    log.info("model loaded in %.1fs", time.monotonic() - started)
    return engine


async def _launch_engine(
    config: SitsdConfig, obs: Observability, version: str | None, cancel: threading.Event
) -> AsyncEngine:
    """Build the engine on its own daemon thread, which then runs the step loop.

    Not `asyncio.to_thread`: `asyncio.run` joins its executor's threads on exit, so a SIGTERM
    during a minutes-long model load would wait for the load to finish.
    """
    # Imported here: it pulls in torch and the model code, which `sitsd --help` does not need
    # (`run` imports it before the loop starts; off the loop for callers of `serve`).
    builder = await asyncio.to_thread(importlib.import_module, "sitsd.builder")
    return await builder.launch_engine(
        config, observer=obs.telemetry, weights_version=version, cancel=cancel
    )


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
    # FastAPI and uvicorn: only when served (`run` imports them before the loop starts).
    http_server = await asyncio.to_thread(importlib.import_module, "sitsd.http.server")
    return await http_server.start_http(
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
