"""A push over CUDA IPC: a trainer on the same GPU hands over its tensors' memory, not bytes.

The trainer (`sitsd.client`) reduces each tensor with torch's own CUDA IPC reduction
(`torch.multiprocessing.reductions.reduce_tensor`) and sends its fields as plain proto fields
(`IpcHandle`): no pickle crosses the wire. `IpcPush.receive` checks every handle against the
table (its view must lie inside the memory it shares, or the copy would read another process's
memory), opens each with `rebuild_cuda_tensor`, copies it device to device into the standby
slot on the slot writer's side stream (casting on the device), waits for the copies and only
then drops the handles, then reports "released": from then on the trainer may free or change
its tensors. Tensors that share an allocation (views of one flat buffer, or blocks of one
segment of the trainer's allocator) share one opening of it. Serving goes on meanwhile; the
copies share the GPU with it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sitsd.engine.errors import InvalidRequestError
from sitsd.runtime.slot_writer import SlotWriteError, SlotWriter
from sitsd.weights.checks import VersionRejected
from sitsd.weights.offthread import run_off_engine
from sitsd.weights.progress import ProgressSink, SwapProgress
from sitsd.weights.push_plan import PushPlan, TensorSpec

RELEASED = "released"  # the progress stage after which the trainer's tensors are free


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


class IpcPush:
    """A `PushSource` opening a trainer's CUDA IPC handles (see the module docstring)."""

    def __init__(self, plan: PushPlan, handles: list[IpcHandle]) -> None:
        self._plan = plan
        self._handles = handles

    @property
    def plan(self) -> PushPlan:
        return self._plan

    def check(self) -> None:
        """One handle per tensor of the table, each view inside the memory it shares."""
        if [h.name for h in self._handles] != self._plan.names:
            raise VersionRejected("the IPC handles do not follow the tensor table, one each")
        for spec, handle in zip(self._plan.tensors, self._handles, strict=True):
            _check_extent(spec, handle)

    async def receive(
        self, writer: SlotWriter, version: str, progress: ProgressSink, cpu_share: float
    ) -> int:
        await run_off_engine(lambda: self._copy(writer), name="sitsd-push-ipc")
        progress(
            SwapProgress(RELEASED, version, message="copied: the trainer may free its tensors")
        )
        return self._plan.nbytes

    def _copy(self, writer: SlotWriter) -> None:
        """Open every handle and queue its copy, wait for the copies, then drop the handles
        (stager thread).

        Every opened tensor is held until the last copy is done: torch caches an opened
        allocation only while a tensor maps it, so dropping each tensor once its copy was
        queued closed the allocation's mapping (`cudaIpcCloseMemHandle`) for the next tensor
        of the same allocation to open again, and let the mapping go while a copy could
        still read it.
        """
        opened: list[torch.Tensor] = []
        try:
            with torch.cuda.device(writer.device), writer.side_stream():
                for spec, handle in zip(self._plan.tensors, self._handles, strict=True):
                    # Rebuilt on the side stream: the producer's event is waited for there.
                    opened.append(_rebuild(spec, handle, writer.device))
                    try:
                        writer.write(spec.name, opened[-1])
                    except SlotWriteError as exc:
                        raise VersionRejected(str(exc)) from None
        finally:
            writer.sync()  # the copies have read the trainer's memory (even a push cut short)
            opened.clear()  # the last references: the producer's counts drop


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


def _rebuild(spec: TensorSpec, handle: IpcHandle, device: torch.device) -> torch.Tensor:
    """The trainer's tensor, mapped into this process (torch's own IPC rebuild)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    try:
        tensor: torch.Tensor = rebuild_cuda_tensor(
            torch.Tensor, torch.Size(spec.shape), handle.stride, handle.storage_offset,
            torch.UntypedStorage, spec.torch_dtype, device.index, handle.storage_handle,
            handle.storage_size_bytes, handle.storage_offset_bytes, False,
            handle.ref_counter_handle, handle.ref_counter_offset, handle.event_handle,
            handle.event_sync_required,
        )  # fmt: skip
    except RuntimeError as exc:  # a handle CUDA cannot open (another GPU, a freed block)
        raise VersionRejected(f"{spec.name}: its IPC handle cannot be opened: {exc}") from None
    return tensor
