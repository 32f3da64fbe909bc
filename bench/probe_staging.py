"""Where a swap's staging time goes between a version's files and the standby slot: each
host-side part timed alone, then beside a serving loop on the same GPU.

Staging 16 GB of Llama-3-8B shapes took an H200 10-24 s (`bench.bench_swap`, 32 and 128
streams), where the link alone would take well under a second. The parts, over the first
`--gib` GiB of tensors of a version directory (bf16 safetensors, e.g. the one
`bench.bench_swap` wrote, or one written here):

    hash          sha256 of the files, a new bytes object per read (`f.read`)
    hash-into     sha256 from one reused buffer (`readinto`)
    read-mmap     the memory-mapped tensors copied into a pinned buffer (what `PinnedUpload`
                  does on the stager's thread), per chunk size
    read-file     the same bytes read from the file straight into the pinned buffer
    h2d           pinned buffer to the device, per chunk size (device time)
    upload        `PinnedUpload.upload` over every tensor chunk (the staging copy's loop)

The serving loop is `bench.probe_ipc`'s (a CUDA graph of one decode step's matmuls at 32 rows,
then a host sync) with an engine's host work between the launch and the sync: `--host-ms` of
Python in twenty pieces, each followed by a small torch call (each lets go of the interpreter,
as the engine's calls into torch do, and must get it back). Beside it each part reports its
own rate and the loop's periods meanwhile, against its median alone.

    python3 -m bench.probe_staging --dir /tmp/swap/v1 --gib 4
"""

from __future__ import annotations

import argparse
import hashlib
import statistics
import threading
import time
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path

import torch

from bench.probe_ipc import Timeline, decode_step_graph
from sitsd.runtime.weight_slots import PinnedUpload
from sitsd.weights.finite_scan import safetensors_header

MIB = 2**20


def tensor_extents(directory: Path, limit: int) -> list[tuple[Path, int, int]]:
    """(file, byte offset, byte length) of each tensor, in file order, up to `limit` bytes."""
    out: list[tuple[Path, int, int]] = []
    total = 0
    for file in sorted(directory.glob("*.safetensors")):
        data, header = safetensors_header(file)
        for begin, end in sorted(v["data_offsets"] for v in header.values()):
            out.append((file, data + begin, end - begin))
            total += end - begin
            if total >= limit:
                return out
    return out


def pieces(extents: list[tuple[Path, int, int]], chunk: int) -> Iterator[tuple[Path, int, int]]:
    for file, offset, length in extents:
        for start in range(0, length, chunk):
            yield file, offset + start, min(chunk, length - start)


def timed(
    name: str, nbytes: int, work: Callable[[], None], timeline: Timeline | None = None
) -> None:
    """Run `work`, print its rate (and the serving loop's periods meanwhile, if one runs)."""
    start = time.perf_counter()
    work()
    end = time.perf_counter()
    line = f"  {name:28s} {nbytes / (end - start) / 1e9:7.2f} GB/s  ({end - start:6.2f} s)"
    if timeline is not None:
        periods = sorted(e - s for s, e in list(timeline.periods) if e > start and s < end)
        if periods:
            p99 = periods[int(0.99 * (len(periods) - 1))]
            line += (f"   serving P50 / P99 / max {1e3 * statistics.median(periods):5.2f} / "
                     f"{1e3 * p99:5.2f} / {1e3 * periods[-1]:6.2f} ms")  # fmt: skip
    print(line, flush=True)


def hash_files(files: list[Path], into: bool) -> None:
    buffer = bytearray(8 * MIB)
    view = memoryview(buffer)
    for file in files:
        digest = hashlib.sha256()
        with file.open("rb", buffering=0) as f:
            if into:
                while n := f.readinto(buffer):
                    digest.update(view[:n])
            else:
                while chunk := f.read(8 * MIB):
                    digest.update(chunk)


Extents = list[tuple[Path, int, int]]


def read_mmap(
    maps: dict[Path, torch.Tensor], extents: Extents, chunk: int, pinned: torch.Tensor
) -> None:
    for file, offset, length in pieces(extents, chunk):
        pinned[:length].copy_(maps[file][offset : offset + length])


def read_file(extents: Extents, chunk: int, pinned: torch.Tensor) -> None:
    view = memoryview(pinned.numpy())
    handles: dict[Path, object] = {}
    try:
        for file, offset, length in pieces(extents, chunk):
            f = handles.get(file)
            if f is None:
                f = handles[file] = file.open("rb", buffering=0)
            f.seek(offset)
            f.readinto(view[:length])
    finally:
        for f in handles.values():
            f.close()


def h2d(nbytes: int, chunk: int, pinned: torch.Tensor, dst: torch.Tensor) -> float:
    """Device seconds to move `nbytes` from the pinned buffer in `chunk` pieces."""
    stream = torch.cuda.Stream()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        begin.record()
        for start in range(0, nbytes, chunk):
            n = min(chunk, nbytes - start)
            dst[:n].copy_(pinned[:n], non_blocking=True)
        end.record()
    end.synchronize()
    return begin.elapsed_time(end) / 1e3


