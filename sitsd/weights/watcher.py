"""The watched directory: weight versions dropped into `WATCH_DIR/<model>/<version>/`.

watchdog reports file events on a thread of its own; each marks its version directory dirty,
and once a directory has been quiet for `debounce_s` it is checked on the event loop:

    incomplete: no manifest yet, a file missing or shorter than listed -> ignored until the
        next event (a copy in progress)
    wrong: `<model>` is not the served model, a path resolving outside the watched directory
        (symlinks included), a file longer than listed or not listed, a pickle -> rejected,
        with the reason
    complete -> registered ("detected"), then with `--watch-commit auto` swapped to (staging
        verifies the checksums and validates; a failed check rejects it), with `stage-only`
        staged for a later `sitsctl swap`

A directory renamed into place is one event for the directory, checked the same way. Versions
already there at start-up are registered (staged), not committed: they are history, not news.
Each detection, rejection, staging and commit is logged and counted
(`sitsd_weight_versions_total{event}`). What staging and committing do is the swap manager's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from sitsd.config import WATCH_COMMIT_MODES
from sitsd.observability.metrics import Metrics
from sitsd.weights.errors import InvalidVersionIdError, VersionConflictError, VersionError
from sitsd.weights.manifest import IncompleteVersion, ManifestError, check_complete
from sitsd.weights.offthread import run_off_engine
from sitsd.weights.swap import SwapManager
from sitsd.weights.versions import VersionState, check_version_id

log = logging.getLogger("sitsd.watch")

VersionKey = tuple[str, str]  # (model, version) directory names; version "" = a model dir


class VersionWatcher:
    """Watches one directory for new versions of the served model (see the module docstring)."""

    def __init__(self, root: str | Path, manager: SwapManager, *, commit: str = "auto",
                 debounce_s: float = 0.5, metrics: Metrics | None = None) -> None:  # fmt: skip
        """Args:
        root: the watched directory (created if missing).
        manager: the `SwapManager` that stages and commits.
        commit: "auto" (swap to a new complete version) or "stage-only".
        debounce_s: quiet time after the last event before a version is checked.
        metrics: a `Metrics` to count events on, or None.
        """
        if commit not in WATCH_COMMIT_MODES:
            raise ValueError(f"watch commit mode must be one of {WATCH_COMMIT_MODES}")
        self.root = Path(root).expanduser()
        self.manager = manager
        self.model = manager.registry.model
        self.commit = commit
        self.debounce_s = debounce_s
        self.metrics = metrics
        self._due: dict[tuple[str, str], float] = {}  # (model, version) -> when to check it
        self._wake = asyncio.Event()
        self._observer: BaseObserver | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Register what is there already, then watch (returns at once)."""
        self.root.mkdir(parents=True, exist_ok=True)
        loop = asyncio.get_running_loop()
        await run_off_engine(self._register_existing, name="sitsd-watch-scan")

        def touch(key: VersionKey) -> None:  # watchdog's thread
            loop.call_soon_threadsafe(self._touch, key)

        handler = _Handler(self.root, touch)
        observer = self._observer = Observer()
        observer.schedule(handler, str(self.root), recursive=True)
        observer.daemon = True
        observer.start()
        self._task = asyncio.ensure_future(self._run())
        log.info("watching %s for versions of %s (%s)", self.root / self.model, self.model,
                 "commit on arrival" if self.commit == "auto" else "stage only")  # fmt: skip

    async def stop(self) -> None:
        if self._observer is not None:
            self._observer.stop()
            await asyncio.to_thread(self._observer.join, 5)
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    # -------------------------------------------------------------------------- the loop

    def _touch(self, key: tuple[str, str]) -> None:
        loop = asyncio.get_running_loop()
        self._due[key] = loop.time() + self.debounce_s
        self._wake.set()

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._wake.clear()
            now = loop.time()
            ready = sorted(k for k, t in self._due.items() if t <= now)
            for key in ready:
                del self._due[key]
            for model, version in ready:
                try:
                    await self._check(model, version)
                except Exception:  # one bad drop must never stop the watcher
                    log.exception("checking %s/%s failed", model, version)
            if ready:
                continue
            timeout = min(self._due.values(), default=now + 3600) - now
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), timeout=max(timeout, 0.0))

    async def _check(self, model: str, version: str) -> None:
        if not version:  # a model directory appeared (or was renamed into place): its versions
            if not (self.root / model).is_dir():
                return
            for child in sorted((self.root / model).iterdir()):
                if child.is_dir() and not child.name.startswith("."):
                    self._touch((model, child.name))
            return
        directory = self.root / model / version
        if not directory.exists():
            return
        if model != self.model:
            self._reject(version, directory, "", f"{self.root / model} is not the served model "
                         f"{self.model!r}: versions go in {self.root / self.model}")  # fmt: skip
            return
        try:
            check_version_id(version)
        except InvalidVersionIdError as exc:  # no record can hold such an id: logged, counted
            self._count("rejected")
            log.warning("ignored %s: the directory's name is not a version id: %s", directory, exc)
            return
        try:
            manifest = await run_off_engine(
                lambda: check_complete(directory, root=self.root), name="sitsd-watch-check"
            )
        except IncompleteVersion as exc:
            log.debug("version %s is not complete yet: %s", version, exc)
            return
        except ManifestError as exc:
            self._reject(version, directory, "", str(exc))
            return
        try:
            _, new = self.manager.registry.register(
                version, str(directory), manifest.digest, "watch", VersionState.STAGED
            )
        except VersionConflictError as exc:
            self._count("rejected")
            log.warning("ignored %s: %s", directory, exc)
            return
        if not new:
            return  # known already (its manifest did not change)
        self._count("detected")
        log.info("detected weights version %s at %s", version, directory,
                 extra={"weights_version": version})  # fmt: skip
        await self._stage_or_commit(version)

    async def _stage_or_commit(self, version: str) -> None:
        try:
            if self.commit == "auto":
                await self.manager.swap(version, wait=True)
                self._count("committed")
            else:
                await self.manager.stage(version, wait=True)
                self._count("staged")
        except VersionError as exc:  # logged by the manager; counted here
            self._count("rejected" if self._rejected(version) else "failed")
            log.info("version %s from the watched directory was not committed: %s", version, exc)

    def _rejected(self, version: str) -> bool:
        record = self.manager.registry.find(version)
        return record is not None and record.state is VersionState.REJECTED

    def _reject(self, version: str, directory: Path, digest: str, reason: str) -> None:
        registry = self.manager.registry
        known = registry.find(version)
        if known is not None and known.state is VersionState.REJECTED and known.reason == reason:
            return  # seen again (more file events): rejected once, counted once
        with contextlib.suppress(VersionConflictError):
            registry.register(version, str(directory), digest or f"rejected:{reason}", "watch",
                              VersionState.STAGED)  # fmt: skip
            registry.set_state(version, VersionState.REJECTED, reason)
        self._count("rejected")
        log.warning("rejected weights version %s at %s: %s", version, directory, reason,
                    extra={"weights_version": version, "reason": reason})  # fmt: skip

    def _count(self, event: str) -> None:
        if self.metrics is not None:
            self.metrics.record_version_event(event)

    def _register_existing(self) -> None:
        """Start-up: complete versions already there are registered, not committed."""
        model_dir = self.root / self.model
        if not model_dir.is_dir():
            return
        for directory in sorted(model_dir.iterdir()):
            if not directory.is_dir() or directory.name.startswith("."):
                continue
            try:
                manifest = check_complete(directory, root=self.root)
                self.manager.registry.register(directory.name, str(directory), manifest.digest,
                                               "watch", VersionState.STAGED)  # fmt: skip
            except (IncompleteVersion, ManifestError, VersionConflictError, InvalidVersionIdError):
                continue  # checked (and a bad name logged) on its next event
            log.info("found weights version %s at start-up (not committed)", directory.name)


class _Handler(FileSystemEventHandler):
    """Maps watchdog events (its thread) to the (model, version) directories they touch."""

    def __init__(self, root: Path, touch: Callable[[VersionKey], None]) -> None:
        self.root = root
        self.touch = touch

    def on_any_event(self, event: FileSystemEvent) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        for path in (event.src_path, getattr(event, "dest_path", "")):
            key = self._key(str(path)) if path else None
            if key is not None:
                self.touch(key)

    def _key(self, path: str) -> tuple[str, str] | None:
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return None
        if not parts or any(p.startswith(".") for p in parts[:2]):
            return None
        return (parts[0], parts[1]) if len(parts) >= 2 else (parts[0], "")
