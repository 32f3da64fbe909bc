"""Where an IPC push's slow serving step comes from: the push's parts, each timed beside a
serving loop on the same GPU.

A second process (the trainer) holds one flat bf16 buffer of `--gib` GiB and hands it over with
torch's CUDA IPC reduction, as `sitsd.client` does. This process runs, on one thread, a serving
loop like the engine's (a CUDA graph of one decode step's matmuls in Llama-3-8B shapes at 32
rows, a little Python, a host sync: its periods are the inter-token gaps), on another a 1 ms
sleeper (how late it wakes: how long something held the interpreter), and on the main thread
the push's parts one after another, each timestamped:

    open      map the trainer's allocation (torch's rebuild, what the daemon calls)
    copy      copy it into a slot-sized buffer in 512 MiB pieces at a quarter of the card's
              memory bandwidth (the slot writer's pacing)
    close     let go of the mapping and the producer's count (drop the storage)

For each part: how long it took, the longest serving period that overlapped it, and the
sleeper's latest wake-up meanwhile; against the loop's median period with no push. The first
part, `reduce`, is the trainer's: a host sync and torch's reduction of its buffer (an
interprocess event recorded on its stream), in its own process. A part whose
overlapping period is long while the sleeper woke on time held the driver, not the interpreter.

    python3 -m bench.probe_ipc --gib 16 --rounds 3
"""

from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import statistics
import threading
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import torch

PIECE = 512 * 2**20


# ------------------------------------------------------------------------------ the trainer


def trainer(conn: Connection, nbytes: int) -> None:
    from torch.multiprocessing.reductions import reduce_tensor

    torch.cuda.set_device(0)
    flat = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda").normal_()
    torch.cuda.synchronize()
    while conn.recv() == "reduce":
        torch.cuda.current_stream().synchronize()  # as `sitsd.client` does before reducing
        _, args = reduce_tensor(flat)
        conn.send(args[1:])  # the rebuild's arguments past the tensor type
    conn.close()


# ------------------------------------------------------------------------ serving and sleeper


@dataclass
class Timeline:
    periods: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of a step
    lags: list[tuple[float, float]] = field(default_factory=list)  # (woke, lateness)


def decode_step_graph(stream: torch.cuda.Stream) -> tuple[torch.cuda.CUDAGraph, list[torch.Tensor]]:
    """A CUDA graph of one decode step's matmuls in Llama-3-8B shapes at 32 rows, captured on
    `stream`; and the tensors it reads (keep them while it replays)."""
    shapes = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096)] * 32
    weights = [torch.randn(k, n, dtype=torch.bfloat16, device="cuda") * 0.01 for k, n in shapes]
    x = torch.randn(32, 4096, dtype=torch.bfloat16, device="cuda")
    with torch.cuda.stream(stream):
        for _ in range(2):
            _decode(x, weights)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            _decode(x, weights)
    return graph, [x, *weights]


def serve(stop: threading.Event, timeline: Timeline) -> None:
    """Decode steps of Llama-3-8B shapes at 32 rows, replayed from a CUDA graph."""
    torch.cuda.set_device(0)
    stream = torch.cuda.Stream()
    graph, _tensors = decode_step_graph(stream)
    with torch.cuda.stream(stream):
        last = time.perf_counter()
        while not stop.is_set():
            graph.replay()
            sum(i * i for i in range(2000))  # the scheduler's Python, overlapping the GPU
            stream.synchronize()
            end = time.perf_counter()
            timeline.periods.append((last, end))
            last = end


def _decode(x: torch.Tensor, weights: list[torch.Tensor]) -> None:
    for i in range(0, len(weights), 4):
        h = x @ weights[i]  # [32, 6144]
        h = h[:, :4096] @ weights[i + 1]
        g = h @ weights[i + 2]  # [32, 28672]
        x.add_(g[:, :14336] @ weights[i + 3], alpha=1e-3)


def sleeper(stop: threading.Event, timeline: Timeline) -> None:
    while not stop.is_set():
        before = time.perf_counter()
        time.sleep(0.001)
        woke = time.perf_counter()
        timeline.lags.append((woke, woke - before - 0.001))


# ------------------------------------------------------------------------------ the pusher


