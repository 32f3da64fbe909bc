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

One thread at a time (calls may move between threads: the stream orders them); the slot must
have been released by the engine, so nothing reads it meanwhile, and the base slot is only
read. Which tensors a push may name, and what to do when one is wrong, is the weights
subsystem's business; the slot flips only through the swap controller.

A push writes dense tensors in place: a slot holding quantized layouts (`quantized_tensors`:
`--quantize`, or a quantized checkpoint served as is) is refused, since its fields would have
to be rebuilt in new tensors (`WeightSlots.copy_into` does that for checkpoints).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from contextlib import nullcontext

import torch

from sitsd.model.arch import LlamaArch
from sitsd.model.llama import LlamaWeights, expected_shapes, weight_copy_plan
from sitsd.runtime.weight_slots import PinnedUpload, row_chunks

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class SlotWriteError(ValueError):
    """A piece that does not fit its tensor (unknown name, wrong size, past its end)."""


def quantized_tensors(arch: LlamaArch, weights: LlamaWeights) -> list[str]:
    """The Hugging Face names of the tensors `weights` holds in a quantized layout."""
    dense = {name for _, name in weight_copy_plan(arch, weights)}
    return [name for name in expected_shapes(arch) if name not in dense]


class SlotWriter:
    """Fills one released weight slot; see the module docstring."""

    def __init__(
        self, arch: LlamaArch, slot: LlamaWeights, base: LlamaWeights, *, chunk_bytes: int
    ) -> None:
        """Args:
        arch: the architecture both slots hold.
        slot: the released slot's tensors (written).
        base: the serving slot's tensors (read: what a partial push keeps).
        chunk_bytes: the most a host-to-device upload moves at once.

        Raises:
            SlotWriteError: either slot holds quantized layouts.
        """
        for held in (slot, base):
            if quantized := quantized_tensors(arch, held):
                raise SlotWriteError(f"{quantized[0]} is held quantized: a push writes 16-bit "
                                     "weights in place")  # fmt: skip
        self._dst = {name: view for view, name in weight_copy_plan(arch, slot)}
        self._base = {name: view for view, name in weight_copy_plan(arch, base)}
        self._written: dict[str, int] = {}  # name -> elements written so far
        self._chunk_bytes = chunk_bytes
        self.device = slot.embed_tokens.device
        self.dtype = slot.embed_tokens.dtype
        on_cuda = self.device.type == "cuda"
        self._stream = torch.cuda.Stream(self.device) if on_cuda else None
        self._uploads: PinnedUpload | None = None  # made on the first host-to-device copy

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

        One `_foreach_copy_` for them all: a copy queued per tensor is a call into torch per
        tensor, each letting go of the interpreter, which a thread that contends with the
        engine's waits to get back (291 tensors of an 8B model: most of an IPC push's 197 ms).
        """
        dsts = []
        for name, src in zip(names, srcs, strict=True):
            dst = self._destination(name)
            if tuple(src.shape) != tuple(dst.shape):
                raise SlotWriteError(f"{name} has shape {tuple(src.shape)}, expected {dst.shape}")
            if src.device != self.device:
                raise SlotWriteError(f"{name} is on {src.device}, the slot on {self.device}")
            dsts.append(dst)
        if dsts:
            with self.side_stream():
                torch._foreach_copy_(dsts, srcs)
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
        """Copy every tensor not written from the base slot (device to device); their names."""
        rest = [name for name in self._dst if name not in self._written]
        total = sum(self._nbytes(name) for name in rest)
        done = 0
        with torch.inference_mode(), self.side_stream():
            for name in rest:
                dst, src = self._dst[name], self._base[name]
                for rows in row_chunks(dst, self._chunk_bytes):
                    dst[rows].copy_(src[rows])
                    done += (rows.stop - rows.start) * dst[0:1].numel() * dst.element_size()
                    if on_progress is not None:
                        on_progress(done, total)
                self._written[name] = dst.numel()
        return rest

    # ------------------------------------------------------------------------------ checks

    def written(self, name: str) -> int:
        """Elements of `name` written so far."""
        return self._written.get(name, 0)

    def unfinished(self) -> list[str]:
        """Tensors started but not complete."""
        return [n for n, count in self._written.items() if count < self._dst[n].numel()]

    def first_nonfinite(self, names: list[str], on_progress: Progress | None = None) -> str | None:
        """The first of `names` whose slot tensor holds NaN or Inf, or None.

        On a GPU one fused pass sums every tensor's magnitudes (a sum is finite exactly when
        every element is, or it overflowed) and one host sync reads the sums; only a tensor
        whose sum is not finite is read again, element by element. Per chunk, 16 GB took
        ~700 launches from a thread that contends with the engine's for the interpreter:
        139 ms on an H200 while serving. On a CPU the chunks stay, each paced by `on_progress`.
        """
        if self.device.type == "cuda" and names:
            with torch.inference_mode(), self.side_stream():
                views = [self._dst[name] for name in names]
                sums = torch._foreach_norm(views, 1, dtype=torch.float32)
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

    def _upload(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        if self._uploads is None:
            self._uploads = PinnedUpload(self.device, self._chunk_bytes)
        self._uploads.upload(src, dst)
