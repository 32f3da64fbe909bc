"""Weight slots: the serving weights, allocated once, and where a new version is staged.

Two slots (one `LlamaWeights` each, allocated at start-up) hold up to two weights versions: the
active slot serves new requests; the standby slot holds the version staged for the next commit,
or, after a commit, the previous version (a rollback is another flip). A commit flips the
`active` index: nothing is copied, tensor addresses never change, and the CUDA graphs captured
per slot stay valid. With one slot (two did not fit in memory), a new version is copied over the
only slot in place between two engine steps: a pause the engine measures and reports.

Threads: the engine thread reads `versions` and `active` and flips; a slot is written only after
the engine has released it (`release`, its version becomes None, so no request can run on it),
by the stager's thread (or by the engine thread itself with one slot). On CUDA the copies run on
a side stream that is synchronized before the slot is handed back, so every later step sees the
whole version, from pinned buffers this thread fills (`PinnedUpload`, allocated at the first
copy and kept: allocating pinned memory takes driver locks the engine's launches wait on). The
device time of those transfers is measured (`copy_seconds`): the link is what a copy shares
with serving, and staging paces itself on it. Which version goes where, and when, is
`sitsd.weights.swap`'s business.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping

import torch

from sitsd.config import DEFAULT_CHUNK_BYTES
from sitsd.model.arch import LlamaArch
from sitsd.model.llama import LlamaWeights, empty_weights_like, weight_copy_plan


class PinnedUpload:
    """Host-to-device copies from pageable (memory-mapped) tensors through two pinned buffers.

    A copy from pageable memory makes the CUDA driver read the source into its own staging
    memory itself, page faults on a memory-mapped file included, while it holds locks that the
    engine thread's launches and copies wait on: measured on an H200, staging 16 GB that way
    froze decoding for seconds. Here this thread reads the source into a pinned buffer (the
    page faults are its own), then the GPU copies from it asynchronously on the current stream
    while the other buffer is filled.
    """

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self._buffers = [torch.empty(nbytes, dtype=torch.uint8, pin_memory=True) for _ in "ab"]
        # Each buffer's last upload: its start and end on the device, and whether the time
        # between them is still to be counted.
        self._started = [torch.cuda.Event(enable_timing=True) for _ in "ab"]
        self._copied = [torch.cuda.Event(enable_timing=True) for _ in "ab"]
        self._uncounted = [False, False]
        self._turn = 0
        self.busy_s = 0.0  # device seconds the uploads counted so far took

    def wait(self) -> None:
        """Wait for every upload (the caller synchronizes the stream too) and count them."""
        for turn in (0, 1):
            self._settle(turn)

    def _settle(self, turn: int) -> None:
        """Wait for buffer `turn`'s last upload; count its device time."""
        self._copied[turn].synchronize()
        if self._uncounted[turn]:
            self._uncounted[turn] = False
            self.busy_s += self._started[turn].elapsed_time(self._copied[turn]) / 1e3

    def upload(self, src: torch.Tensor, dst: torch.Tensor | None = None) -> torch.Tensor:
        """`src` on the device: copied into `dst` (any dtype, same shape) or a new tensor.
        Ordered on the current stream; `src` may be reused as soon as this returns."""
        turn, self._turn = self._turn, self._turn ^ 1
        nbytes = src.numel() * src.element_size()
        self._settle(turn)  # the upload that last read this buffer is done
        if nbytes > self._buffers[turn].numel():  # a row longer than the chunk size
            self._buffers[turn] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        staged = self._buffers[turn][:nbytes].view(src.dtype).view(src.shape)
        staged.copy_(src)  # the pageable read, on this thread
        self._started[turn].record()
        if dst is None:
            dst = staged.to(self.device, non_blocking=True)
        elif dst.dtype == src.dtype:
            dst.copy_(staged, non_blocking=True)
        else:
            dst.copy_(staged.to(self.device, non_blocking=True))  # cast on the device
        self._copied[turn].record()
        self._uncounted[turn] = True
        return dst


