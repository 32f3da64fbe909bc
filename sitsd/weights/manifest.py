"""Version manifests: `manifest.json` lists every file of a weights version, its size and sha256.

    {"format": 1, "model": "tiny", "created": "2026-11-29T20:00:00Z",
     "files": [{"name": "config.json", "size": 714, "sha256": "..."},
               {"name": "model-00001.safetensors", "size": 4976698672, "sha256": "...",
                "block_bytes": 268435456, "blocks": ["...", ...]}, ...]}

A file's sha256 is one thread's sequential work (about 4 s for a 4 GiB shard on one core), so a
version of four shards verifies no faster than one shard however many cores the host has.
`write_manifest` therefore also lists the sha256 of each `block_bytes` of a file larger than
that (`BLOCK_BYTES`; the last block shorter), and a verification of such a file checks its
blocks, any number at once, instead of the whole file's digest: every byte is still checked
against the manifest, whose own digest names the version. A manifest without blocks (written
by an earlier sitsd or by hand) is checked file by file, as before; tools that know only the
whole-file sha256 (`sha256sum`) still can.

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
import re
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np

from sitsd.weights.checkpoint import PICKLE_SUFFIXES

MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = 1
_HASH_CHUNK = 4 * 2**20
# Files larger than this are hashed block by block too (see the module docstring): 64 blocks
# for an 8B model in bfloat16, enough for any host's cores; few enough digests to read.
BLOCK_BYTES = 256 * 2**20
_BLOCK_ALIGN = 4096  # a block's size is a multiple of this (so of every value's size)
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")

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
    # The hex sha256 of each `block_bytes` of the file in turn (the last block shorter), or
    # none: a verification then checks `sha256`.
    blocks: tuple[str, ...] = ()
    block_bytes: int = 0

    def spans(self, directory: Path) -> list[Span]:
        """What a verification hashes of this file: its blocks, else the whole file. The last
        span runs to the end of the file, so that bytes added past its size do not match."""
        path = directory / self.name
        if not self.blocks:
            return [Span(path, 0, None, self.sha256, self.name)]
        ranges = block_ranges(self.size, self.block_bytes)
        out = []
        for i, (digest, (start, end)) in enumerate(zip(self.blocks, ranges, strict=True)):
            what = f"{self.name} (bytes {start} to {end}, block {i + 1} of {len(ranges)})"
            out.append(Span(path, start, None if i == len(ranges) - 1 else end, digest, what))
        return out


def block_ranges(size: int, block_bytes: int) -> list[tuple[int, int]]:
    """`[start, end)` of each block of a file of `size` bytes, in order (the last shorter)."""
    return [(start, min(start + block_bytes, size)) for start in range(0, size, block_bytes)]


@dataclass(frozen=True)
class Span:
    """Bytes `[start, end)` of a file (`end` None: to its end) and the sha256 they must have."""

    path: Path
    start: int
    end: int | None
    sha256: str  # "" where the digest is to be found (writing a manifest), not checked
    what: str  # how a mismatch names it: the file's name, and which bytes


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
    `read` may be called from several threads at once, for different parts of one file (a
    file hashed block by block)."""

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
    """Hex sha256 of a file (`sha256_span` of all of it)."""
    return sha256_span(path, 0, None, on_bytes, also, chunk_bytes)


def sha256_span(
    path: Path,
    start: int = 0,
    end: int | None = None,
    on_bytes: Callable[[int], None] | None = None,
    also: AlsoRead | None = None,
    chunk_bytes: int = 0,
    buffer: memoryview | None = None,
) -> str:
    """Hex sha256 of bytes `[start, end)` of a file (`end` None: to its end), read in chunks of
    `chunk_bytes` (0: 4 MiB) into one buffer (`buffer`, if given and large enough: a thread
    hashing many spans reuses one); hashlib releases the GIL on large updates. Each chunk also
    goes to `also`, cut at its offsets."""
    digest = hashlib.sha256()
    cuts = also.cuts(path) if also is not None else ()
    for offset, piece in _pieces(path, start, end, cuts, chunk_bytes, buffer):
        digest.update(piece)
        if also is not None:
            also.read(path, offset, piece)
        if on_bytes is not None:
            on_bytes(len(piece))
    return digest.hexdigest()


