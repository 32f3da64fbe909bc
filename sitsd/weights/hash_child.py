"""A version's files hashed, and their values scanned, in a child process.

On a GPU the stager verifies a version unpaced, on host cores the engine leaves free: several
threads read the files, hash them and test their values (`manifest.check_hashes` with a
`FiniteScan` beside it). In the daemon's own process those threads share its interpreter and
its memory map with the engine's thread, which takes the interpreter back after each of its
calls into torch: on an H100 at 128 streams the steps during a verification were 25-45 ms of
host time where steady ones take 11-21 (`bench/results/swap-gpu.txt`, run 12). Here a child
does that read with its own interpreter; the daemon's stager thread waits on a pipe.

    parent (stager thread)                     child (`python -m sitsd.weights.hash_child`)
    check_complete: the manifest, its digest
    the job ------------------------JSON line-> read the manifest; the same digest, or refused
    on_progress(done, total)  <-----JSON lines-- check_hashes, FiniteScan: progress per piece
    finite, or the rejection  <------JSON line-- {"finite": {...}} or {"rejected": "..."}
    closes the child's stdin                    exits; a closed stdin (the daemon gone) ends it

What it leaves to others: opening the checkpoint and the checks against the serving model
(`checks.load_version`, `checks.validate`, in the daemon), and what happens when the child
cannot run (`ChildFailed`: the caller hashes in-process, and says so in its log).
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from sitsd.children import module_command
from sitsd.weights.finite_scan import FiniteScan
from sitsd.weights.manifest import (
    IncompleteVersion,
    Manifest,
    ManifestError,
    Progress,
    check_hashes,
    read_manifest,
)

CHILD_MODULE = "sitsd.weights.hash_child"  # what the child runs (`module_command`)


class ChildFailed(RuntimeError):
    """The child did not give an answer (it could not start, or died): nothing was decided."""


@dataclass(frozen=True)
class HashJob:
    """What the child verifies (one JSON line on its stdin)."""

    directory: str
    manifest_digest: str  # the parent's manifest: the child refuses another
    dtype: str  # the serving dtype the values must be finite in ("bfloat16"); "" none
    workers: int  # files (or blocks) hashed at once
    chunk_bytes: int  # the pieces read (0: `manifest`'s default)


def hash_in_child(
    directory: Path,
    manifest: Manifest,
    *,
    dtype: torch.dtype | None,
    workers: int,
    chunk_bytes: int,
    on_progress: Progress | None = None,
) -> dict[str, bool]:
    """Hash every file `manifest` lists (`check_complete` has passed) in a child process and,
    given the serving `dtype`, test the values the read can (`FiniteScan.finite`, returned).

    Raises:
        ManifestError: a checksum mismatch (or the manifest changed), as `check_hashes`.
        IncompleteVersion: a file went missing or shrank meanwhile.
        ChildFailed: the child gave no answer.
    """
    job = HashJob(str(directory), manifest.digest, _dtype_name(dtype), workers, chunk_bytes)
    argv, env = module_command(CHILD_MODULE)
    with tempfile.TemporaryFile() as stderr:
        try:
            child = subprocess.Popen(
                argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, env=env,
                text=True,
            )  # fmt: skip
        except OSError as exc:
            raise ChildFailed(f"the hashing child did not start: {exc}") from None
        assert child.stdin is not None
        assert child.stdout is not None
        answer: dict[str, object] | None = None
        broke = ""  # why talking to it failed, if it did
        try:
            child.stdin.write(json.dumps(asdict(job)) + "\n")
            child.stdin.flush()
            for line in child.stdout:
                message = json.loads(line)
                if not isinstance(message, dict):
                    raise ValueError(f"not a message: {line[:80]!r}")
                if "done" in message:
                    if on_progress is not None:
                        on_progress(int(message["done"]), int(message["total"]))
                    continue
                answer = message
                break
        except (OSError, ValueError) as exc:  # gone before its job was sent, or garbled
            child.kill()
            broke = f"{type(exc).__name__}: {exc}"
        finally:
            with contextlib.suppress(OSError):  # a child already gone: nothing to tell
                child.stdin.close()  # it exits on a closed stdin, answered or not
            returncode = child.wait()
        if answer is None:
            stderr.seek(0)
            lines = stderr.read().decode(errors="replace").strip().splitlines()
            last = lines[-1] if lines else broke or "no output"
            raise ChildFailed(f"the hashing child exited ({returncode}) without an answer: {last}")
    if "rejected" in answer:
        kind = IncompleteVersion if answer.get("incomplete") else ManifestError
        raise kind(str(answer["rejected"]))
    finite = answer.get("finite")
    if not isinstance(finite, dict):
        raise ChildFailed(f"the hashing child answered {sorted(answer)}")
    return {str(name): bool(ok) for name, ok in finite.items()}


def _dtype_name(dtype: torch.dtype | None) -> str:
    return "" if dtype is None else str(dtype).removeprefix("torch.")


def run(job: HashJob, emit: Callable[[dict[str, object]], None]) -> None:
    """The child's work: `emit` gets each progress line, then the answer."""
    directory = Path(job.directory)
    try:
        manifest = read_manifest(directory)
        if manifest.digest != job.manifest_digest:
            raise ManifestError(f"{directory}: manifest.json changed while it was verified")
        scan = None
        if job.dtype:
            dtype = getattr(torch, job.dtype)
            scan = FiniteScan([directory / entry.name for entry in manifest.files], dtype)

        def progress(done: int, total: int) -> None:  # the hashing threads report in turn
            emit({"done": done, "total": total})

        check_hashes(directory, manifest, on_progress=progress, workers=job.workers, also=scan,
                     chunk_bytes=job.chunk_bytes)  # fmt: skip
    except IncompleteVersion as exc:
        emit({"rejected": str(exc), "incomplete": True})
        return
    except ManifestError as exc:
        emit({"rejected": str(exc)})
        return
    emit({"finite": scan.finite() if scan is not None else {}})


def _exit_when_orphaned() -> None:
    """Wait for the parent to close stdin (answered, or the daemon gone), then exit."""
    sys.stdin.read()
    os._exit(1)


def main() -> None:
    job = HashJob(**json.loads(sys.stdin.readline()))
    threading.Thread(target=_exit_when_orphaned, daemon=True, name="orphaned").start()
    out = sys.stdout

    def emit(message: dict[str, object]) -> None:
        out.write(json.dumps(message) + "\n")
        out.flush()

    run(job, emit)


if __name__ == "__main__":
    main()