def upload(
    maps: dict[Path, torch.Tensor], extents: Extents, chunk: int, dst: torch.Tensor,
    uploads: PinnedUpload,
) -> None:  # fmt: skip
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for file, offset, length in pieces(extents, chunk):
            uploads.upload(maps[file][offset : offset + length], dst[:length])
        uploads.wait()
    stream.synchronize()


def serve(stop: threading.Event, timeline: Timeline, host_s: float) -> None:
    """Decode steps of Llama-3-8B shapes at 32 rows from a CUDA graph, each after a small
    upload and with `host_s` of Python in twenty pieces, each ending in a call into torch."""
    torch.cuda.set_device(0)
    small = torch.zeros(64)
    inputs = torch.zeros(16384, pin_memory=True)  # a step's uploads (ids, positions, tables)
    dev_inputs = torch.zeros(16384, device="cuda")
    stream = torch.cuda.Stream()
    piece_s = host_s / 20
    graph, _tensors = decode_step_graph(stream)
    with torch.cuda.stream(stream):
        last = time.perf_counter()
        while not stop.is_set():
            dev_inputs.copy_(inputs, non_blocking=True)  # waits behind an upload on the link?
            graph.replay()
            for _ in range(20):
                until = time.thread_time() + piece_s
                while time.thread_time() < until:  # the interpreter, busy
                    pass
                small.add_(1.0)  # lets go of the interpreter, then takes it back
            stream.synchronize()
            end = time.perf_counter()
            timeline.periods.append((last, end))
            last = end


def write_version(directory: Path, gib: float) -> None:
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    per_file = 2**30
    for index in range(max(1, int(gib))):
        t = torch.randn(per_file // 2 // 4096, 4096, dtype=torch.bfloat16)
        save_file({f"t{index}": t}, str(directory / f"model-{index:05d}.safetensors"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default="", help="a version directory (default: write one)")
    parser.add_argument("--gib", type=float, default=4.0)
    parser.add_argument("--chunks-mib", default="8,32,64")
    parser.add_argument("--host-ms", type=float, default=3.0, help="the loop's Python per step")
    args = parser.parse_args()
    directory = Path(args.dir) if args.dir else Path("/tmp/probe-staging")
    if not args.dir:
        write_version(directory, args.gib)
    limit = int(args.gib * 2**30)
    extents = tensor_extents(directory, limit)
    nbytes = sum(length for _, _, length in extents)
    files = sorted({file for file, _, _ in extents})
    maps = {f: torch.from_file(str(f), shared=False, size=f.stat().st_size, dtype=torch.uint8)
            for f in files}  # fmt: skip
    chunks = [int(c) * MIB for c in args.chunks_mib.split(",")]
    torch.set_num_threads(1)  # as the daemon's stager thread (`run_off_engine`)
    torch.cuda.set_device(0)
    pinned = torch.empty(max(chunks), dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(max(chunks), dtype=torch.uint8, device="cuda")
    file_bytes = sum(f.stat().st_size for f in files)
    print(f"{nbytes / 1e9:.2f} GB of tensors in {len(files)} files ({directory})", flush=True)
    read_file(extents, chunks[0], pinned)  # into the page cache, whatever it held

    def parts(label: str, tl: Timeline | None) -> None:
        print(label, flush=True)
        timed("hash (new bytes per read)", file_bytes, partial(hash_files, files, False), tl)
        timed("hash-into (one buffer)", file_bytes, partial(hash_files, files, True), tl)
        for chunk in chunks:
            mib = chunk // MIB
            timed(
                f"read-mmap {mib} MiB", nbytes, partial(read_mmap, maps, extents, chunk, pinned), tl
            )
            timed(f"read-file {mib} MiB", nbytes, partial(read_file, extents, chunk, pinned), tl)
            seconds = h2d(nbytes, chunk, pinned, dst)
            print(f"  {'h2d ' + str(mib) + ' MiB (device)':28s} {nbytes / seconds / 1e9:7.2f} "
                  f"GB/s  ({seconds:6.2f} s)", flush=True)  # fmt: skip
            uploads = PinnedUpload(dst.device, chunk)  # made outside the timing, as the daemon's
            work = partial(upload, maps, extents, chunk, dst, uploads)
            timed(f"upload {mib} MiB", nbytes, work, tl)

    parts("alone:", None)
    stop, timeline = threading.Event(), Timeline()
    server = threading.Thread(target=serve, args=(stop, timeline, args.host_ms / 1e3), daemon=True)
    server.start()
    while len(timeline.periods) < 300:
        time.sleep(0.05)
    median = statistics.median(e - s for s, e in timeline.periods[100:])
    mark = len(timeline.periods)
    print(f"serving loop alone: median period {1e3 * median:.2f} ms", flush=True)
    parts("beside the serving loop:", timeline)
    periods = sorted(e - s for s, e in timeline.periods[mark:])
    p99 = periods[int(0.99 * (len(periods) - 1))]
    stop.set()
    server.join()
    print(f"serving loop meanwhile: {len(periods)} periods, median "
          f"{1e3 * statistics.median(periods):.2f} ms, P99 {1e3 * p99:.2f} ms, max "
          f"{1e3 * periods[-1]:.2f} ms (alone: median {1e3 * median:.2f} ms)")  # fmt: skip


if __name__ == "__main__":
    main()
