"""Weight versions: the registry of known versions and their states, and the persisted active one.

A version is a directory (Hugging Face safetensors or GGUF) with a `manifest.json`; its id is
the directory's name unless the operator names it, and is a name either way (`check_version_id`:
a bounded charset and length, never a path). Its state moves

    staged -> validated -> active -> retired (-> active again on a rollback)
          \\-> rejected (with the reason; a later change to its files may stage it again)

`VersionRegistry` keeps them (thread-safe: the API, the watcher and the stager all touch it) and
which version is active and which was active before (the rollback target). `ActiveVersionStore`
persists the active version of each model in the daemon's state directory, atomically (temp
file in the same directory, fsync, `os.replace`, fsync of the directory), so a daemon restarted,
even after SIGKILL, comes back on it.

What staging, validating and committing do is `sitsd.weights.swap`'s business.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import re
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sitsd.weights.errors import (
    InvalidVersionIdError,
    UnknownVersionError,
    VersionConflictError,
    VersionError,
)

ACTIVE_STATE_FILE = "active-weights.json"
_STATE_FORMAT = 1
# A version id is a name: letters, digits and . _ @ + -, starting with a letter or a digit (so
# never "." or "..", a hidden file or an option), at most 128 characters; never a path.
_VERSION_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._@+-]{0,127}")
_NOT_IN_ID = re.compile(r"[^A-Za-z0-9._@+-]")


def check_version_id(version: str) -> str:
    """`version`, if it is a valid version id.

    Raises:
        InvalidVersionIdError: it is not (the message says what one is).
    """
    if not is_version_id(version):
        raise InvalidVersionIdError(
            f"version: {version[:160]!r} is not a version id: 1-128 letters, digits and . _ @ + -"
            ", starting with a letter or a digit (a name, never a path)"
        )
    return version


def is_version_id(version: str) -> bool:
    return _VERSION_ID.fullmatch(version) is not None


def version_id_from(name: str) -> str:
    """A valid version id made of `name` (a checkpoint's file or directory name)."""
    cleaned = _NOT_IN_ID.sub("-", name).lstrip("._@+-")[:128]
    return cleaned or "model"


class VersionState(enum.StrEnum):
    STAGED = "staged"  # registered, complete on disk, not yet validated
    VALIDATED = "validated"  # loaded and checked (canary included): ready to commit
    ACTIVE = "active"  # serving new requests
    RETIRED = "retired"  # was active; the previous one stays the rollback target
    REJECTED = "rejected"  # failed a check; `reason` says which


_TRANSITIONS: dict[VersionState, frozenset[VersionState]] = {
    VersionState.STAGED: frozenset({VersionState.VALIDATED, VersionState.REJECTED}),
    VersionState.VALIDATED: frozenset(
        {VersionState.ACTIVE, VersionState.STAGED, VersionState.REJECTED}
    ),
    VersionState.ACTIVE: frozenset({VersionState.RETIRED}),
    VersionState.RETIRED: frozenset(
        {VersionState.ACTIVE, VersionState.STAGED, VersionState.VALIDATED}
    ),
    VersionState.REJECTED: frozenset({VersionState.STAGED}),
}


@dataclass
class WeightVersion:
    """One version of the served model's weights."""

    model: str  # the served model's name
    version: str  # its id: the directory name, unless given
    path: str  # the checkpoint (a directory, or a .gguf file for the start-up model)
    manifest_digest: str  # sha256 of its manifest.json ("" when it has none: start-up model)
    state: VersionState
    source: str  # "startup", "restored", "deploy", "watch" or "push" (a trainer's tensors)
    reason: str = ""  # why it was rejected
    created_at: float = 0.0  # time.time() when registered
    updated_at: float = 0.0  # time.time() of the last state change
    precision: str = ""  # what runs in which bits once in a slot ("" until it was in one)
    weight_bytes: int = 0  # bytes its weights take in a slot (0 until it was in one)


class VersionRegistry:
    """The versions of one served model; every method is thread-safe and returns copies."""

    def __init__(self, model: str) -> None:
        self.model = model
        self._lock = threading.Lock()
        self._versions: dict[str, WeightVersion] = {}
        self._active = ""
        self._previous = ""  # the version active before the current one: the rollback target

    def register(
        self, version: str, path: str, digest: str, source: str, state: VersionState
    ) -> tuple[WeightVersion, bool]:
        """Add a version; (its record, True if it is new or was re-staged).

        An id already registered with the same manifest digest is the same version (nothing
        changes). A rejected version whose manifest changed is staged again.

        Raises:
            InvalidVersionIdError: `version` is not a name (`check_version_id`).
            VersionConflictError: the id is taken by other content.
        """
        check_version_id(version)
        now = time.time()
        with self._lock:
            known = self._versions.get(version)
            if known is not None and known.manifest_digest == digest:
                return dataclasses.replace(known), False
            if known is not None and known.state is not VersionState.REJECTED:
                raise VersionConflictError(
                    f"version {version!r} exists already ({known.path}, {known.state}) with "
                    "other content; give the new one another name"
                )
            record = WeightVersion(
                self.model, version, path, digest, state, source, created_at=now, updated_at=now
            )
            self._versions[version] = record
            if state is VersionState.ACTIVE:
                self._active = version
            return dataclasses.replace(record), True

    def get(self, version: str) -> WeightVersion:
        """The record of `version`.

        Raises:
            UnknownVersionError: no such version.
        """
        with self._lock:
            known = self._versions.get(version)
            if known is None:
                raise UnknownVersionError(f"unknown weights version {version!r}")
            return dataclasses.replace(known)

    def find(self, version: str) -> WeightVersion | None:
        with self._lock:
            known = self._versions.get(version)
            return None if known is None else dataclasses.replace(known)

    def remove(self, version: str) -> None:
        """Forget `version` (a pushed one past the number kept); never the active one or the
        rollback target.

        Raises:
            VersionError: it is the active version or the rollback target.
        """
        with self._lock:
            if version in (self._active, self._previous):
                raise VersionError(f"version {version!r} is active or the rollback target")
            self._versions.pop(version, None)

    def set_state(self, version: str, state: VersionState, reason: str = "") -> WeightVersion:
        """Move `version` to `state` (must be an allowed transition).

        Raises:
            UnknownVersionError: no such version.
            VersionError: the transition is not allowed.
        """
        with self._lock:
            known = self._versions.get(version)
            if known is None:
                raise UnknownVersionError(f"unknown weights version {version!r}")
            if state is not known.state and state not in _TRANSITIONS[known.state]:
                raise VersionError(f"version {version!r} cannot go from {known.state} to {state}")
            known.state = state
            known.reason = reason if state is VersionState.REJECTED else ""
            known.updated_at = time.time()
            return dataclasses.replace(known)

    def describe(self, version: str, precision: str, weight_bytes: int) -> None:
        """Record what `version` runs in which bits and its bytes, as a slot holds it."""
        with self._lock:
            known = self._versions.get(version)
            if known is not None:
                known.precision, known.weight_bytes = precision, weight_bytes

    def restore(self, version: str, state: VersionState) -> None:
        """Put `version` back in the state it had before an operation that failed (whatever
        the transitions allow: a failed operation changes no state)."""
        with self._lock:
            known = self._versions.get(version)
            if known is not None and known.state is not state:
                known.state = state
                known.updated_at = time.time()

    def activate(self, version: str) -> None:
        """Record a commit: `version` active, the one before retired (and the rollback target)."""
        with self._lock:
            old = self._active
            if old == version:
                return
            self._previous = old
            self._active = version
        if old:
            self.set_state(old, VersionState.RETIRED)
        self.set_state(version, VersionState.ACTIVE)

    @property
    def active(self) -> str:
        with self._lock:
            return self._active

    @property
    def previous(self) -> str:
        """The rollback target ("" when there is none)."""
        with self._lock:
            return self._previous

    def set_previous(self, version: str) -> None:
        """Restore the rollback target (after a restart)."""
        with self._lock:
            self._previous = version

    def list(self) -> list[WeightVersion]:
        """Every version, oldest first."""
        with self._lock:
            records = sorted(self._versions.values(), key=lambda v: v.created_at)
            return [dataclasses.replace(v) for v in records]


@dataclass(frozen=True)
class VersionsView:
    """Every version, with where the weight slots stand (for ListVersions)."""

    versions: list[WeightVersion]  # oldest first
    slots: dict[str, str]  # version -> "active" | "standby", for versions in a slot
    active: str
    previous: str  # the rollback target ("" when none)
    num_slots: int


@dataclass(frozen=True)
class PersistedVersion:
    """What the state file remembers of a version."""

    version: str
    path: str
    manifest_digest: str


class ActiveVersionStore:
    """`<state dir>/active-weights.json`: per model, the active version and the one before."""

    def __init__(self, state_dir: str | os.PathLike[str]) -> None:
        self.path = Path(state_dir).expanduser() / ACTIVE_STATE_FILE

    def load(self, model: str) -> tuple[PersistedVersion | None, PersistedVersion | None]:
        """(active, previous) persisted for `model`; Nones when nothing (readable) is there."""
        try:
            body = json.loads(self.path.read_text(encoding="utf-8"))
            entry = body["models"][model]
        except (OSError, ValueError, KeyError, TypeError):
            return None, None
        return _persisted(entry.get("active")), _persisted(entry.get("previous"))

    def save(self, model: str, active: PersistedVersion, previous: PersistedVersion | None) -> None:
        """Persist `model`'s active version atomically (and durably: fsyncs)."""
        try:
            body = json.loads(self.path.read_text(encoding="utf-8"))
            if not isinstance(body.get("models"), dict):
                raise ValueError
        except (OSError, ValueError, AttributeError):
            body = {"format": _STATE_FORMAT, "models": {}}
        body["models"][model] = {
            "active": dataclasses.asdict(active),
            "previous": dataclasses.asdict(previous) if previous else None,
            "committed_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        write_atomically(self.path, (json.dumps(body, indent=2) + "\n").encode())


def _persisted(entry: object) -> PersistedVersion | None:
    if not isinstance(entry, dict):
        return None
    try:
        return PersistedVersion(
            str(entry["version"]), str(entry["path"]), str(entry.get("manifest_digest", ""))
        )
    except KeyError:
        return None


def write_atomically(path: Path, data: bytes) -> None:
    """Replace `path` with `data` so that a crash leaves the old or the new content, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # the rename itself survives a power cut
    finally:
        os.close(dir_fd)
