"""A push over CUDA IPC: a trainer on the same GPU hands over its tensors' memory, not bytes.

The trainer (`sitsd.client`) reduces each tensor with torch's own CUDA IPC reduction
(`torch.multiprocessing.reductions.reduce_tensor`) and sends its fields as plain proto fields
(`IpcHandle`): no pickle crosses the wire. `IpcPush.receive` checks every handle against the
table (its view must lie inside the memory it shares, or the copy would read another process's
memory), opens each shared storage once with `rebuild_cuda_tensor` (tensors that share one,
views of a flat buffer or blocks of one segment of the trainer's allocator, share its
opening), makes every tensor a view of its storage, copies them all device to device into the
standby slot in one call on the slot writer's side stream (casting on the device), waits for
the copies and only then lets go of the storages and the producer's counts, then reports
"released": from then on the trainer may free or change its tensors. Which handles share a
storage, their views and the counts to release are plain functions of the handles (testable
without a GPU). Serving goes on meanwhile; the copies share the GPU with it.

With `IpcMappings` (`--ipc-keep-mapped`) the storages stay mapped after the push, and the
next push from the same buffers copies from them without mapping anything; the trainer's
memory then stays allocated until a push from other buffers, or the daemon stopping, lets go.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from sitsd.engine.errors import InvalidRequestError
from sitsd.runtime.slot_writer import SlotWriteError, SlotWriter
from sitsd.weights.checks import VersionRejected
from sitsd.weights.offthread import run_off_engine
from sitsd.weights.progress import ProgressSink, SwapProgress
from sitsd.weights.push_plan import PushPlan, TensorSpec

log = logging.getLogger("sitsd.swap")

RELEASED = "released"  # the progress stage after which the trainer's tensors are free
# Each push's parts and their times, logged (`bench.bench_push` reads them back).
PARTS_LINE = ("ipc push %s: %d shared storages opened in %.1f ms (%d kept mapped from the last "
              "push), %d tensors copied in %.1f ms, let go in %.1f ms")  # fmt: skip


@dataclass(frozen=True)
class IpcHandle:
    """One tensor as torch's CUDA IPC reduction describes it (`reduce_tensor`'s fields)."""

    name: str
    stride: tuple[int, ...]  # elements
    storage_offset: int  # elements, from the shared storage's start
    storage_handle: bytes  # cudaIpcMemHandle of the allocation holding the storage
    storage_size_bytes: int
    storage_offset_bytes: int  # the storage's place in that allocation
    ref_counter_handle: bytes  # the producer's reference count of the shared block
    ref_counter_offset: int
    event_handle: bytes  # the producer's event to wait for before reading
    event_sync_required: bool


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID: what tells a trainer's process and this one that they share it."""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_same_gpu(device: torch.device, trainer_uuid: str) -> None:
    """An IPC push needs the trainer's tensors on this daemon's GPU.

    Raises:
        InvalidRequestError: another GPU, or a daemon on the CPU (field `device_uuid`).
    """
    if device.type != "cuda":
        raise InvalidRequestError("device_uuid", "this daemon serves on the CPU: push over grpc")
    mine = device_uuid(device)
    if trainer_uuid != mine:
        raise InvalidRequestError(
            "device_uuid",
            f"the tensors are on GPU {trainer_uuid or '(none)'}, this daemon on {mine}: "
            "push over grpc or a weight group",
        )


class IpcMappings:
    """A trainer's shared storages one IPC push mapped, kept for the next one.

    Mapping a trainer's allocation and letting go of it are driver calls the engine's launches
    wait behind (on an H200 the let-go took 6-7 ms while serving, and a 13-17 ms gap in the
    streams often followed it); a trainer that pushes from the same buffers every step needs
    them mapped once. Each kept storage holds the count of the push that mapped it, so the
    trainer's allocator keeps that memory (in torch's limbo once the trainer frees it) until a
    push from other buffers, or `clear`, lets go. One push at a time uses it (the swap
    manager's lock).
    """

    def __init__(self) -> None:
        self._kept: dict[StorageKey, torch.UntypedStorage] = {}

    def __len__(self) -> int:
        return len(self._kept)

    def get(self, key: StorageKey) -> torch.UntypedStorage | None:
        return self._kept.get(key)

    def keep(self, storages: Mapping[StorageKey, torch.UntypedStorage]) -> None:
        """Keep exactly `storages` (the last push's); the kept ones it did not use are let go."""
        self._kept = dict(storages)

    def clear(self) -> None:
        self._kept = {}


