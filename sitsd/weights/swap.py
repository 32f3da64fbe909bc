"""Hot-swap: deploy, swap and roll back weight versions of the served model while it serves.

`SwapManager` lives on the daemon's event loop; one operation runs at a time (a second one is
refused, `SwapRefusedError`; the watcher waits its turn). A swap's stages, each timed
(`sitsd_swap_stage_duration_seconds{stage}`, one span each in the swap's own trace) and
reported as `SwapProgress`:

    verify    manifest.json against every file (sizes, sha256)           stager thread
    load      open the checkpoint (memory-mapped; pickles refused)       stager thread
    validate  architecture, tokenizer, names, shapes, dtypes, finite     stager thread
    stage     copy into the standby slot (a side stream on CUDA)         stager thread
    canary    prompts on both slots, within a KL bound                   engine thread, per step
    commit    flip the active slot; in-flight requests per the policy    engine thread, per step

A version failing any check is rejected with the reason (log, `sitsd_swaps_total{outcome=
"rejected"}`, `ListVersions`) and serving never notices: the standby slot is released to the
stager only when no request runs on it, and only after every check that needs no slot passed.
After a commit the previous version stays in the standby slot: a rollback commits it again (or
restages it from disk when the slot was reused). The active version is persisted before a
commit is reported, so a restarted daemon comes back on it. With one weight slot, staging only
validates; the commit copies the version over the slot between two steps (a pause; requests in
flight are recomputed, `drain` is refused, and there is no canary: it needs a second slot).

`push` takes a version a trainer pushes (`sitsd.weights.push`) through the same path: staged
into the standby slot from its transport (`StandbyStager.stage_pushed`), the same canary,
commit, policies and registry. A pushed version has no files: it is not persisted, and once
its slot is reused it cannot be restaged (a rollback to it is refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from sitsd.config import SWAP_POLICIES
from sitsd.engine.errors import InvalidRequestError
from sitsd.engine.messages import InPlaceCopy, SwapEvent
from sitsd.engine.swap_port import SwapPort
from sitsd.observability import Observability
from sitsd.weights.checks import LoadedVersion, ServingModel, VersionRejected
from sitsd.weights.errors import (
    InvalidVersionIdError,
    SwapFailedError,
    SwapRefusedError,
    VersionRejectedError,
)
from sitsd.weights.manifest import IncompleteVersion, ManifestError, read_manifest
from sitsd.weights.offthread import run_off_engine
from sitsd.weights.progress import (
    NoTrace,
    ProgressSink,
    SwapProgress,
    SwapTraceLike,
    ignore_progress,
)
from sitsd.weights.push_plan import PushSource
from sitsd.weights.staging import StagingSettings, StandbyStager
from sitsd.weights.versions import (
    ActiveVersionStore,
    PersistedVersion,
    VersionRegistry,
    VersionState,
    VersionsView,
    WeightVersion,
    check_version_id,
)

log = logging.getLogger("sitsd.swap")

PUSHED = "push"  # the source of a version a trainer pushed


@dataclass(frozen=True)
class SwapSettings:
    """What the manager needs of the configuration (`WeightsConfig`, `SwapConfig`)."""

    default_policy: str = "migrate"  # for swaps that name none
    staging: StagingSettings = field(default_factory=StagingSettings)


class SwapManager:
    """Deploy / swap / rollback / list for one served model (see the module docstring)."""

    def __init__(
        self,
        port: SwapPort,
        registry: VersionRegistry,
        serving: ServingModel,
        settings: SwapSettings,
        store: ActiveVersionStore | None = None,
        telemetry: Observability | None = None,
    ) -> None:
        """Args:
        port: the running engine's swap port.
        registry: the versions, the serving one registered active.
        serving: what a new version must match.
        settings: policies, limits, canary prompts.
        store: where the active version is persisted (None: not persisted).
        telemetry: an `Observability` (swap traces, metrics), or None.
        """
        self.port = port
        self.registry = registry
        self.serving = serving
        self.settings = settings
        self.store = store
        self.telemetry = telemetry
        self.stager = StandbyStager(port, serving, settings.staging)
        self._lock = asyncio.Lock()
        self._operation = ""
        self._in_place: dict[str, LoadedVersion] = {}  # one slot: validated, awaiting commit

    @property
    def busy(self) -> str:
        """The operation in progress ("" when none)."""
        return self._operation if self._lock.locked() else ""

    # ----------------------------------------------------------------------------- the API

    def register(self, path: str, version: str = "", source: str = "deploy") -> WeightVersion:
        """Register the version in directory `path` (staged); its id defaults to the dir name.

        Raises:
            InvalidVersionIdError: the id (given, or the directory's name) is not a name.
            InvalidRequestError: not a directory, or no readable manifest.
            VersionConflictError: the id is taken by other content.
        """
        if version:
            check_version_id(version)  # before the path is even looked at
        directory = _host_directory(path)
        try:
            digest = read_manifest(directory).digest
        except (IncompleteVersion, ManifestError) as exc:
            raise InvalidRequestError(
                "path", f"{exc}; write one with `sitsctl manifest {path}`"
            ) from None
        except OSError as exc:  # unreadable: permissions, a file vanished under us
            raise InvalidRequestError("path", f"{path} cannot be read: {exc.strerror}") from None
        if not version:
            try:
                version = check_version_id(directory.name)
            except InvalidVersionIdError as exc:
                raise InvalidVersionIdError(
                    f"{exc}; name the version (sitsctl deploy --version)"
                ) from None
        record, _ = self.registry.register(
            version, str(directory), digest, source, VersionState.STAGED
        )
        return record

    async def deploy(
        self, path: str, version: str = "", progress: ProgressSink = ignore_progress
    ) -> WeightVersion:
        """Register and stage a version (into the standby slot); it is not committed."""
        record = self.register(path, version)
        return await self.stage(record.version, progress)

    async def stage(
        self, version: str, progress: ProgressSink = ignore_progress, *, wait: bool = False
    ) -> WeightVersion:
        """Stage a registered version (into the standby slot) without committing it."""
        self.registry.get(version)  # NOT_FOUND at once
        async with self._exclusive(f"deploy of {version}", wait=wait):
            record = self.registry.get(version)
            if record.state is VersionState.REJECTED:
                raise SwapRefusedError(f"version {version} was rejected: {record.reason}")
            if version not in self._loaded_versions():
                trace = self._trace(version)
                with self._unchanged_if_failed(record):
                    await self._stage(record, progress, trace)
                trace.finish("staged")
        progress(SwapProgress("staged", version, message="validated; ready to commit"))
        return self.registry.get(version)

    async def swap(
        self,
        version: str,
        policy: str = "",
        progress: ProgressSink = ignore_progress,
        *,
        wait: bool = False,
        outcome: str = "committed",
    ) -> SwapProgress:
        """Stage `version` if needed, then commit it; returns the "committed" progress.

        Args:
            version: a registered version.
            policy: migrate, drain or restart ("" = the daemon's default).
            progress: told of each step.
            wait: wait for an operation in progress instead of refusing (the watcher).
            outcome: the swap's outcome label (rolled_back for a rollback).

        Raises:
            UnknownVersionError, InvalidRequestError, SwapRefusedError, VersionRejectedError,
            SwapFailedError.
        """
        policy = self._policy(policy)
        check_version_id(version)
        self.registry.get(version)  # NOT_FOUND at once, not after waiting for the lock
        async with self._exclusive(f"swap to {version}", wait=wait):
            record = self.registry.get(version)
            if record.version == self.registry.active:
                done = SwapProgress("committed", version, policy=policy, message="already active")
                progress(done)
                return done
            if record.state is VersionState.REJECTED:
                raise SwapRefusedError(f"version {version} was rejected: {record.reason}")
            if record.source == PUSHED and version not in self._loaded_versions():
                raise SwapRefusedError(
                    f"version {version} was pushed and is in no weight slot any more; push it again"
                )
            trace = self._trace(version)
            with self._unchanged_if_failed(record):
                if version not in self._loaded_versions():
                    await self._stage(record, progress, trace)
                return await self._commit(version, policy, progress, trace, outcome)

    async def rollback(
        self, policy: str = "", progress: ProgressSink = ignore_progress
    ) -> SwapProgress:
        """Commit the version that was active before the current one.

        Raises:
            SwapRefusedError: there is none (FAILED_PRECONDITION).
        """
        previous = self.registry.previous
        if not previous:
            raise SwapRefusedError("nothing to roll back to: no version was active before this one")
        return await self.swap(previous, policy, progress, outcome="rolled_back")

    async def push(
        self,
        version: str,
        path: str,
        push: PushSource,
        policy: str = "",
        progress: ProgressSink = ignore_progress,
        *,
        commit: bool = True,
        trace: SwapTraceLike | None = None,
    ) -> SwapProgress:
        """Register what a trainer pushes (`push`, a transport) as `version` (`path`: where it
        came from), stage it, and commit it unless `commit` is False ("staged": for `swap`).

        Raises:
            InvalidRequestError, VersionConflictError, SwapRefusedError, VersionRejectedError,
            SwapFailedError.
        """
        policy = self._policy(policy)
        if self.port.num_slots == 1:
            raise SwapRefusedError("a push is received into the standby weight slot; this "
                                   "daemon has one slot (--weight-slots)")  # fmt: skip
        async with self._exclusive(f"push of {version}", wait=False):
            # Off the event loop: the first push makes the slots' views by name (milliseconds
            # of the interpreter, during which no stream's token would go out); later ones
            # find them made.
            if quantized := await run_off_engine(self.port.quantized_tensors):
                raise SwapRefusedError(
                    f"a push writes 16-bit weights; this daemon holds {len(quantized)} tensors "
                    f"quantized (e.g. {quantized[0]}): serve 16-bit weights to push"
                )
            digest = f"push:{secrets.token_hex(8)}"  # each push is content of its own
            record, _ = self.registry.register(version, path, digest, PUSHED, VersionState.STAGED)
            trace = trace or self._trace(version)
            await self._stage(record, progress, trace, push)
            if commit:
                return await self._commit(version, policy, progress, trace, "committed")
            trace.finish("staged")
        done = SwapProgress("staged", version, message="validated; ready to commit")
        progress(done)
        return done

    def versions(self) -> VersionsView:
        """Every version, and which slot holds which (with its precision and bytes there)."""
        status = self.port.status()
        where = {}
        for index, held in enumerate(status.slot_versions):
            if held:
                where[held] = "active" if index == status.active_slot else "standby"
        self._describe_slots()
        return VersionsView(
            self.registry.list(),
            where,
            self.registry.active,
            self.registry.previous,
            len(status.slot_versions),
        )

    def _describe_slots(self) -> None:
        """Remember each slot's version's precision and bytes (ListVersions shows them, also
        once the slot holds another version)."""
        status = self.port.status()
        for held, precision, nbytes in zip(
            status.slot_versions, status.slot_precisions, status.slot_weight_bytes, strict=False
        ):
            if held:
                self.registry.describe(held, precision, nbytes)

    # ---------------------------------------------------------------------------- staging

    async def _stage(
        self,
        record: WeightVersion,
        progress: ProgressSink,
        trace: SwapTraceLike,
        push: PushSource | None = None,
    ) -> None:
        """Verify, load, validate and (two slots) copy into the standby slot, then canary;
        or, for a `push`, receive it into the standby slot (`StandbyStager.stage_pushed`)."""
        version = record.version
        if record.state is not VersionState.STAGED:
            self.registry.set_state(version, VersionState.STAGED)  # restaged from disk
        try:
            if push is not None:
                await self.stager.stage_pushed(version, push, progress, trace)
            else:
                loaded = await self.stager.stage(record, progress, trace)
                if self.port.num_slots == 1:
                    self._in_place[version] = loaded  # copied over the slot by the commit
        except VersionRejected as exc:
            self._reject(version, str(exc), progress, trace)
            raise VersionRejectedError(f"version {version} rejected: {exc}") from None
        except SwapRefusedError as exc:  # not the version's fault (a drain holds the slot)
            trace.finish("failed", str(exc))
            raise
        except Exception as exc:
            self._reject(
                version,
                f"staging failed: {type(exc).__name__}: {exc}",
                progress,
                trace,
                outcome="failed",
            )
            raise
        self.registry.set_state(version, VersionState.VALIDATED)
        self._describe_slots()
        log.info("weights version %s validated", version, extra={"weights_version": version})

    def _reject(
        self,
        version: str,
        reason: str,
        progress: ProgressSink,
        trace: SwapTraceLike,
        outcome: str = "rejected",
    ) -> None:
        self.registry.set_state(version, VersionState.REJECTED, reason)
        trace.finish(outcome, reason)
        log.warning(
            "weights version %s %s: %s",
            version,
            outcome,
            reason,
            extra={"weights_version": version, "reason": reason},
        )
        progress(SwapProgress(outcome, version, message=reason))

    # ----------------------------------------------------------------------------- commit

    async def _commit(
        self,
        version: str,
        policy: str,
        progress: ProgressSink,
        trace: SwapTraceLike,
        outcome: str,
    ) -> SwapProgress:
        in_place = None
        if self.port.num_slots == 1:
            loaded = self._in_place.pop(version)
            in_place = InPlaceCopy(loaded.checkpoint.tensors, self.settings.staging.chunk_bytes,
                                   loaded.checkpoint.quant)  # fmt: skip
        with trace.stage("commit"):
            event = await self._follow_commit(version, policy, in_place, progress, trace)
        update = _progress_of(event)
        self._describe_slots()
        await self._persist(version)
        if self.telemetry is not None:
            self.telemetry.metrics.record_swap_stage("pause", event.pause_s)
            self.telemetry.metrics.set_weights_version(version)  # rollbacks too
        trace.finish(outcome)
        log.info(
            "weights version %s committed (%s): pause %.2f ms (steps are %.2f ms apart "
            "otherwise), %d migrated, %d restarted, %d draining",
            version,
            event.policy,
            event.pause_s * 1e3,
            event.typical_gap_s * 1e3,
            event.num_migrating,
            event.num_restarted,
            event.num_draining,
            extra={"weights_version": version, "pause_ms": round(event.pause_s * 1e3, 3)},
        )
        progress(update)
        return update

    async def _follow_commit(
        self,
        version: str,
        policy: str,
        in_place: InPlaceCopy | None,
        progress: ProgressSink,
        trace: SwapTraceLike,
    ) -> SwapEvent:
        """The commit's "committed" event, reporting the ones before it.

        Raises:
            SwapFailedError: the engine reported "failed".
        """
        async for event in self.port.commit(version, policy, in_place):
            if event.kind == "committed":
                return event
            if event.kind == "failed":
                trace.finish("failed", event.message)
            progress(_progress_of(event))
            if event.kind == "failed":
                raise SwapFailedError(f"commit of {version} failed: {event.message}")
        raise SwapFailedError(f"commit of {version} failed: the engine stopped reporting")

    async def _persist(self, version: str) -> None:
        """Record the commit, and persist it (before it is reported).

        The write's fsyncs run on a thread: right after gigabytes of weights were copied, an
        fsync can wait seconds for the disk, and every stream's tokens go out on this loop.
        """
        self.registry.activate(version)
        active = self.registry.get(version)
        if self.store is None or active.source == PUSHED:  # no files to come back to
            return
        previous = self.registry.find(self.registry.previous)
        try:
            await asyncio.to_thread(
                self.store.save,
                self.registry.model,
                _persisted(active),
                _persisted(previous) if previous else None,
            )
        except OSError as exc:  # the swap stands; a restart would come back on the old one
            log.error("could not persist the active weights version %s: %s", version, exc)

    # --------------------------------------------------------------------------- helpers

    def _policy(self, policy: str) -> str:
        """The policy a swap runs under; refused before the swap does anything."""
        policy = policy or self.settings.default_policy
        if policy not in SWAP_POLICIES:
            raise InvalidRequestError("policy", f"must be one of {', '.join(SWAP_POLICIES)}")
        if policy == "drain" and self.port.num_slots == 1:
            raise SwapRefusedError(
                "drain needs two weight slots; this daemon has one (--weight-slots): use "
                "migrate or restart"
            )
        return policy

    @contextlib.contextmanager
    def _unchanged_if_failed(self, record: WeightVersion) -> Iterator[None]:
        """A failed operation leaves the version in the state it had (a rollback target stays
        retired); only a rejection, the version's own fault, is recorded."""
        try:
            yield
        except BaseException:
            now = self.registry.find(record.version)
            if now is not None and now.state is not VersionState.REJECTED:
                self.registry.restore(record.version, record.state)
            raise

    def _loaded_versions(self) -> set[str]:
        return {v for v in self.port.status().slot_versions if v} | set(self._in_place)

    def _trace(self, version: str) -> SwapTraceLike:
        if self.telemetry is None:
            return NoTrace()
        return self.telemetry.swap_trace(self.registry.active, version)

    @contextlib.asynccontextmanager
    async def _exclusive(self, operation: str, *, wait: bool) -> AsyncIterator[None]:
        if self._lock.locked() and not wait:
            raise SwapRefusedError(f"a {self._operation} is in progress; try again when it ends")
        async with self._lock:
            self._operation = operation
            try:
                yield
            finally:
                self._operation = ""


def _host_directory(path: str) -> Path:
    """`path` as the absolute directory it names on the daemon's host.

    Raises:
        InvalidRequestError: it names no directory, or cannot name one: too long, a symlink
            loop, a NUL byte, an unknown `~user`, a component the daemon may not search.
    """
    shown = path if len(path) <= 80 else path[:80] + "..."
    try:
        directory = Path(path).expanduser().resolve()
        if directory.is_dir():
            return directory
    except (OSError, RuntimeError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise InvalidRequestError("path", f"{shown!r} is not a usable path: {reason}") from None
    raise InvalidRequestError("path", f"{shown} is not a directory on the daemon's host")


def _progress_of(event: SwapEvent) -> SwapProgress:
    stage = "committed" if event.kind == "committed" else "commit"
    if event.kind == "failed":
        stage = "failed"
    return SwapProgress(
        stage,
        event.version,
        message=event.message,
        policy=event.policy,
        num_migrating=event.num_migrating,
        num_caught_up=event.num_caught_up,
        num_restarted=event.num_restarted,
        num_draining=event.num_draining,
        pause_s=event.pause_s,
        flip_s=event.flip_s,
    )


def _persisted(record: WeightVersion) -> PersistedVersion:
    return PersistedVersion(record.version, record.path, record.manifest_digest)
