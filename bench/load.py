"""Streaming load for the benchmarks: greedy requests from a process of its own, with each
token's arrival time.

`StreamLoad` keeps `clients` streams going against a daemon (a new request as soon as one
ends) from a spawned child process, and hands its records back on request (`streams`). The
child does nothing but read tokens: a benchmark that also drives the daemon (serializes 16 GB
for a push, polls metrics, summarizes) would otherwise time its own interpreter's pauses as
the daemon's, since a client thread in the same process cannot read a token while the
benchmark holds the GIL.

Times are `bench.timing.now()` (the monotonic clock, the same in every process of a machine),
so the parent's marks and the child's arrivals compare directly. `arrival_gaps` and
`arrivals` cut the records into a window; what a benchmark makes of them (phases,
percentiles, throughput) is its own business.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing
import random
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import grpc

from bench.timing import now

_SNAPSHOT, _STOP = "snapshot", "stop"


@dataclass
class Stream:
    """One request: when it was sent, its tokens' arrival times, when and how it ended."""

    started: float
    times: list[float] = field(default_factory=list)
    ended: float | None = None  # None while it runs
    failed: bool = False  # it ended with an RPC error
    first_token: float | None = None  # its first token's arrival (kept when `times` is cut)
    # The arrival of its first token from another weights version than its first token's
    # (None: all from one), kept when `times` is cut.
    switched: float | None = None


@dataclass(frozen=True)
class LoadSpec:
    """What the child process sends."""

    address: str  # the daemon's gRPC address
    prompts: list[list[int]]  # token ids; each request draws one
    clients: int  # streams kept going
    seed: int  # draws the prompts and lengths
    max_tokens: tuple[int, int] = (64, 128)  # each request's output length, drawn in [lo, hi]
    timeout_s: float = 1800.0  # one request's deadline


class StreamLoad:
    """The load process (see the module docstring). `start`, `streams` any number of times,
    `stop` once (it returns the final records)."""

    def __init__(self, spec: LoadSpec) -> None:
        context = multiprocessing.get_context("spawn")  # no copy of the parent's CUDA state
        self._conn, child = context.Pipe()
        self._process = context.Process(target=_child, args=(spec, child), daemon=True,
                                        name="bench-load")  # fmt: skip

    def start(self) -> None:
        """Start the child; returns once its clients are about to send their first requests."""
        self._process.start()
        self._conn.recv()  # "ready"

    def streams(self, since: float = 0.0, times_from: float = 0.0) -> list[Stream]:
        """A copy of every stream that was running at `since` or began after it, holding only
        the arrivals from `times_from` on (a small copy: the child's clients wait while it is
        made)."""
        self._conn.send((_SNAPSHOT, since, times_from))
        streams: list[Stream] = self._conn.recv()
        return streams

    def stop(self, timeout_s: float = 1800.0) -> list[Stream]:
        """Let each stream finish its request, stop the child; every stream's record."""
        self._conn.send((_STOP, 0.0, 0.0))
        if not self._conn.poll(timeout_s):
            self._process.kill()
            raise RuntimeError(f"the load's streams did not finish in {timeout_s:.0f} s")
        streams: list[Stream] = self._conn.recv()
        self._process.join(timeout_s)
        return streams


def arrival_gaps(streams: list[Stream], start: float, end: float) -> list[tuple[float, float]]:
    """(gap, arrival) between consecutive tokens of a request, for arrivals in [start, end)."""
    return [(b - a, b) for s in streams for a, b in itertools.pairwise(s.times)
            if start <= b < end]  # fmt: skip


def arrivals(streams: list[Stream], start: float, end: float) -> int:
    """Tokens that arrived in [start, end)."""
    return sum(start <= t < end for s in streams for t in s.times)


def _child(spec: LoadSpec, conn: Connection) -> None:
    """The child's main thread answers the parent; one thread runs the clients. A parent
    that goes away without `stop` (killed) closes the pipe: the child ends with it, rather
    than keep its clients retrying against a daemon that may be gone too (a spinning orphan
    that slowed the next benchmark's steps 3x)."""
    streams: list[Stream] = []
    stopping = threading.Event()
    clients = threading.Thread(target=asyncio.run, args=(_clients(spec, streams, stopping),),
                               name="clients", daemon=True)  # fmt: skip
    clients.start()
    conn.send("ready")
    while True:
        try:
            command, since, times_from = conn.recv()
        except EOFError:  # the parent is gone: the clients' thread ends with the process
            return
        if command == _STOP:
            stopping.set()
            clients.join()
            conn.send(streams)
            return
        conn.send([_copy(s, times_from) for s in list(streams)
                   if s.ended is None or s.ended >= since])  # fmt: skip


async def _clients(spec: LoadSpec, streams: list[Stream], stopping: threading.Event) -> None:
    from sitsd.api.v1 import inference_pb2 as pb
    from sitsd.api.v1 import inference_pb2_grpc

    rng = random.Random(spec.seed)

    async def client(stub: inference_pb2_grpc.InferenceStub) -> None:
        while not stopping.is_set():
            stream = Stream(now())
            streams.append(stream)
            sampling = pb.SamplingParams(max_tokens=rng.randint(*spec.max_tokens), temperature=0)
            request = pb.GenerateRequest(
                token_ids=pb.TokenIds(ids=rng.choice(spec.prompts)), ignore_eos=True,
                sampling=sampling,
            )  # fmt: skip
            first_version = None
            try:
                async for response in stub.Generate(request, timeout=spec.timeout_s):
                    stream.times += [now()] * len(response.token_ids)
                    if stream.first_token is None and stream.times:
                        stream.first_token = stream.times[0]
                        first_version = response.weights_version
                    elif stream.switched is None and response.weights_version != first_version:
                        stream.switched = stream.times[-1]
            except grpc.aio.AioRpcError:
                stream.failed = True
            stream.ended = now()

    async with grpc.aio.insecure_channel(spec.address) as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        await asyncio.gather(*(client(stub) for _ in range(spec.clients)))


def _copy(stream: Stream, times_from: float) -> Stream:
    times = [t for t in stream.times if t >= times_from] if times_from else list(stream.times)
    return Stream(stream.started, times, stream.ended, stream.failed, stream.first_token,
                  stream.switched)  # fmt: skip
