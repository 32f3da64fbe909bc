"""Version manifests: `manifest.json` lists every file of a weights version, its size and sha256.

    {"format": 1, "model": "tiny", "created": "2026-11-29T20:00:00Z",
     "files": [{"name": "config.json", "size": 714, "sha256": "..."}, ...]}

`write_manifest(dir)` writes one (what `sitsctl manifest DIR` runs); `verify_version_dir(dir)`
decides whether a directory is a complete version: its manifest is present and every file
matches it (`check_complete` is the same without the hashes, for every file event). It tells
a version still being written (`IncompleteVersion`: a file missing or shorter than listed; try
again later) from one that never will be right (`ManifestError`: a checksum mismatch, a file
longer than listed, a file the manifest does not list, a pickle, a path that escapes the
directory or, with `root`, a symlink resolving outside `root`).

Loading and validating the tensors is the stager's business (`sitsd.weights.stager`).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from sitsd.weights.checkpoint import PICKLE_SUFFIXES

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_HASH_CHUNK = 4 * 2**20

# Called with (bytes done, bytes total) while files are hashed.
Progress = Callable[[int, int], None]


class ManifestError(ValueError):
    """The directory is not, and will not become, a valid version; the message says why."""


class IncompleteVersion(Exception):
    """The directory may still be being written: look again after its next change."""


@dataclass(frozen=True)
class ManifestFile:
    """One file of a version."""

    name: str  # path relative to the version directory, '/'-separated
    size: int  # bytes
    sha256: str  # hex digest


@dataclass(frozen=True)
class Manifest:
    """A parsed `manifest.json`."""

    files: tuple[ManifestFile, ...]
    digest: str  # sha256 of the manifest file itself: names this exact content
    model: str = ""
    created: str = ""

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)


def version_files(directory: Path) -> list[Path]:
    """Every regular file under `directory` but the manifest, sorted; hidden entries (a copy
    tool's temporary files, `.cache/`) are skipped."""
    found = []
    for path in sorted(directory.rglob("*")):
        rel = path.relative_to(directory)
        if any(part.startswith(".") for part in rel.parts) or rel.as_posix() == MANIFEST_NAME:
            continue
        if path.is_file():
            found.append(path)
    return found


class AlsoRead(Protocol):
    """Work on a file's bytes as they are hashed (`sha256_file`'s `also`): one read serves both.
    Its calls come from the thread hashing that file."""

    def cuts(self, path: Path) -> Sequence[int]:
        """Offsets of `path` that no piece passed to `read` may straddle, ascending."""
        ...

    def read(self, path: Path, offset: int, piece: memoryview) -> None:
        """The bytes of `path` at `offset`, just read (valid during the call only)."""
        ...


def sha256_file(
    path: Path,
    on_bytes: Callable[[int], None] | None = None,
    also: AlsoRead | None = None,
    chunk_bytes: int = 0,
) -> str:
    """Hex sha256 of a file, read in chunks of `chunk_bytes` (0: 4 MiB) into one buffer
    (hashlib releases the GIL on large updates); each chunk also goes to `also`, cut at its
    offsets.

    The buffer is left uninitialised (numpy), not a `bytearray`: a bytearray is zeroed, its
    pages touched, while its maker holds the GIL (9-25 ms for 16 MiB on a 2-core machine, in
    every hashing thread at once as a verification starts: `bench.probe_gil`), and the
    engine's steps wait for it between their calls into torch; this buffer's pages arrive
    during the first read, which lets go of the GIL."""
    chunk = chunk_bytes or _HASH_CHUNK
    digest = hashlib.sha256()
    cuts = [*also.cuts(path)] if also is not None else []
    buffer = np.empty(chunk, dtype=np.uint8).data  # a memoryview
    with path.open("rb", buffering=0) as f:
        offset, cut = 0, 0
        while True:
            while cut < len(cuts) and cuts[cut] <= offset:
                cut += 1
            size = min(chunk, cuts[cut] - offset) if cut < len(cuts) else chunk
            view = buffer[:size]
            n = f.readinto(view)
            if not n:
                break
            digest.update(view[:n])
            if also is not None:
                also.read(path, offset, view[:n])
            offset += n
            if on_bytes is not None:
                on_bytes(n)
    return digest.hexdigest()


def sha256_files(
    paths: list[Path],
    on_progress: Progress | None = None,
    workers: int = 1,
    also: AlsoRead | None = None,
    chunk_bytes: int = 0,
) -> list[str]:
    """Hex sha256 of each file, `workers` files at a time (threads: hashlib releases the GIL);
    `on_progress` gets (bytes hashed, bytes total) from whichever thread hashed them."""
    total, done, lock = sum(p.stat().st_size for p in paths), 0, threading.Lock()

    def advance(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            if on_progress is not None:
                on_progress(done, total)

    def one(path: Path) -> str:
        return sha256_file(path, advance, also, chunk_bytes)

    if workers <= 1 or len(paths) <= 1:
        return [one(p) for p in paths]
    with ThreadPoolExecutor(min(workers, len(paths)), thread_name_prefix="sha256") as pool:
        return list(pool.map(one, paths))


def write_manifest(directory: str | os.PathLike[str], *, model: str = "",
                   on_progress: Progress | None = None, workers: int = 1) -> Manifest:  # fmt: skip
    """Hash every file of `directory` and write its `manifest.json` atomically.

    Args:
        directory: the version directory.
        model: optional model name recorded in the manifest.
        on_progress: called with (bytes hashed, bytes total) as hashing goes.
        workers: files hashed at once.

    Raises:
        ManifestError: `directory` is not a directory or holds no file.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise ManifestError(f"{directory} is not a directory")
    files = version_files(directory)
    if not files:
        raise ManifestError(f"{directory} holds no file to list")
    digests = sha256_files(files, on_progress, workers)
    entries = [
        {"name": f.relative_to(directory).as_posix(), "size": f.stat().st_size, "sha256": digest}
        for f, digest in zip(files, digests, strict=True)
    ]
    body: dict[str, object] = {"format": MANIFEST_FORMAT}
    if model:
        body["model"] = model
    body["created"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    body["files"] = entries
    data = (json.dumps(body, indent=2) + "\n").encode()
    tmp = directory / f".{MANIFEST_NAME}.{os.getpid()}.tmp"
    tmp.write_bytes(data)
    os.replace(tmp, directory / MANIFEST_NAME)  # a watcher never sees half a manifest
    return parse_manifest(data, directory / MANIFEST_NAME)


def read_manifest(directory: Path) -> Manifest:
    """The manifest of `directory`.

    Raises:
        IncompleteVersion: there is no manifest (yet).
        ManifestError: it is not a valid manifest.
    """
    path = directory / MANIFEST_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise IncompleteVersion(f"{path} does not exist (yet)") from None
    except OSError as exc:
        raise ManifestError(f"{path} cannot be read: {exc}") from exc
    return parse_manifest(data, path)


def parse_manifest(data: bytes, path: Path) -> Manifest:
    """Parse the bytes of a manifest; `path` is for messages only."""
    try:
        body = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ManifestError(f"{path} is not valid JSON: {exc}") from exc
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise ManifestError(f'{path} must be a JSON object with "format": {MANIFEST_FORMAT}')
    raw_files = body.get("files")
    if not isinstance(raw_files, list) or not raw_files:
        raise ManifestError(f'{path}: "files" must be a non-empty list')
    files = []
    for entry in raw_files:
        try:
            name, size, sha = entry["name"], entry["size"], entry["sha256"]
        except (TypeError, KeyError):
            raise ManifestError(f"{path}: each file needs name, size and sha256") from None
        valid_sha = isinstance(sha, str) and len(sha) == 64
        if not isinstance(name, str) or not isinstance(size, int) or size < 0 or not valid_sha:
            raise ManifestError(f"{path}: bad entry {entry!r}")
        _check_name(name, path)
        files.append(ManifestFile(name, size, sha.lower()))
    if len({f.name for f in files}) != len(files):
        raise ManifestError(f"{path} lists a file twice")
    return Manifest(
        files=tuple(files),
        digest=hashlib.sha256(data).hexdigest(),
        model=str(body.get("model", "")),
        created=str(body.get("created", "")),
    )


def _check_name(name: str, path: Path) -> None:
    parts = name.split("/")
    if name.startswith("/") or any(p in ("", ".", "..") for p in parts) or "\\" in name:
        raise ManifestError(f"{path}: file name {name!r} must be a plain relative path")
    if name == MANIFEST_NAME:
        raise ManifestError(f"{path} must not list itself")


def check_complete(directory: Path, *, root: Path | None = None) -> Manifest:
    """`verify_version_dir` without the hashes: cheap enough to run on every file event.

    Raises:
        IncompleteVersion: no manifest yet, or a listed file is missing or shorter.
        ManifestError: the version is wrong and stays wrong (a size, an unlisted file, a
            pickle, a path outside `root`).
    """
    if root is not None:
        _check_inside(directory, root)
    manifest = read_manifest(directory)
    _check_contents(directory, manifest, root)
    return manifest


def verify_version_dir(
    directory: Path,
    *,
    root: Path | None = None,
    on_progress: Progress | None = None,
    workers: int = 1,
) -> Manifest:
    """Check that `directory` is a complete version: its manifest and every file it lists.

    Sizes are compared first (cheap, and what tells a copy still in progress), then hashes.

    Args:
        directory: the version directory.
        root: when set (the watched directory), every path must resolve inside it.
        on_progress: called with (bytes hashed, bytes total).
        workers: files hashed at once.

    Raises:
        IncompleteVersion: no manifest yet, or a listed file is missing or shorter.
        ManifestError: the version is wrong and stays wrong (see the module docstring).
    """
    manifest = check_complete(directory, root=root)
    check_hashes(directory, manifest, on_progress=on_progress, workers=workers)
    return manifest


def check_hashes(
    directory: Path,
    manifest: Manifest,
    *,
    on_progress: Progress | None = None,
    workers: int = 1,
    also: AlsoRead | None = None,
    chunk_bytes: int = 0,
) -> None:
    """Hash every file `manifest` lists (`check_complete` has passed) against its sha256, read
    in chunks of `chunk_bytes` (0: 4 MiB); the bytes also go to `also` as they are read.

    Raises:
        ManifestError: a checksum mismatch, naming the file.
    """
    paths = [directory / entry.name for entry in manifest.files]
    digests = sha256_files(paths, on_progress, workers, also, chunk_bytes)
    for entry, digest in zip(manifest.files, digests, strict=True):
        if digest != entry.sha256:
            raise ManifestError(
                f"checksum mismatch: {entry.name} does not match the sha256 in {MANIFEST_NAME}"
            )


def _check_contents(directory: Path, manifest: Manifest, root: Path | None) -> None:
    """Sizes, unlisted files, pickles and (with `root`) symlink containment."""
    listed = {f.name for f in manifest.files}
    for path in version_files(directory):
        rel = path.relative_to(directory).as_posix()
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise ManifestError(
                f"{rel} is a pickle file; sitsd refuses pickles (loading one can run arbitrary "
                "code): convert the checkpoint to safetensors"
            )
        if rel not in listed:
            raise ManifestError(f"{rel} is not listed in {MANIFEST_NAME}")
    for entry in manifest.files:
        path = directory / entry.name
        if root is not None:
            _check_inside(path, root)
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise IncompleteVersion(f"{entry.name} is missing (still being copied?)") from None
        if size < entry.size:
            raise IncompleteVersion(f"{entry.name} has {size} of {entry.size} bytes")
        if size > entry.size:
            raise ManifestError(f"{entry.name} has {size} bytes, {MANIFEST_NAME} says {entry.size}")


def _check_inside(path: Path, root: Path) -> None:
    """Raise unless `path`, symlinks resolved, lies inside `root`."""
    resolved, base = path.resolve(), root.resolve()
    if resolved != base and base not in resolved.parents:
        raise ManifestError(f"{path} resolves to {resolved}, outside the watched directory {base}")
