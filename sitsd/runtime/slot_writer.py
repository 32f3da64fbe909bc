"""Writing a pushed version into a released weight slot, tensor by tensor or piece by piece.

A trainer's push (`sitsd.weights.push`) does not arrive as a checkpoint: its tensors come as
byte chunks off a gRPC stream, as CUDA tensors of another process, or as slices of broadcast
buckets. `SlotWriter` takes them in whatever order and size they come, straight into the slot's
tensors (the views `weight_copy_plan` names: the q/k/v rows of the fused projection and so on),
casting to the slot's dtype on the way; nothing is buffered beyond one chunk. Then:

    write / write_piece   a tensor whole, or elements [start, start + n) of its flat view
    write_all             tensors already on the slot's device, whole, in one call
    copy_rest             every tensor the push did not name, from the slot serving now
    unfinished            tensors started but not complete (a push cut short)
    first_nonfinite       the first written tensor holding NaN or Inf in the slot's dtype
    sync                  wait for the copies (on CUDA they run on a side stream)

On a GPU the copies and checks read and write the same memory the serving steps read, so
they go in pieces of at most `DEVICE_PIECE_BYTES` and, with `device_share` below 1, at most
that share of the card's memory bandwidth, on a bytes clock (`_DevicePace`): a step overlaps a
few pieces at most (16 GB copied in one call take ~8 ms of an H200's whole bandwidth, about a
second step's worth, in whichever step they land). On a CPU pacing is the caller's (its
progress callbacks).

One thread at a time (calls may move between threads: the stream orders them); the slot must
have been released by the engine, so nothing reads it meanwhile, and the base slot is only
read. Which tensors a push may name, and what to do when one is wrong, is the weights
subsystem's business; the slot flips only through the swap controller.

A push writes dense tensors in place: a slot holding quantized layouts (`SlotViews.quantized`:
`--quantize`, or a quantized checkpoint served as is) is refused, since its fields would have
to be rebuilt in new tensors (`WeightSlots.copy_into` does that for checkpoints).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch

from sitsd.runtime.weight_slots import PinnedUpload, SlotViews, row_chunks

Progress = Callable[[int, int], None]  # (bytes done, bytes total)
# The most one piece of a push's device work moves (a GPU): ~0.25 ms of an H200's bandwidth, so
# that pacing needs few host round trips (each waits for the interpreter) yet a 5 ms step
# overlaps only a few pieces.
DEVICE_PIECE_BYTES = 512 * 2**20


class SlotWriteError(ValueError):
    """A piece that does not fit its tensor (unknown name, wrong size, past its end)."""


class SlotWriter:
    """Fills one released weight slot; see the module docstring."""

    def __init__(
        self,
        slot: SlotViews,
        base: SlotViews,
        *,
        chunk_bytes: int,
        device_share: float = 1.0,
        piece_bytes: int = DEVICE_PIECE_BYTES,
        uploads: PinnedUpload | None = None,
    ) -> None:
        """Args:
        slot: the released slot's tensors by name (written; `WeightSlots.views` keeps them).
        base: the serving slot's tensors by name (read: what a partial push keeps).
        chunk_bytes: the most a host-to-device upload moves at once.
        device_share: on a GPU, the most of the card's memory bandwidth the device-side copies
            and checks may use (1: unpaced).
        piece_bytes: the most one piece of device-side work moves.
        uploads: pinned buffers made before serving to upload through (CUDA; without them
            the writer makes its own at its first upload, taking driver locks serving waits on).

        Raises:
            SlotWriteError: either slot holds quantized layouts.
        """
        for held in (slot, base):
            if held.quantized:
                raise SlotWriteError(f"{held.quantized[0]} is held quantized: a push writes "
                                     "16-bit weights in place")  # fmt: skip
        self._dst = slot.dense
        self._base = base.dense
        self._written: dict[str, int] = {}  # name -> elements written so far
        self._chunk_bytes = chunk_bytes
        self.device = slot.device
        self.dtype = slot.dtype
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._uploads = uploads  # else made on the first host-to-device copy
        self._piece_bytes = piece_bytes
        self._pace = _DevicePace(self.device, device_share) if on_cuda else None

    @property
    def names(self) -> list[str]:
        """Every tensor of the slot, Hugging Face names, in copy order."""
        return list(self._dst)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._dst[name].shape)

    @contextlib.contextmanager
    def side_stream(self) -> Iterator[None]:
        """The writer's stream as the current one (CUDA); work queued in it is ordered with
        the writes (a producer's IPC event is waited for on the current stream)."""
        with torch.cuda.stream(self._stream) if self._stream is not None else nullcontext():
            yield

    # ------------------------------------------------------------------------------ writes

    @torch.inference_mode()
    def write(self, name: str, src: torch.Tensor) -> None:
        """Copy a whole tensor (any dtype, any device, the slot tensor's shape) into the slot."""
        dst = self._destination(name)
        if tuple(src.shape) != tuple(dst.shape):
            raise SlotWriteError(f"{name} has shape {tuple(src.shape)}, expected {dst.shape}")
        with self.side_stream():
            if src.device.type == "cpu" and self.device.type == "cuda":
                for rows in row_chunks(src, self._chunk_bytes):
                    self._upload(src[rows], dst[rows])  # [rows, ...]
            else:
                dst.copy_(src)  # device to device (a cast on the device), or host to host
        self._written[name] = dst.numel()

    @torch.inference_mode()
    def write_all(self, names: list[str], srcs: list[torch.Tensor]) -> None:
        """Copy whole tensors on the slot's device (any dtype: cast there) into the slot.

        One `_foreach_copy_` per piece of `piece_bytes`, not one per tensor: a copy queued per
        tensor is a call into torch per tensor, each letting go of the interpreter, which a
        thread that contends with the engine's waits to get back (291 tensors of an 8B model:
        most of an IPC push's 197 ms), each paced (see the module docstring).
        """
        dsts = []
        for name, src in zip(names, srcs, strict=True):
            dst = self._destination(name)
            if tuple(src.shape) != tuple(dst.shape):
                raise SlotWriteError(f"{name} has shape {tuple(src.shape)}, expected {dst.shape}")
            if src.device != self.device:
                raise SlotWriteError(f"{name} is on {src.device}, the slot on {self.device}")
            dsts.append(dst)
        self._copy_in_pieces(dsts, srcs)
        for name, dst in zip(names, dsts, strict=True):
            self._written[name] = dst.numel()

    @torch.inference_mode()
    def write_piece(self, name: str, start: int, piece: torch.Tensor) -> None:
        """Copy `piece` (1-D) into elements [start, start + len) of the tensor's flat view."""
        dst = self._destination(name).view(-1)  # the plan's views are contiguous row ranges
        end = start + piece.numel()
        if piece.dim() != 1 or start < 0 or end > dst.numel():
            raise SlotWriteError(
                f"{name}: elements [{start}, {end}) do not fit its {dst.numel()} elements"
            )
        with self.side_stream():
            if piece.device.type == "cpu" and self.device.type == "cuda":
                self._upload(piece, dst[start:end])
            else:
                dst[start:end].copy_(piece)
        self._written[name] = max(self._written.get(name, 0), end)

    def copy_rest(self, on_progress: Progress | None = None) -> list[str]:
        """Copy every tensor not written from the base slot (device to device); their names.
        On a GPU in paced pieces (see the module docstring), else chunk by chunk."""
        rest = [name for name in self._dst if name not in self._written]
        total = sum(self._nbytes(name) for name in rest)
        if self._pace is not None:
            with torch.inference_mode():
                self._copy_in_pieces([self._dst[n] for n in rest], [self._base[n] for n in rest])
            if on_progress is not None:
                on_progress(total, total)
        else:
            done = 0
            with torch.inference_mode():
                for name in rest:
                    dst, src = self._dst[name], self._base[name]
                    for rows in row_chunks(dst, self._chunk_bytes):
                        dst[rows].copy_(src[rows])
                        done += (rows.stop - rows.start) * dst[0:1].numel() * dst.element_size()
                        if on_progress is not None:
                            on_progress(done, total)
        for name in rest:
            self._written[name] = self._dst[name].numel()
        return rest

    @property
    def device_traffic(self) -> tuple[int, float]:
        """(bytes the paced device work moved so far, the bytes/s it may move): (0, 0) on a
        CPU or unpaced."""
        pace = self._pace
        if pace is None or not pace.paced:
            return 0, 0.0
        return pace.traffic, pace.share * pace.bandwidth

    # ------------------------------------------------------------------------------ checks

    def written(self, name: str) -> int:
        """Elements of `name` written so far."""
        return self._written.get(name, 0)

    def unfinished(self) -> list[str]:
        """Tensors started but not complete."""
        return [n for n, count in self._written.items() if count < self._dst[n].numel()]

    def first_nonfinite(self, names: list[str], on_progress: Progress | None = None) -> str | None:
        """The first of `names` whose slot tensor holds NaN or Inf, or None.

        On a GPU a fused pass per piece sums the tensors' magnitudes (a sum is finite exactly
        when every element is, or it overflowed), paced (see the module docstring), and one
        host sync reads the sums; only a tensor whose sum is not finite is read again, element
        by element. Per chunk, 16 GB took ~700 launches from a thread that contends with the
        engine's for the interpreter: 139 ms on an H200 while serving. On a CPU the chunks
        stay, each paced by `on_progress`.
        """
        if self._pace is not None and names:
            views = [self._dst[name] for name in names]
            sizes = [_bytes_of(v) for v in views]
            sums: list[torch.Tensor] = []
            self._pace.begin()
            with torch.inference_mode(), self.side_stream():
                for piece in pieces(sizes, self._piece_bytes):
                    sums += torch._foreach_norm(views[piece], 1, dtype=torch.float32)
                    self._pace.after(sum(sizes[piece]))  # read once
                finite = torch.isfinite(torch.stack(sums)).tolist()  # host sync, this thread
            names = [name for name, ok in zip(names, finite, strict=True) if not ok]
            if on_progress is not None:
                total = sum(view.numel() * view.element_size() for view in views)
                on_progress(total, total)
            if not names:
                return None
        return self._first_nonfinite_chunked(names, on_progress)

    def _first_nonfinite_chunked(
        self, names: list[str], on_progress: Progress | None
    ) -> str | None:
        """`first_nonfinite` element by element, in chunks."""
        total = sum(self._nbytes(name) for name in names)
        done = 0
        flags = []  # one per tensor, read at once at the end
        with torch.inference_mode(), self.side_stream():
            for name in names:
                dst = self._dst[name]
                chunks = []
                for rows in row_chunks(dst, self._chunk_bytes):
                    chunks.append(torch.isfinite(dst[rows]).all())
                    done += (rows.stop - rows.start) * dst[0:1].numel() * dst.element_size()
                    if on_progress is not None:
                        on_progress(done, total)
                flags.append(torch.stack(chunks).all())
            finite = torch.stack(flags).tolist() if flags else []  # host sync, this thread
        for name, ok in zip(names, finite, strict=True):
            if not ok:
                return name
        return None

    def sync(self) -> None:
        """Wait until every queued copy has landed (CUDA); later steps then see them all."""
        if self._stream is not None:
            self._stream.synchronize()

    # ---------------------------------------------------------------------------- internal

    def _destination(self, name: str) -> torch.Tensor:
        dst = self._dst.get(name)
        if dst is None:
            raise SlotWriteError(f"{name} is not a tensor of the serving model")
        return dst

    def _nbytes(self, name: str) -> int:
        dst = self._dst[name]
        return dst.numel() * dst.element_size()

    def _copy_in_pieces(self, dsts: list[torch.Tensor], srcs: list[torch.Tensor]) -> None:
        """`dsts[i].copy_(srcs[i])` for all i, a `_foreach_copy_` per piece of at most
        `piece_bytes` (a tensor split by rows where larger), each paced on a GPU."""
        rows = []  # a tensor that fits a piece goes whole: a slice is a call into torch
        for dst, src in zip(dsts, srcs, strict=True):
            if _bytes_of(dst) <= self._piece_bytes:
                rows.append((dst, src))
            else:
                rows += [(dst[part], src[part]) for part in row_chunks(dst, self._piece_bytes)]
        to, of = [dst for dst, _ in rows], [src for _, src in rows]
        sizes = [_bytes_of(dst) + _bytes_of(src) for dst, src in rows]  # read + written
        if self._pace is not None:
            self._pace.begin()
        with self.side_stream():
            for piece in pieces(sizes, 2 * self._piece_bytes):
                torch._foreach_copy_(to[piece], of[piece])
                if self._pace is not None:
                    self._pace.after(sum(sizes[piece]))

    def _upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self._uploads is None:
            self._uploads = PinnedUpload(self.device, self._chunk_bytes)
        self._uploads.upload(src, dst)


def pieces(sizes: list[int], piece_bytes: int) -> Iterator[slice[int, int, None]]:
    """Consecutive runs of items, in order, each at most `piece_bytes` in all (an item larger
    than that makes a run of its own)."""
    start, total = 0, 0
    for i, size in enumerate(sizes):
        if i > start and total + size > piece_bytes:
            yield slice(start, i)
            start, total = i, 0
        total += size
    if start < len(sizes):
        yield slice(start, len(sizes))


def _bytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


class _DevicePace:
    """Device work paced on a bytes clock: each piece's memory traffic (bytes read + written)
    counts at `share` of the device's memory bandwidth, and the thread waits for each piece,
    then until the clock allows the next. A piece slowed by serving is never made up for with
    a burst: the clock is only ever a floor. The bandwidth is the card's own (memory clock x
    bus width), not measured: a measurement while serving would count serving's traffic, and
    timing the pieces themselves counts the time their kernels wait for the SMs."""

    def __init__(self, device: torch.device, share: float) -> None:
        props = torch.cuda.get_device_properties(device)
        clock_khz = getattr(props, "memory_clock_rate", 0)
        bus_bits = getattr(props, "memory_bus_width", 0)
        self.bandwidth = 2 * clock_khz * 1e3 * bus_bits / 8  # bytes/s, double data rate
        self.share = share
        self.traffic = 0  # bytes the paced pieces moved so far
        self._start = 0.0  # when the current run of pieces began
        self._run_traffic = 0  # bytes of the current run

    @property
    def paced(self) -> bool:
        return self.share < 1.0 and self.bandwidth > 0

    def begin(self) -> None:
        """A new run of pieces (one copy or one check): the clock starts now."""
        self._start, self._run_traffic = time.monotonic(), 0

    def after(self, traffic: int) -> None:
        """A piece moving `traffic` bytes was queued on the current stream: wait for it, then
        until the clock allows the next (unpaced: neither)."""
        if not self.paced:
            return
        # Host sync, this (push) thread: one piece in flight at a time.
        torch.cuda.current_stream().synchronize()
        self.traffic += traffic
        self._run_traffic += traffic
        due = self._start + self._run_traffic / (self.share * self.bandwidth)
        time.sleep(max(0.0, due - time.monotonic()))