def push_once(args: tuple, dst: torch.Tensor, marks: list[tuple[str, float]]) -> None:
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    (_size, _stride, _offset, storage_cls, _dtype, device, handle, storage_bytes,
     offset_bytes, _grad, ref_handle, ref_offset, event_handle, event_sync) = args  # fmt: skip
    bandwidth = _bandwidth()
    marks.append(("open", time.perf_counter()))  # the trainer has answered
    whole = rebuild_cuda_tensor(
        torch.Tensor, torch.Size([storage_bytes]), (1,), 0, storage_cls, torch.uint8,
        device, handle, storage_bytes, offset_bytes, False, ref_handle, ref_offset,
        event_handle, event_sync,
    )  # fmt: skip
    src = whole.view(torch.bfloat16)
    marks.append(("copy", time.perf_counter()))
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        flat_src, flat_dst = src.view(-1), dst.view(-1)
        step = PIECE // 2
        start = time.perf_counter()
        for i in range(0, flat_dst.numel(), step):
            flat_dst[i : i + step].copy_(flat_src[i : i + step])
            stream.synchronize()
            due = start + (i + step) * 2 * 2 / (0.25 * bandwidth)
            time.sleep(max(0.0, due - time.perf_counter()))
    marks.append(("close", time.perf_counter()))
    del src, flat_src, whole  # the opening's count drops: the mapping closes
    marks.append(("end", time.perf_counter()))


def first_kernels(dst: torch.Tensor, marks: list[tuple[str, float]]) -> None:
    """The first launches of the kernels a push uses, in this process (CUDA loads a kernel's
    module at its first launch)."""
    stream = torch.cuda.Stream()
    small = dst[: 2**20]
    with torch.cuda.stream(stream):
        torch._foreach_copy_([small[: 2**19]], [small[2**19 :]])
        stream.synchronize()
        marks.append(("first _foreach_norm", time.perf_counter()))
        norms = torch._foreach_norm([small], 1, dtype=torch.float32)
        torch.isfinite(torch.stack(norms)).tolist()
        marks.append(("end", time.perf_counter()))


def _bandwidth() -> float:
    props = torch.cuda.get_device_properties(0)
    return 2 * props.memory_clock_rate * 1e3 * props.memory_bus_width / 8


# ------------------------------------------------------------------------------- the report


def report(marks: list[tuple[str, float]], timeline: Timeline, median: float) -> None:
    for (part, begin), (_, end) in itertools.pairwise(marks):
        periods = [e - s for s, e in list(timeline.periods) if e > begin and s < end]
        lags = [lag for woke, lag in list(timeline.lags) if begin <= woke <= end + 0.002]
        print(
            f"{part:8s} {1e3 * (end - begin):8.2f} ms   longest period "
            f"{1e3 * max(periods, default=0):6.2f} ms ({max(periods, default=0) / median:4.2f}x)"
            f"   sleeper late by {1e3 * max(lags, default=0):6.2f} ms",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=16.0)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    nbytes = int(args.gib * 2**30) // PIECE * PIECE

    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    proc = ctx.Process(target=trainer, args=(theirs, nbytes), daemon=True)
    proc.start()
    torch.cuda.set_device(0)
    dst = torch.empty(nbytes // 2, dtype=torch.bfloat16, device="cuda")
    stop, timeline = threading.Event(), Timeline()
    threads = [threading.Thread(target=serve, args=(stop, timeline), daemon=True),
               threading.Thread(target=sleeper, args=(stop, timeline), daemon=True)]  # fmt: skip
    for thread in threads:
        thread.start()
    while len(timeline.periods) < 300:
        time.sleep(0.05)
    steady = [e - s for s, e in timeline.periods[100:]]
    median = statistics.median(steady)
    print(f"steady: {len(steady)} periods, median {1e3 * median:.2f} ms, max "
          f"{1e3 * max(steady):.2f} ms; sleeper late by at most "
          f"{1e3 * max(lag for _, lag in timeline.lags):.2f} ms", flush=True)  # fmt: skip
    marks = [("first _foreach_copy_", time.perf_counter())]
    first_kernels(dst, marks)
    report(marks, timeline, median)
    for _ in range(args.rounds):
        time.sleep(0.3)
        marks: list[tuple[str, float]] = [("reduce", time.perf_counter())]
        ours.send("reduce")  # the trainer's part: a sync, a reduction (an IPC event)
        handle_args = ours.recv()
        push_once(handle_args, dst, marks)
        time.sleep(0.3)
        report(marks, timeline, median)
    ours.send("stop")
    stop.set()
    for thread in threads:
        thread.join()
    proc.join(timeout=30)


if __name__ == "__main__":
    main()
