"""A push over a gRPC stream: tensor bytes in chunks, copied into the standby slot as they come.

`Admin.UpdateWeights` (`sitsd.api.push`) turns each message after the header into a
`TensorPiece`: a tensor's name and its next bytes (whole elements, row-major, little-endian,
in the dtype the table gives). `StreamedPush.receive` takes them in the table's order and
copies each straight into the slot on a thread of its own; the next piece is read off the
stream while one is copied, and copied only once that one is in, so a push holds two pieces in
memory at most (gRPC's flow control holds the sender back meanwhile), never the version. A
piece that does not fit the table (another tensor before this one is whole, more bytes than its
shape, part of an element) rejects the version, naming the tensor.
"""

from __future__ import annotations

import asyncio
import functools
import warnings
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from sitsd.runtime.slot_writer import SlotWriteError, SlotWriter
from sitsd.weights.checks import VersionRejected
from sitsd.weights.progress import ByteProgress, Pacer, ProgressSink
from sitsd.weights.push_plan import PushPlan, TensorSpec


@dataclass(frozen=True, slots=True)
class TensorPiece:
    """The next bytes of one tensor of a streamed push."""

    name: str
    data: bytes | memoryview  # a view of the received message (`sitsd.api.push_wire`)


class _Cursor:
    """Where the stream is in the table: which tensor, how many of its bytes came."""

    def __init__(self, plan: PushPlan) -> None:
        self._specs = plan.tensors
        self._index = 0
        self._received = 0  # bytes of the current tensor
        self.total = 0  # bytes of the push

    def take(self, piece: TensorPiece) -> tuple[TensorSpec, int]:
        """The tensor `piece` continues and the element it starts at.

        Raises:
            VersionRejected: it does not fit the table.
        """
        if self._index < len(self._specs) and self._received == self._specs[self._index].nbytes:
            self._index, self._received = self._index + 1, 0  # the tensor before is whole
        if self._index >= len(self._specs):
            raise VersionRejected(f"{piece.name}: bytes after every tensor of the table came")
        spec = self._specs[self._index]
        if piece.name != spec.name:
            raise VersionRejected(
                f"{piece.name} came while {spec.name} had {self._received} of its {spec.nbytes} "
                "bytes (tensors come whole, in the table's order)"
            )
        itemsize = spec.torch_dtype.itemsize
        if len(piece.data) % itemsize:
            raise VersionRejected(
                f"{spec.name}: a chunk of {len(piece.data)} bytes splits an element"
            )
        if self._received + len(piece.data) > spec.nbytes:
            raise VersionRejected(
                f"{spec.name}: more bytes than its shape {spec.shape} holds ({spec.nbytes})"
            )
        start = self._received // itemsize
        self._received += len(piece.data)
        self.total += len(piece.data)
        return spec, start


class StreamedPush:
    """A `PushSource` reading a gRPC stream's pieces (see the module docstring)."""

    def __init__(self, plan: PushPlan, pieces: AsyncIterator[TensorPiece]) -> None:
        self._plan = plan
        self._pieces = pieces

    @property
    def plan(self) -> PushPlan:
        return self._plan

    def check(self) -> None:
        """Nothing to check before the bytes come (each piece is checked as it comes)."""

    async def receive(
        self, writer: SlotWriter, version: str, progress: ProgressSink, cpu_share: float
    ) -> int:
        loop = asyncio.get_running_loop()
        cursor = _Cursor(self._plan)
        on_bytes = ByteProgress(loop, progress, "receive", version, pace=Pacer(cpu_share))
        total = self._plan.nbytes
        # One thread copies, so its pacer sees all the work; it uses one torch thread (OpenMP
        # keeps a team per calling thread, and the engine's needs every core).
        with ThreadPoolExecutor(1, "sitsd-push", initializer=torch.set_num_threads,
                                initargs=(1,)) as copier:  # fmt: skip
            copying: asyncio.Future[None] | None = None  # the piece before this one
            try:
                async for piece in self._pieces:
                    if not piece.data:
                        continue
                    spec, start = cursor.take(piece)
                    # This piece was read while the one before was copied; it is copied once
                    # that one is in (one copier thread, whose pacer sleeps in it and so
                    # holds the reads, and the sender, back too): two pieces in memory at most.
                    if copying is not None:
                        await copying
                    copy = functools.partial(
                        _copy, writer, spec, start, piece.data, on_bytes, cursor.total, total
                    )
                    copying = loop.run_in_executor(copier, copy)
                if copying is not None:
                    await copying
            finally:
                if copying is not None and not copying.done():
                    await asyncio.wait((copying,))  # no copy may land in the slot after this
        return cursor.total


def _copy(
    writer: SlotWriter,
    spec: TensorSpec,
    start: int,
    data: bytes | memoryview,
    on_bytes: ByteProgress,
    done: int,
    total: int,
) -> None:
    """One piece into the slot, then report (and pace) on the copier thread."""
    with warnings.catch_warnings():
        # The bytes are only read (copied into the slot at once), never written through.
        warnings.filterwarnings("ignore", "The given buffer is not writable")
        piece = torch.frombuffer(data, dtype=spec.torch_dtype)
    try:
        writer.write_piece(spec.name, start, piece)
    except SlotWriteError as exc:
        raise VersionRejected(str(exc)) from None
    on_bytes(done, total)
