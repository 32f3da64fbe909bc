"""How fast a version's files verify against its manifest: file by file, and block by block.

A file's sha256 is one core's sequential work, so a version verifies no faster than its largest
file, whatever the host's cores; a manifest that lists each block's digest too
(`sitsd.weights.manifest.BLOCK_BYTES`) lets as many threads as there are cores share one file.
This writes the directory's manifest with blocks, then times `verify_version_dir` with that
manifest and with the same manifest stripped of its blocks (as an earlier sitsd wrote it), for
each worker count, and restores the manifest with blocks. Medians of `--repeat` runs, the
files in the page cache (a first untimed pass reads them in).

    python -m bench.bench_verify DIR [--workers 1,2,4,8] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

from sitsd.weights.manifest import MANIFEST_NAME, verify_version_dir, write_manifest


def timed_verify(directory: Path, workers: int, repeat: int) -> list[float]:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        verify_version_dir(directory, workers=workers)
        times.append(time.perf_counter() - start)
    return times


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "directory", type=Path, help="a version directory (its manifest is rewritten)"
    )
    parser.add_argument("--workers", default="1,2,4,8")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    directory: Path = args.directory
    start = time.perf_counter()
    manifest = write_manifest(directory, workers=os.cpu_count() or 1)
    written = time.perf_counter() - start
    size = manifest.total_bytes
    blocks = sum(len(f.blocks) for f in manifest.files)
    print(f"{directory}: {len(manifest.files)} files, {size / 1e9:.2f} GB, {blocks} blocks; "
          f"{os.cpu_count()} cores; manifest written in {written:.1f} s", flush=True)  # fmt: skip
    with_blocks = (directory / MANIFEST_NAME).read_text()
    body = json.loads(with_blocks)
    for entry in body["files"]:
        entry.pop("blocks", None)
        entry.pop("block_bytes", None)
    without = json.dumps(body, indent=2) + "\n"
    verify_version_dir(directory, workers=os.cpu_count() or 1)  # into the page cache
    try:
        for label, text in (("file by file", without), ("block by block", with_blocks)):
            (directory / MANIFEST_NAME).write_text(text)
            for workers in (int(w) for w in args.workers.split(",")):
                times = timed_verify(directory, workers, args.repeat)
                median = statistics.median(times)
                print(f"  {label:15s} {workers:2d} workers  {median:6.2f} s  "
                      f"{size / median / 1e9:5.2f} GB/s   (runs: "
                      f"{', '.join(f'{t:.2f}' for t in times)})", flush=True)  # fmt: skip
    finally:
        (directory / MANIFEST_NAME).write_text(with_blocks)


if __name__ == "__main__":
    main()
