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
whole version, from pinned buffers this thread fills (`PinnedUpload`, allocated here, before
serving, and lent to the version checks and to pushes too, `pinned_uploads`: allocating pinned
memory takes driver locks the engine's launches wait on; on an H200 the first swap's validation
and the first gRPC push, which each made their own, each began with an 80-90 ms step). The
device time of those transfers is measured (`copy_seconds`): the link is what a copy shares
with serving, and staging paces itself on it. Which version goes where, and when, is
`sitsd.weights.swap`'s business.

Precisions: every slot is built by one `ServingFormat` (device, dtype, `--quantize`), but two
versions may differ in what their checkpoints store quantized (a bf16 version and its INT4
one). A copy fills each field in place when the new version's value has the field's structure
(dense tensors chunk by chunk, as before; quantized layouts converted on the device, then
copied); a field of another structure is rebuilt in new tensors, and the slot is marked
`restructured` until the runner has captured its CUDA graphs again (`take_restructured`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass

import torch

from sitsd.config import DEFAULT_CHUNK_BYTES
from sitsd.model.arch import LlamaArch
from sitsd.model.llama import LlamaWeights, ServingFormat, empty_weights_like, weight_copy_plan
from sitsd.model.weights import (
    SlotField,
    build_field,
    dense16_dtype,
    dense_copy_dtype,
    expected_shapes,
    field_tensor_names,
    slot_fields,
)
from sitsd.quant.linear import copy_weight_into, same_structure, weight_nbytes
from sitsd.quant.source import QuantSource


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


@dataclass(frozen=True)
class SlotViews:
    """One slot's tensors as a push addresses them, by Hugging Face name (`slot_views`)."""

    dense: dict[str, torch.Tensor]  # name -> the view of the slot's tensor it fills, copy order
    quantized: tuple[str, ...]  # names the slot holds in a quantized layout (not in `dense`)
    device: torch.device
    dtype: torch.dtype  # the embedding's (the dense 16/32-bit tensors')


def slot_views(arch: LlamaArch, weights: LlamaWeights) -> SlotViews:
    """`weights` as a push addresses it: ~300 views and names, a few milliseconds of the
    interpreter for an 8B model (`WeightSlots.views` keeps them per slot)."""
    dense = {name: view for view, name in weight_copy_plan(arch, weights)}
    quantized = tuple(name for name in expected_shapes(arch) if name not in dense)
    return SlotViews(dense, quantized, weights.embed_tokens.device, weights.embed_tokens.dtype)


def warm_copy_kernels(stream: torch.cuda.Stream, dtype: torch.dtype) -> None:
    """Launch once, on a few elements, each kernel a version's copies and checks launch into
    slots of `dtype` (copies from 32- and 16-bit sources, the fused sums and finiteness checks).

    CUDA loads a kernel's module at its first launch. On an H200 the first launches of the
    push's copy and sum kernels took the launching thread 18 and 61 ms (`bench.probe_ipc`), and
    the first live push after start-up, whose kernels the daemon had never launched, held two
    serving steps at 25-28 ms (5.5x their median) in its copy and its check, where later pushes
    held none there (`bench.bench_push`'s timeline); made here, before serving, they cost no
    step.
    """
    with torch.inference_mode(), torch.cuda.stream(stream):
        dst = torch.zeros(64, dtype=dtype, device=stream.device)
        for src_dtype in (torch.float32, torch.bfloat16, torch.float16):
            src = torch.zeros(64, dtype=src_dtype, device=stream.device)
            torch._foreach_copy_([dst], [src])
            dst.copy_(src)
        sums = torch._foreach_norm([dst, dst[:32]], 1, dtype=torch.float32)
        torch.isfinite(torch.stack(sums)).tolist()
        torch.stack([torch.isfinite(dst).all(), torch.isfinite(dst[:32]).all()]).all().item()
    stream.synchronize()


class WeightSlots:
    """One or two weight slots of one model, and which one is active."""

    def __init__(
        self,
        arch: LlamaArch,
        first: LlamaWeights,
        version: str,
        num_slots: int = 2,
        fmt: ServingFormat | None = None,
    ) -> None:
        """Args:
        arch: the architecture every slot holds.
        first: the start-up weights (slot 0, active).
        version: their version id.
        num_slots: 1 or 2; the second slot is allocated here, once.
        fmt: how every version is built (default: dense, in `first`'s device and dtype).
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
        self.device = first.norm.device
        self.dtype = first.norm.dtype  # the activations' (a 16-bit embedding may differ)
        self.fmt = fmt or ServingFormat(self.device, self.dtype)
        self._restructured: set[int] = set()  # slots whose tensors moved since their graphs
        # Each slot's views by name (`views`), made at its first use and again once its
        # tensors moved: a push's threads would otherwise walk both slots at every push,
        # holding the interpreter the engine's step waits for between its torch calls.
        self._views: dict[int, SlotViews] = {}
        # (precision, bytes) of each slot's version, taken when it is filled (status reads it)
        self._described: list[tuple[str, int]] = [(first.precision, first.nbytes)] * num_slots
        # CUDA staging copies: their stream and pinned buffers, made now (see the docstring),
        # as large as the default chunk, the largest piece any user moves by default (a larger
        # `chunk_bytes` grows them once, at its first upload).
        on_gpu = self.device.type == "cuda"
        self._copy_stream = torch.cuda.Stream(self.device) if on_gpu else None
        self._upload = PinnedUpload(self.device, DEFAULT_CHUNK_BYTES) if on_gpu else None
        if self._copy_stream is not None:
            warm_copy_kernels(self._copy_stream, first.embed_tokens.dtype)

    def pinned_uploads(self) -> PinnedUpload | None:
        """The staging copies' pinned buffers, lent to whatever else uploads for a swap (the
        version checks, a push's writer): one swap at a time, so one user at a time. None on a
        CPU."""
        return self._upload

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

    def nbytes(self, index: int) -> int:
        """Bytes slot `index`'s version takes (as of its last `fill`)."""
        return self._described[index][1]

    def precision(self, index: int) -> str:
        """What runs in which bits in slot `index` (`LlamaWeights.precision`, as of its last
        `fill`)."""
        return self._described[index][0]

    def restructured(self, index: int) -> bool:
        """Whether slot `index`'s tensors moved since its graphs were captured."""
        return index in self._restructured

    def take_restructured(self, index: int) -> bool:
        """Whether slot `index`'s tensors moved since its graphs were captured (cleared)."""
        moved = index in self._restructured
        self._restructured.discard(index)
        return moved

    def weights(self, index: int) -> LlamaWeights:
        return self._slots[index]

    def views(self, index: int) -> SlotViews:
        """Slot `index`'s tensors by Hugging Face name (made once per structure of the slot)."""
        views = self._views.get(index)
        if views is None:
            views = self._views[index] = slot_views(self.arch, self._slots[index])
        return views

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
        weights = self._slots[index]
        self._described[index] = (weights.precision, weights.nbytes)
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
        source: QuantSource | None = None,
    ) -> int:
        """Copy a checkpoint's Hugging Face-named tensors into slot `index`; returns the bytes.

        Dense fields the new version holds in the same dtype are copied chunk by chunk, by rows,
        so the memory a copy needs beyond the slot stays under `chunk_bytes` (the source is
        memory-mapped: pages are read as they are copied; a dtype cast happens per chunk); the
        others are built on the device (`build_field`) and copied in, or take the new tensors
        (see the module docstring). On CUDA the copies run on a side stream, synchronized
        before returning, and their device time adds to `copy_seconds`. The slot must have been
        released (`release`).

        Args:
            index: the slot.
            tensors: the checkpoint tensors (names and shapes already checked).
            chunk_bytes: the largest piece copied at once.
            on_progress: called with (bytes copied, bytes total) after each chunk or field.
            source: what the checkpoint stores quantized (`Checkpoint.quant`).
        """
        assert self.versions[index] is None, "copy only into a released slot"
        weights = self._slots[index]
        dense16 = dense16_dtype(self.arch, tensors, source, self.fmt)
        rebuilt = [f for f in slot_fields(self.arch) if not self._copies_in_place(
            f, weights, tensors, source, dense16)]  # fmt: skip
        skip = {name for f in rebuilt for name, _ in f.parts}
        plan = [(dst, name) for dst, name in weight_copy_plan(self.arch, weights)
                if name.removesuffix(".weight") not in skip and name not in skip]  # fmt: skip
        total = sum(dst.numel() * dst.element_size() for dst, _ in plan)
        total += sum(weight_nbytes(getattr(f.owner(weights), f.field)) for f in rebuilt)
        done = 0
        stream, uploads = self._copy_stream, self._upload
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
            for f in rebuilt:
                done += self._rebuild(index, f, tensors, source, dense16, uploads)
                if on_progress is not None:
                    on_progress(min(done, total), total)
            if self.arch.tie_word_embeddings:
                weights.lm_head = weights.embed_tokens
        if stream is not None and uploads is not None:
            uploads.wait()
            stream.synchronize()  # every later step (any stream) sees the whole version
        return total

    def _copies_in_place(
        self,
        f: SlotField,
        weights: LlamaWeights,
        tensors: Mapping[str, torch.Tensor],
        source: QuantSource | None,
        dense16: torch.dtype,
    ) -> bool:
        """Whether field `f` takes the new version chunk by chunk (dense, same dtype)."""
        dst = getattr(f.owner(weights), f.field)
        dtype = dense_copy_dtype(f, tensors, source, self.fmt, dense16)
        return isinstance(dst, torch.Tensor) and dtype == dst.dtype

    def _rebuild(
        self,
        index: int,
        f: SlotField,
        tensors: Mapping[str, torch.Tensor],
        source: QuantSource | None,
        dense16: torch.dtype,
        uploads: PinnedUpload | None,
    ) -> int:
        """Build field `f` of slot `index` from the checkpoint on the device; copy it into the
        field's tensors, or let it take the new ones. Returns the bytes."""
        own: Mapping[str, torch.Tensor] = tensors
        if uploads is not None:  # through pinned buffers: the driver must not read the mapping
            own = {n: uploads.upload(tensors[n]) for n in field_tensor_names(f, tensors, source)}
        new = build_field(f, own, source, self.fmt, dense16)
        owner = f.owner(self._slots[index])
        old = getattr(owner, f.field)
        if same_structure(old, new):
            copy_weight_into(old, new)
        else:
            setattr(owner, f.field, new)
            self._restructured.add(index)
            self._views.pop(index, None)  # they view the tensors let go
        return weight_nbytes(new)