class IpcPush:
    """A `PushSource` opening a trainer's CUDA IPC handles (see the module docstring)."""

    def __init__(
        self, plan: PushPlan, handles: list[IpcHandle], kept: IpcMappings | None = None
    ) -> None:
        """`kept`: storages mapped by the last push, reused where this one's handles name them,
        and this push's storages kept in their place (None: each push maps and lets go of its
        own)."""
        self._plan = plan
        self._handles = handles
        self.mappings = kept  # the mappings it reuses and refills, or None

    @property
    def plan(self) -> PushPlan:
        return self._plan

    def check(self) -> None:
        """One handle per tensor of the table, each view inside the memory it shares."""
        if [h.name for h in self._handles] != self._plan.names:
            raise VersionRejected("the IPC handles do not follow the tensor table, one each")
        for spec, handle in zip(self._plan.tensors, self._handles, strict=True):
            _check_extent(spec, handle)
        check_shared_sizes(self._handles)

    async def receive(
        self, writer: SlotWriter, version: str, progress: ProgressSink, cpu_share: float
    ) -> int:
        await run_off_engine(lambda: self._copy(writer, version), name="sitsd-push-ipc")
        progress(
            SwapProgress(RELEASED, version, message="copied: the trainer may free its tensors")
        )
        return self._plan.nbytes

    def _copy(self, writer: SlotWriter, version: str) -> None:
        """Open each shared storage once, copy every tensor out of it in one call, wait for the
        copies, then let go of the storages and the producer's counts (stager thread); a log
        line gives each part's time (a slow serving step in the window is then placed).

        A call into torch lets go of the interpreter, and this thread then waits for the
        engine's to hand it back: opening and copying tensor by tensor (291 of an 8B model, a
        dozen calls each) took an H200 197 ms for 8 ms of copying. Every opened storage is held
        until the copies are done: torch keeps an opened allocation mapped only while a tensor
        maps it, and a mapping let go early could be read by a queued copy.
        """
        opened: dict[StorageKey, torch.UntypedStorage] = {}
        held: set[Counter] = set()  # the producer's counts the openings hold
        views: list[torch.Tensor] = []
        marks = [time.monotonic()]  # start, opened, copied, let go
        try:
            with torch.cuda.device(writer.device), writer.side_stream():
                # Opened (or waited for) on the side stream: the producer's event is waited
                # for there.
                for handle in first_of_each_storage(self._handles):
                    key = storage_key(handle)
                    mapped = self.mappings.get(key) if self.mappings is not None else None
                    if mapped is None:
                        opened[key] = _open(handle, writer.device)
                        held.add(counter_of(handle))
                    else:  # its count is released below, with the views' own
                        _wait_for_producer(handle, writer.device)
                        opened[key] = mapped
                num_reused = len(opened) - len(held)
                marks.append(time.monotonic())
                views = storage_views(self._plan, self._handles, opened)
                try:
                    writer.write_all(self._plan.names, views)
                except SlotWriteError as exc:
                    raise VersionRejected(str(exc)) from None
        finally:
            writer.sync()  # the copies have read the trainer's memory (even a push cut short)
            marks.append(time.monotonic())
            views.clear()
            if self.mappings is not None:
                self.mappings.keep(opened)  # those it held before and this push did not name go
            opened.clear()  # the last references (unless kept): the openings' counts drop
            _release(counters_to_release(self._handles, held), writer.device)
            marks.append(time.monotonic())
        open_ms, copy_ms, close_ms = (1e3 * (b - a) for a, b in itertools.pairwise(marks))
        log.info(PARTS_LINE, version, len(held), open_ms, num_reused, len(self._handles),
                 copy_ms, close_ms, extra={"weights_version": version})  # fmt: skip


StorageKey = tuple[bytes, int]  # (storage_handle, storage_offset_bytes): one shared storage
Counter = tuple[bytes, int]  # (ref_counter_handle, ref_counter_offset): one producer's count


def storage_key(handle: IpcHandle) -> StorageKey:
    """What tells two handles of one shared storage (torch caches an opening by it too)."""
    return handle.storage_handle, handle.storage_offset_bytes


def counter_of(handle: IpcHandle) -> Counter:
    return handle.ref_counter_handle, handle.ref_counter_offset


def first_of_each_storage(handles: list[IpcHandle]) -> list[IpcHandle]:
    """The first handle of each shared storage, in order: the one it is opened with."""
    firsts: dict[StorageKey, IpcHandle] = {}
    for handle in handles:
        firsts.setdefault(storage_key(handle), handle)
    return list(firsts.values())


