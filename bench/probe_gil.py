"""Which host parts of a swap hold the interpreter long enough to delay an engine step.

On a GPU the engine's thread spends a step in calls into torch, each of which lets go of the
interpreter and must get it back. A thread that keeps it through one long C call (a buffer
zeroed, a header parsed, a tokenizer built) delays the step by as much: the GPU runs of
`bench.bench_swap` saw one-version steps of 10-36 ms, all host time in the runner's launch,
as each verification and validation began. This runs each host part of a swap as a daemon
serving on a GPU runs it (unpaced, `staging._HASH_WORKERS` threads of a child process
hashing in `staging._GPU_HASH_CHUNK_BYTES` pieces; `--in-process`: of this one), on any
machine, beside a heartbeat: a thread that sleeps `--beat-ms` at a time and records how late
it wakes. A wake late by 20 ms means the interpreter was held that long, or every core was
busy: a second heartbeat in its own process (its own interpreter) sees the second cause
only, and is printed beside it.

    verify     `checks.load_version`: the manifest's hashes and the finiteness scan in one
               read, then `load_checkpoint` (memory-maps the safetensors files)
    validate   `checks.validate` against the serving model (on a CPU: the tensors the scan
               could not decide; on a GPU it uploads them)

On a machine with fewer cores than hashing threads plus one, the cores are busy and both
heartbeats are late: `--hash-workers 1` leaves a core to the heartbeat.

    python -m bench.make_random_model /tmp/gilv/v1 --shape llama-3-8b   # then its manifest:
    python -c "from sitsd.weights.manifest import write_manifest; write_manifest('/tmp/gilv/v1')"
    python -m bench.probe_gil --dir /tmp/gilv/v1
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from multiprocessing.connection import Connection
from pathlib import Path

import torch

from sitsd.config import ServerConfig
from sitsd.weights import load_checkpoint
from sitsd.weights.checks import (
    LoadedVersion,
    ServingModel,
    load_version,
    serving_model_of,
    validate,
)
from sitsd.weights.staging import _GPU_HASH_CHUNK_BYTES, _HASH_WORKERS

MIB = 2**20


@dataclass
class Heartbeat:
    """Wakes of a thread that sleeps `beat_s` at a time: (when it woke, how late), seconds."""

    beat_s: float
    wakes: list[tuple[float, float]] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        while not self.stop.is_set():
            start = time.perf_counter()
            time.sleep(self.beat_s)
            woke = time.perf_counter()
            self.wakes.append((woke, woke - start - self.beat_s))

    def wakes_in(self, start: float, end: float) -> list[tuple[float, float]]:
        """The wakes whose sleep overlapped [start, end]."""
        return [(woke, late) for woke, late in list(self.wakes)
                if woke > start and woke - late < end]  # fmt: skip

    def late(self, start: float, end: float) -> list[float]:
        """Lateness of the wakes whose sleep overlapped [start, end]."""
        return [late for _, late in self.wakes_in(start, end)]


def beat_process(conn: Connection, beat_s: float) -> None:
    """The heartbeat in a process of its own: sends its wakes when told to stop."""
    beat = Heartbeat(beat_s)
    thread = threading.Thread(target=beat.run, daemon=True)
    thread.start()
    conn.recv()
    beat.stop.set()
    thread.join()
    conn.send(beat.wakes)


def part(name: str, work: Callable[[], object], beat: Heartbeat) -> tuple[object, float, float]:
    """Run `work` beside the heartbeat; print its time and the heartbeat's lateness meanwhile.
    Returns its result, start and end."""
    start = time.perf_counter()
    result = work()
    end = time.perf_counter()
    time.sleep(4 * beat.beat_s)  # the wake that a hold at the very end delayed
    print(f"  {name:10s} {end - start:7.2f} s   {describe(beat.late(start, end))}", flush=True)
    worst = sorted(beat.wakes_in(start, end), key=lambda w: -w[1])[:4]
    if worst and worst[0][1] >= 0.005:
        print("             longest: " + ", ".join(
            f"{1e3 * late:.1f} ms at +{woke - late - beat.beat_s - start:.3f} s"
            for woke, late in worst), flush=True)  # fmt: skip
    return result, start, end


def describe(late: list[float]) -> str:
    late = sorted(late) or [0.0]
    over = [x for x in late if x >= 0.005]
    return (f"heartbeat late P50 {1e3 * statistics.median(late):5.2f}  P99 "
            f"{1e3 * late[int(0.99 * (len(late) - 1))]:6.2f}  max {1e3 * late[-1]:6.2f} ms, "
            f"{len(over)} wakes >= 5 ms (sum {1e3 * sum(over):.0f} ms)")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", required=True, help="a version directory with its manifest")
    parser.add_argument("--beat-ms", type=float, default=0.5)
    parser.add_argument("--repeat", type=int, default=2, help="rounds of every part")
    parser.add_argument("--hash-workers", type=int, default=_HASH_WORKERS)
    parser.add_argument(
        "--in-process",
        action="store_true",
        help="hash on this process's threads (the daemon hashes in a child)",
    )
    parser.add_argument(
        "--switch-ms",
        type=float,
        default=1e3 * ServerConfig.gil_switch_interval_s,
        help="the interpreter's switch interval (the daemon's default)",
    )
    args = parser.parse_args()
    sys.setswitchinterval(args.switch_ms / 1e3)
    path = Path(args.dir)
    torch.set_num_threads(1)  # as the daemon's stager thread (`run_off_engine`)
    ckpt = load_checkpoint(path, load_tensors=False)
    serving: ServingModel = serving_model_of(ckpt.arch, ckpt.tokenizer, torch.bfloat16,
                                             torch.device("cpu"))  # fmt: skip
    print(f"{path}: python {sys.version.split()[0]}, torch {torch.__version__}, "
          f"{args.hash_workers} hash workers "
          f"({'in this process' if args.in_process else 'in a child'}), "
          f"{_GPU_HASH_CHUNK_BYTES // MIB} MiB pieces, "
          f"switch interval {args.switch_ms} ms, {os.cpu_count()} cores", flush=True)  # fmt: skip
    beat = Heartbeat(args.beat_ms / 1e3)
    threading.Thread(target=beat.run, name="heartbeat", daemon=True).start()
    ours, theirs = multiprocessing.Pipe()
    other = multiprocessing.get_context("spawn").Process(target=beat_process,
                                                        args=(theirs, beat.beat_s))  # fmt: skip
    other.start()
    marks: list[tuple[str, float, float]] = []
    for round_ in range(args.repeat):
        print(f"round {round_ + 1}:", flush=True)
        loaded, start, end = part("verify", lambda: load_version(
            path, hash_workers=args.hash_workers, tokenizer=serving.tokenizer,
            dtype=serving.dtype, chunk_bytes=_GPU_HASH_CHUNK_BYTES,
            in_child=not args.in_process), beat)  # fmt: skip
        marks.append(("verify", start, end))
        assert isinstance(loaded, LoadedVersion)
        _, start, end = part("validate", partial(validate, loaded, serving, chunk_bytes=64 * MIB),
                             beat)  # fmt: skip
        marks.append(("validate", start, end))
    ours.send("stop")
    other_beat = Heartbeat(beat.beat_s, ours.recv())
    other.join()
    beat.stop.set()
    print("the heartbeat in its own process (busy cores, not the interpreter), same parts:")
    for name, start, end in marks:
        print(f"  {name:10s} {describe(other_beat.late(start, end))}", flush=True)


if __name__ == "__main__":
    main()