def row_chunks(tensor: torch.Tensor, chunk_bytes: int) -> Iterator[slice[int, int, None]]:
    """Slices of `tensor`'s leading dimension, each at most ~`chunk_bytes` (at least one row)."""
    rows = tensor.shape[0] if tensor.dim() else 1
    row_bytes = max(1, tensor.numel() // max(rows, 1) * tensor.element_size())
    step = max(1, chunk_bytes // row_bytes)
    for start in range(0, rows, step):
        yield slice(start, min(rows, start + step))


class WeightSlots:
    """One or two weight slots of one model, and which one is active."""

    def __init__(
        self, arch: LlamaArch, first: LlamaWeights, version: str, num_slots: int = 2
    ) -> None:
        """Args:
        arch: the architecture every slot holds.
        first: the start-up weights (slot 0, active).
        version: their version id.
        num_slots: 1 or 2; the second slot is allocated here, once.
        """
        if num_slots not in (1, 2):
            raise ValueError(f"num_slots must be 1 or 2, got {num_slots}")
        self.arch = arch
        on_cuda = first.embed_tokens.device.type == "cuda"
        # Zeros on CUDA: graphs are captured on the standby slot before anything is staged in
        # it; on the CPU empty pages are only committed when a version is copied in.
        self._slots = [first] + [empty_weights_like(first, zero=on_cuda)] * (num_slots - 1)
        self.versions: list[str | None] = [version] + [None] * (num_slots - 1)
        self.active = 0
        self.device = first.embed_tokens.device
        self.dtype = first.embed_tokens.dtype
        # CUDA staging copies: their stream and pinned buffers, made at the first copy.
        self._copy_stream: torch.cuda.Stream | None = None
        self._upload: PinnedUpload | None = None

    @property
    def copy_seconds(self) -> float:
        """Device seconds the staging copies' host-to-device transfers have taken so far
        (CUDA; 0 on a CPU). Read it on the copying thread: it grows as `copy_into` goes."""
        return self._upload.busy_s if self._upload is not None else 0.0

    @property
    def num_slots(self) -> int:
        return len(self._slots)

    @property
    def standby(self) -> int | None:
        """The slot a new version is staged into; None with one slot."""
        return 1 - self.active if len(self._slots) == 2 else None

    @property
    def active_version(self) -> str:
        version = self.versions[self.active]
        assert version is not None, "the active slot always holds a version"
        return version

    @property
    def standby_version(self) -> str | None:
        standby = self.standby
        return None if standby is None else self.versions[standby]

    @property
    def slot_nbytes(self) -> int:
        """Bytes one slot takes (the memory the second slot costs)."""
        return self._slots[0].nbytes

    def weights(self, index: int) -> LlamaWeights:
        return self._slots[index]

    def index_of(self, version: str) -> int | None:
        """The slot holding `version`, or None."""
        for index, held in enumerate(self.versions):
            if held == version:
                return index
        return None

    def weights_for(self, version: str) -> LlamaWeights:
        """The weights of a loaded version (a request's version is always loaded).

        Raises:
            KeyError: `version` is in no slot.
        """
        index = self.index_of(version)
        if index is None:
            raise KeyError(f"weights version {version!r} is in no slot (slots: {self.versions})")
        return self._slots[index]

    # ------------------------------------------------------------------ engine thread only

    def activate(self, version: str) -> None:
        """Make the slot holding `version` the active one (the flip of a commit)."""
        index = self.index_of(version)
        if index is None:
            raise KeyError(f"weights version {version!r} is in no slot (slots: {self.versions})")
        self.active = index

    def release(self, index: int) -> None:
        """Mark slot `index` as being rewritten: it holds no version until `fill`."""
        if index == self.active and len(self._slots) == 2:
            raise ValueError("the active slot cannot be rewritten while another slot exists")
        self.versions[index] = None

    def fill(self, index: int, version: str) -> None:
        """Slot `index` now holds `version` (its copy has completed)."""
        self.versions[index] = version

    # ----------------------------------------------------------------- the copy (stager)

    @torch.inference_mode()
    def copy_into(
        self,
        index: int,
        tensors: Mapping[str, torch.Tensor],
        *,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        on_progress: Callable[[int, int], None] | None = None,
    ) -> int:
        """Copy a checkpoint's Hugging Face-named tensors into slot `index`; returns the bytes.

        Chunked by rows, so the memory a copy needs beyond the slot stays under `chunk_bytes`
        (the source is memory-mapped: pages are read as they are copied; a dtype cast happens
        per chunk). On CUDA the copies run on a side stream, synchronized before returning,
        and their device time adds to `copy_seconds`. The slot must have been released
        (`release`).

        Args:
            index: the slot.
            tensors: the checkpoint tensors (names and shapes already checked).
            chunk_bytes: the largest piece copied at once.
            on_progress: called with (bytes copied, bytes total) after each chunk.
        """
        assert self.versions[index] is None, "copy only into a released slot"
        plan = weight_copy_plan(self.arch, self._slots[index])
        total = sum(dst.numel() * dst.element_size() for dst, _ in plan)
        done = 0
        stream, uploads = self._copy_path(chunk_bytes)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            for dst, name in plan:
                src = tensors[name]
                for rows in row_chunks(dst, chunk_bytes):
                    if uploads is not None and src.device.type == "cpu":
                        uploads.upload(src[rows], dst[rows])  # [rows, ...]
                    else:
                        dst[rows].copy_(src[rows])
                    done += (rows.stop - rows.start) * dst[0:1].numel() * dst.element_size()
                    if on_progress is not None:
                        on_progress(done, total)
        if stream is not None and uploads is not None:
            uploads.wait()
            stream.synchronize()  # every later step (any stream) sees the whole version
        return total

    def _copy_path(self, chunk_bytes: int) -> tuple[torch.cuda.Stream | None, PinnedUpload | None]:
        """CUDA: the copies' side stream and pinned buffers (made once); CPU: neither."""
        if self.device.type != "cuda":
            return None, None
        if self._copy_stream is None:
            self._copy_stream = torch.cuda.Stream(self.device)
        if self._upload is None:
            self._upload = PinnedUpload(self.device, chunk_bytes)
        return self._copy_stream, self._upload