def counters_to_release(handles: list[IpcHandle], held: set[Counter]) -> list[Counter]:
    """The producer's counts no opening holds, each once.

    The trainer's reduction takes a count per tensor reduced (a client may reduce a storage
    once for all its views: one count); an opening holds its handle's count until the storage
    is let go, and every other count is released here (as torch's rebuild does for a storage
    it has open already), also those of storages never opened (a push cut short), so that the
    trainer's allocator gets its memory back.
    """
    out: dict[Counter, None] = {}
    for handle in handles:
        counter = counter_of(handle)
        if handle.ref_counter_handle and counter not in held:
            out.setdefault(counter)
    return list(out)


def check_shared_sizes(handles: list[IpcHandle]) -> None:
    """Handles of one shared storage must agree on its size (its first one's is opened, and
    each view was checked against its own handle's).

    Raises:
        VersionRejected: naming the tensor.
    """
    sizes: dict[StorageKey, int] = {}
    for handle in handles:
        size = sizes.setdefault(storage_key(handle), handle.storage_size_bytes)
        if size != handle.storage_size_bytes:
            raise VersionRejected(
                f"{handle.name}: its IPC storage is {handle.storage_size_bytes} bytes, another "
                f"tensor's handle of the same storage says {size}"
            )


def storage_views(
    plan: PushPlan, handles: list[IpcHandle], storages: Mapping[StorageKey, torch.UntypedStorage]
) -> list[torch.Tensor]:
    """Each tensor of the table as the view its handle describes (dtype, shape, strides,
    offset) of its opened storage: one call into torch per tensor, one more per storage and
    dtype (`check` has put every view inside its storage)."""
    bases: dict[tuple[StorageKey, torch.dtype], torch.Tensor] = {}
    views = []
    for spec, handle in zip(plan.tensors, handles, strict=True):
        key, dtype = storage_key(handle), spec.torch_dtype
        base = bases.get((key, dtype))
        if base is None:
            storage = storages[key]
            base = torch.empty(0, dtype=dtype, device=storage.device).set_(storage)
            bases[key, dtype] = base
        views.append(torch.as_strided(base, spec.shape, handle.stride, handle.storage_offset))
    return views


def _check_extent(spec: TensorSpec, handle: IpcHandle) -> None:
    """The view (offset, shape, strides) must lie inside the shared storage.

    Raises:
        VersionRejected: naming the tensor.
    """
    itemsize = spec.torch_dtype.itemsize
    if len(handle.stride) != len(spec.shape) or any(s < 0 for s in handle.stride):
        raise VersionRejected(f"{spec.name}: its IPC strides {handle.stride} do not fit its shape")
    if not handle.storage_handle or handle.storage_offset < 0:
        raise VersionRejected(f"{spec.name}: its IPC handle is empty")
    last = handle.storage_offset + sum((n - 1) * s for n, s in zip(spec.shape, handle.stride))
    if (last + 1) * itemsize > handle.storage_size_bytes:
        raise VersionRejected(
            f"{spec.name}: its view reaches byte {(last + 1) * itemsize} of a shared storage of "
            f"{handle.storage_size_bytes}"
        )


def _open(handle: IpcHandle, device: torch.device) -> torch.UntypedStorage:
    """The shared storage `handle` views, mapped into this process (torch's own IPC rebuild,
    of one byte tensor over all of it).

    Raises:
        VersionRejected: CUDA cannot open it (another GPU, a freed block), naming the tensor.
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        whole: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size([handle.storage_size_bytes]), (1,), 0, torch.UntypedStorage,
            torch.uint8, device.index, handle.storage_handle, handle.storage_size_bytes,
            handle.storage_offset_bytes, False, handle.ref_counter_handle,
            handle.ref_counter_offset, handle.event_handle, handle.event_sync_required,
        )  # fmt: skip
    except RuntimeError as exc:
        raise VersionRejected(f"{handle.name}: its IPC handle cannot be opened: {exc}") from None
    return whole.untyped_storage()


def _wait_for_producer(handle: IpcHandle, device: torch.device) -> None:
    """Order the current stream after the producer's event for this push (a storage mapped
    already: torch's rebuild waits for it only when it maps one)."""
    if handle.event_sync_required and handle.event_handle:
        try:
            torch.cuda.Event.from_ipc_handle(device, handle.event_handle).wait()
        except RuntimeError as exc:
            raise VersionRejected(f"{handle.name}: its IPC event cannot be opened: {exc}") from None


def _release(counters: list[Counter], device: torch.device) -> None:
    """Release the producer's counts (torch's own call; best effort: a trainer gone is fine)."""
    for ref_handle, ref_offset in counters:
        torch.UntypedStorage._release_ipc_counter(ref_handle, ref_offset, device=device.index)