def _pieces(path: Path, start: int, end: int | None, cuts: Sequence[int], chunk_bytes: int,
            buffer: memoryview | None = None) -> Iterator[tuple[int, memoryview]]:  # fmt: skip
    """(offset, bytes) of `[start, end)` of a file in turn, each at most `chunk_bytes` (0: 4
    MiB) and none straddling one of `cuts` (ascending offsets): views of one buffer, each
    valid until the next.

    The buffer is left uninitialised (numpy), not a `bytearray`: a bytearray is zeroed, its
    pages touched, while its maker holds the GIL (9-25 ms for 16 MiB on a 2-core machine, in
    every hashing thread at once as a verification starts: `bench.probe_gil`), and the
    engine's steps wait for it between their calls into torch; this buffer's pages arrive
    during the first read, which lets go of the GIL."""
    chunk = chunk_bytes or _HASH_CHUNK
    cuts = [c for c in cuts if c > start]
    with path.open("rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        stop = size if end is None else min(end, size)
        if buffer is None or len(buffer) < min(chunk, stop - start):
            buffer = _buffer(max(1, min(chunk, stop - start)))
        buffer = buffer[:chunk]
        f.seek(start)
        offset, cut = start, 0
        while offset < stop or end is None:
            while cut < len(cuts) and cuts[cut] <= offset:
                cut += 1
            n = min(len(buffer), stop - offset) if end is not None else len(buffer)
            if cut < len(cuts):
                n = min(n, cuts[cut] - offset)
            n = f.readinto(buffer[:n])
            if not n:
                break
            yield offset, buffer[:n]
            offset += n


def _buffer(nbytes: int) -> memoryview:
    """An uninitialised buffer (see `_pieces`)."""
    return np.empty(nbytes, dtype=np.uint8).data


def _hash_spans(
    spans: Sequence[Span],
    on_progress: Progress | None,
    workers: int,
    also: AlsoRead | None,
    chunk_bytes: int,
) -> list[str]:
    """Hex sha256 of each span, `workers` at a time (threads: hashlib releases the GIL);
    `on_progress` gets (bytes hashed, bytes total) from whichever thread hashed them."""
    total = sum((s.path.stat().st_size if s.end is None else s.end) - s.start for s in spans)
    done, lock = 0, threading.Lock()

    def advance(n: int) -> None:
        nonlocal done
        with lock:
            done += n
            if on_progress is not None:
                on_progress(done, total)

    buffers = threading.local()  # one read buffer per hashing thread, for all its spans

    def one(span: Span) -> str:
        if not hasattr(buffers, "buffer"):
            buffers.buffer = _buffer(chunk_bytes or _HASH_CHUNK)
        return sha256_span(span.path, span.start, span.end, advance, also, chunk_bytes,
                           buffers.buffer)  # fmt: skip

    if workers <= 1 or len(spans) <= 1:
        return [one(s) for s in spans]
    with ThreadPoolExecutor(min(workers, len(spans)), thread_name_prefix="sha256") as pool:
        return list(pool.map(one, spans))


def sha256_files(
    paths: list[Path],
    on_progress: Progress | None = None,
    workers: int = 1,
    also: AlsoRead | None = None,
    chunk_bytes: int = 0,
) -> list[str]:
    """Hex sha256 of each file, `workers` files at a time (threads: hashlib releases the GIL);
    `on_progress` gets (bytes hashed, bytes total) from whichever thread hashed them."""
    spans = [Span(p, 0, None, "", p.name) for p in paths]
    return _hash_spans(spans, on_progress, workers, also, chunk_bytes)


def write_manifest(directory: str | os.PathLike[str], *, model: str = "",
                   on_progress: Progress | None = None, workers: int = 1,
                   block_bytes: int = BLOCK_BYTES) -> Manifest:  # fmt: skip
    """Hash every file of `directory` and write its `manifest.json` atomically.

    Args:
        directory: the version directory.
        model: optional model name recorded in the manifest.
        on_progress: called with (bytes hashed, bytes total) as hashing goes.
        workers: files (and blocks) hashed at once.
        block_bytes: files larger than this also list the sha256 of each block of this size
            (a positive multiple of 4096; see the module docstring).

    Raises:
        ManifestError: `directory` is not a directory or holds no file.
        ValueError: `block_bytes` is not a positive multiple of 4096.
    """
    if block_bytes <= 0 or block_bytes % _BLOCK_ALIGN:
        raise ValueError(f"block_bytes must be a positive multiple of {_BLOCK_ALIGN}, got "
                         f"{block_bytes}")  # fmt: skip
    directory = Path(directory)
    if not directory.is_dir():
        raise ManifestError(f"{directory} is not a directory")
    files = version_files(directory)
    if not files:
        raise ManifestError(f"{directory} holds no file to list")
    # Each file whole (first: the longest spans), then the blocks of the larger ones, any
    # number at once: a larger file is read twice, on two threads, in the time of one read.
    sizes = [f.stat().st_size for f in files]
    blocks = [block_ranges(size, block_bytes) if size > block_bytes else [] for size in sizes]
    spans = [Span(f, 0, size, "", f.name) for f, size in zip(files, sizes, strict=True)]
    for f, ranges in zip(files, blocks, strict=True):
        spans += [Span(f, start, end, "", f.name) for start, end in ranges]
    listed = sum(sizes)
    hashed = listed + sum(size for size, ranges in zip(sizes, blocks, strict=True) if ranges)

    def progress(done: int, total: int) -> None:  # in the files' bytes, not the bytes hashed
        if on_progress is not None:
            on_progress(done * listed // max(1, hashed), listed)

    digests = iter(_hash_spans(spans, progress, workers, None, 0))
    entries: list[dict[str, object]] = [
        {"name": f.relative_to(directory).as_posix(), "size": size, "sha256": next(digests)}
        for f, size in zip(files, sizes, strict=True)
    ]
    for entry, ranges in zip(entries, blocks, strict=True):
        if ranges:
            entry.update(block_bytes=block_bytes, blocks=[next(digests) for _ in ranges])
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
        if not isinstance(name, str) or not isinstance(size, int) or size < 0 or not _hex(sha):
            raise ManifestError(f"{path}: bad entry {entry!r}")
        _check_name(name, path)
        blocks, block_bytes = _blocks(entry, size, path)
        files.append(ManifestFile(name, size, sha.lower(), blocks, block_bytes))
    if len({f.name for f in files}) != len(files):
        raise ManifestError(f"{path} lists a file twice")
    return Manifest(
        files=tuple(files),
        digest=hashlib.sha256(data).hexdigest(),
        model=str(body.get("model", "")),
        created=str(body.get("created", "")),
    )


def _hex(digest: object) -> bool:
    """A sha256 in hex: 64 hex digits, nothing else (`int(_, 16)` would take "0x", "_" and
    spaces)."""
    return isinstance(digest, str) and _SHA256_HEX.fullmatch(digest) is not None


def _blocks(entry: dict[str, object], size: int, path: Path) -> tuple[tuple[str, ...], int]:
    """A file entry's block digests and block size: both listed, or neither."""
    if "blocks" not in entry and "block_bytes" not in entry:
        return (), 0
    blocks, block_bytes = entry.get("blocks"), entry.get("block_bytes")
    name = entry["name"]
    if (not isinstance(block_bytes, int) or isinstance(block_bytes, bool) or block_bytes <= 0
            or block_bytes % _BLOCK_ALIGN):  # fmt: skip
        raise ManifestError(f"{path}: {name}: block_bytes must be a positive multiple of "
                            f"{_BLOCK_ALIGN}, got {block_bytes!r}")  # fmt: skip
    count = len(block_ranges(size, block_bytes))
    if not isinstance(blocks, list) or len(blocks) != count or not all(map(_hex, blocks)):
        raise ManifestError(f"{path}: {name}: blocks must list {count} sha256 digests (one per "
                            f"{block_bytes} bytes of its {size})")  # fmt: skip
    return tuple(b.lower() for b in blocks), block_bytes


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
        workers: files (or blocks) hashed at once.

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
    """Hash every file `manifest` lists (`check_complete` has passed) against its sha256, or
    each of its blocks against theirs, `workers` files or blocks at once, read in chunks of
    `chunk_bytes` (0: 4 MiB); the bytes also go to `also` as they are read.

    Raises:
        ManifestError: a checksum mismatch, naming the file (and the block).
    """
    spans = [span for entry in manifest.files for span in entry.spans(directory)]
    digests = _hash_spans(spans, on_progress, workers, also, chunk_bytes)
    for span, digest in zip(spans, digests, strict=True):
        if digest != span.sha256:
            raise ManifestError(
                f"checksum mismatch: {span.what} does not match the sha256 in {MANIFEST_NAME}"
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
