"""Live weight pushes from a trainer: the daemon's receiving side, whatever the transport.

A push is a weights version that arrives as tensors instead of a directory, over one of three
transports, each a `PushSource` (`push_plan`):

    grpc   Admin.UpdateWeights, a client stream of byte chunks        push_stream.StreamedPush
    ipc    Admin.UpdateWeightsIpc, CUDA IPC handles on the same GPU    push_ipc.IpcPush
    dist   Admin.UpdateWeightsFromGroup, broadcasts in a weight group  push_dist.GroupPush
           the daemon joined (Admin.JoinWeightGroup)

`WeightPushes.push` names the version (the trainer's id, e.g. `step-1200`, or a generated
`push-...`), records where it came from, and hands it to the swap manager
(`SwapManager.push`): the same staging path as a version read from files, so the same
validation, canary, commit policies, rollback and registry. Then it keeps the outcome and each
stage's time as the last update (`Admin.Status`, `sitsd_last_weight_update_seconds`) and
forgets pushed versions beyond the newest `keep_pushed` (never the active one, the rollback
target or one in a slot). Turning proto messages into sources is `sitsd.api.push`'s.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import re
import secrets
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from sitsd.engine.errors import InvalidRequestError
from sitsd.observability import Observability
from sitsd.weights.errors import (
    SwapFailedError,
    VersionConflictError,
    VersionError,
    VersionRejectedError,
)
from sitsd.weights.progress import NoTrace, ProgressSink, SwapTraceLike
from sitsd.weights.push_dist import GroupMember, GroupSpec
from sitsd.weights.push_ipc import IpcHandle, IpcMappings, IpcPush, device_uuid
from sitsd.weights.push_plan import PushPlan, PushSource
from sitsd.weights.swap import PUSHED, SwapManager

log = logging.getLogger("sitsd.swap")

STAGES = ("receive", "validate", "canary", "commit")
_VERSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@:+-]{0,127}")


@dataclass(frozen=True)
class PushSettings:
    """Limits of live pushes (from `WeightsConfig`)."""

    keep_pushed: int = 8  # pushed versions remembered (the newest; more are forgotten)
    ipc_keep_mapped: bool = False  # a trainer's IPC storages stay mapped until the next push


@dataclass(frozen=True)
class PushHeader:
    """What a push asks for besides its tensors."""

    version: str = ""  # its id; "" = generated
    policy: str = ""  # migrate, drain or restart; "" = the daemon's default
    commit: bool = True  # False: validated and left in the standby slot (commit with Swap)
    origin: str = ""  # the trainer's words about it (run, step), kept with the version


@dataclass(frozen=True)
class UpdateReport:
    """One push, as it ended: for `Admin.Status`, the metrics and the caller."""

    version: str
    transport: str  # grpc, ipc or dist
    outcome: str  # committed, staged, rejected, refused (not now or not this) or failed
    message: str = ""  # why it was rejected, refused or failed
    num_tensors: int = 0  # tensors the push carried (a partial one: fewer than the model's)
    num_bytes: int = 0  # bytes of them received
    stage_s: dict[str, float] = field(default_factory=dict)  # receive, validate, canary, commit
    total_s: float = 0.0  # from the call to its end (the commit)
    pause_s: float = 0.0  # committed: the serving pause at the flip
    policy: str = ""  # committed: the policy applied
    finished_at: float = 0.0  # time.time()


class StageTimes:
    """A `SwapTraceLike` keeping each stage's seconds, around the swap's own trace (made on
    first use: a push refused before it began leaves no trace)."""

    def __init__(self, make_trace: Callable[[], SwapTraceLike]) -> None:
        self._make_trace = make_trace
        self._inner: SwapTraceLike | None = None
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[object]:
        started = time.monotonic()
        try:
            with self._trace().stage(name) as span:
                yield span
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.monotonic() - started

    def finish(self, outcome: str, error: str = "") -> None:
        self._trace().finish(outcome, error)

    def _trace(self) -> SwapTraceLike:
        if self._inner is None:
            self._inner = self._make_trace()
        return self._inner


class WeightPushes:
    """The receiving side of live pushes for one served model (see the module docstring)."""

    def __init__(
        self,
        manager: SwapManager,
        settings: PushSettings,
        telemetry: Observability | None = None,
    ) -> None:
        self._manager = manager
        self._settings = settings
        self._telemetry = telemetry
        self.last: UpdateReport | None = None  # the last push, whatever became of it
        self.group: GroupMember | None = None  # the weight group joined last
        # A trainer's storages the last IPC push mapped, kept for the next (`ipc_keep_mapped`).
        self.ipc_mappings = IpcMappings()

    def ipc_push(self, plan: PushPlan, handles: list[IpcHandle]) -> IpcPush:
        """An IPC push's source: its storages mapped anew, or through the mappings kept from
        the last push (`PushSettings.ipc_keep_mapped`)."""
        kept = self.ipc_mappings if self._settings.ipc_keep_mapped else None
        return IpcPush(plan, handles, kept)

    def close(self) -> None:
        """Let go of every mapping kept of a trainer's memory (the daemon stops)."""
        self.ipc_mappings.clear()

    @property
    def device(self) -> torch.device:
        """The serving device (an IPC push must come from the same GPU)."""
        return self._manager.port.device

    @property
    def device_uuid(self) -> str:
        """The serving GPU's UUID ("" on a CPU)."""
        return device_uuid(self.device) if self.device.type == "cuda" else ""

    async def join_group(self, spec: GroupSpec) -> GroupMember:
        """Become a rank of a trainer's weight group (replacing any group joined before).

        Raises:
            InvalidRequestError: a field that cannot work. GroupJoinError: the rendezvous failed.
        """
        member = await GroupMember.join(spec, self.device)
        self.group = member
        log.info("joined weight group %s as rank %d of %d (%s, store %s:%d)", spec.name,
                 spec.rank, spec.world_size, spec.backend, spec.master_address,
                 spec.master_port)  # fmt: skip
        return member

    async def push(
        self,
        header: PushHeader,
        source: PushSource,
        transport: str,
        peer: str,
        progress: ProgressSink,
    ) -> UpdateReport:
        """Stage (and commit) what `source` brings as a new version; its report.

        Raises:
            InvalidRequestError: a bad version id or policy. Whatever `SwapManager.push`
            raises; the report (`last`) says how it ended either way.
        """
        started = time.monotonic()
        version = header.version or _generated_id()
        trace = StageTimes(lambda: self._trace(version))
        report = UpdateReport(version, transport, "failed", num_tensors=len(source.plan.tensors))
        try:
            if not _VERSION_ID.fullmatch(version):
                raise InvalidRequestError("version", "1-128 letters, digits and ._@:+- only")
            where = f"{transport} push from {peer}" + (
                f" ({header.origin})" if header.origin else ""
            )
            done = await self._manager.push(
                version, where, source, header.policy, progress, commit=header.commit, trace=trace
            )
            report = dataclasses.replace(
                report, outcome=done.stage, pause_s=done.pause_s, policy=done.policy,
                num_bytes=source.plan.nbytes,
            )  # fmt: skip
        except Exception as exc:
            report = dataclasses.replace(report, outcome=_outcome_of(exc), message=str(exc))
            raise
        finally:
            stages = {s: trace.seconds[s] for s in STAGES if s in trace.seconds}
            report = dataclasses.replace(
                report, stage_s=stages, total_s=time.monotonic() - started, finished_at=time.time()
            )
            self._record(report)
        return report

    # ------------------------------------------------------------------------------ internal

    def _trace(self, version: str) -> SwapTraceLike:
        if self._telemetry is None:
            return NoTrace()
        return self._telemetry.swap_trace(self._manager.registry.active, version)

    def _record(self, report: UpdateReport) -> None:
        self.last = report
        if self._telemetry is not None:
            # Every stage is set: one this push skipped (no canary) reads 0, not the last one's.
            stages = {s: report.stage_s.get(s, 0.0) for s in STAGES} | {"total": report.total_s}
            self._telemetry.metrics.record_weight_update(
                report.transport, report.outcome, report.num_bytes, stages
            )
        log.info(
            "weight push %s over %s: %s in %.2f s (%s)%s", report.version, report.transport,
            report.outcome, report.total_s,
            ", ".join(f"{s} {t:.3f} s" for s, t in report.stage_s.items()) or "no stage",
            f": {report.message}" if report.message else "",
            extra={"weights_version": report.version},
        )  # fmt: skip
        self._forget_old()

    def _forget_old(self) -> None:
        """Forget the oldest pushed versions beyond `keep_pushed`, except those still in use."""
        view = self._manager.versions()
        in_use = {view.active, view.previous, *view.slots}
        pushed = [v.version for v in view.versions if v.source == PUSHED]  # oldest first
        excess = len(pushed) - self._settings.keep_pushed
        for version in pushed:
            if excess <= 0:
                break
            if version not in in_use:
                self._manager.registry.remove(version)
                excess -= 1


def _generated_id() -> str:
    return f"push-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(2)}"


def _outcome_of(exc: Exception) -> str:
    if isinstance(exc, VersionRejectedError):
        return "rejected"
    if isinstance(exc, SwapFailedError):
        return "failed"
    if isinstance(exc, InvalidRequestError | VersionConflictError | VersionError):
        return "refused"  # not now (another operation, one slot) or not this (id, policy)
    return "failed"
