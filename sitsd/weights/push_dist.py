"""A push over a torch.distributed weight group: the trainer broadcasts buckets, sitsd receives.

`Admin.JoinWeightGroup` makes the daemon a rank of a group the trainer creates (`GroupMember`:
NCCL between GPUs, gloo between CPUs; `sitsd.runtime.process_group` builds it without any
process-wide state). A push over it (`Admin.UpdateWeightsFromGroup`, then `GroupPush`) brings
its tensor table and a bucket layout: the bytes of each broadcast, and where each tensor lies
in its bucket (so one broadcast carries many parameters: the syncs that make one call per
parameter are the slow ones). Once the standby slot is reserved the daemon reports "ready";
the trainer then broadcasts the buckets in order and the daemon receives each into one buffer
(on the GPU for NCCL, in host memory for gloo) and copies its tensors into the slot, casting to
the slot's dtype. The memory a push takes is the largest bucket.
"""

from __future__ import annotations

import asyncio
import datetime
from dataclasses import dataclass

import torch

from sitsd.engine.errors import InvalidRequestError
from sitsd.runtime.process_group import BACKENDS, WeightGroup, broadcast, stateless_group
from sitsd.runtime.slot_writer import SlotWriteError, SlotWriter
from sitsd.weights.checks import VersionRejected
from sitsd.weights.errors import GroupJoinError, SwapFailedError
from sitsd.weights.offthread import run_off_engine
from sitsd.weights.progress import ByteProgress, Pacer, ProgressSink, SwapProgress
from sitsd.weights.push_plan import PushPlan, TensorSpec

READY = "ready"  # the progress stage after which the trainer broadcasts
MAX_BUCKET_BYTES = 4 * 2**30  # the largest broadcast a push may announce
_ALIGN = 16  # tensors start in a bucket at multiples of this many bytes at least
MAX_WORLD_SIZE = 2**16  # ranks in a weight group (torch's store counts them in a C int)
MAX_GROUP_TIMEOUT_S = 24 * 3600.0  # the longest rendezvous or broadcast wait a join may ask for
MAX_ADDRESS_CHARS = 253  # the longest DNS name


@dataclass(frozen=True)
class GroupSpec:
    """Where the trainer's group meets, and this daemon's place in it."""

    master_address: str
    master_port: int
    world_size: int
    rank: int
    backend: str  # "gloo" or "nccl"
    name: str  # the group's rendezvous key prefix
    timeout_s: float


class GroupMember:
    """This daemon as one rank of a trainer's weight group."""

    def __init__(self, spec: GroupSpec, group: WeightGroup, device: torch.device) -> None:
        self.spec = spec
        self.group = group
        # Where received buckets live: NCCL broadcasts between GPUs, gloo through host memory.
        self.bucket_device = device if spec.backend == "nccl" else torch.device("cpu")

    @staticmethod
    def check(spec: GroupSpec, device: torch.device) -> None:
        """Raises InvalidRequestError naming the field that cannot work."""
        if spec.backend not in BACKENDS:
            raise InvalidRequestError("backend", f"must be one of {', '.join(BACKENDS)}")
        if spec.backend == "nccl" and device.type != "cuda":
            raise InvalidRequestError("backend", "NCCL needs a daemon on a GPU: use gloo")
        address = spec.master_address
        if not address or len(address) > MAX_ADDRESS_CHARS or not address.isprintable():
            raise InvalidRequestError(
                "master_address",
                f"the trainer's store host: 1-{MAX_ADDRESS_CHARS} printable characters",
            )
        if not 0 < spec.master_port < 65536:
            raise InvalidRequestError(
                "master_port", f"must be in [1, 65535]; got {spec.master_port}"
            )
        if not 1 < spec.world_size <= MAX_WORLD_SIZE:
            raise InvalidRequestError(
                "world_size", f"must be in [2, {MAX_WORLD_SIZE}]; got {spec.world_size}"
            )
        if not 0 < spec.rank < spec.world_size:
            raise InvalidRequestError(
                "rank", f"must be in [1, world_size) (rank 0 is the trainer); got {spec.rank}"
            )
        if not 0 < spec.timeout_s <= MAX_GROUP_TIMEOUT_S:  # NaN fails too
            raise InvalidRequestError(
                "timeout_s", f"must be in (0, {MAX_GROUP_TIMEOUT_S:.0f}]; got {spec.timeout_s}"
            )

    @classmethod
    async def join(cls, spec: GroupSpec, device: torch.device) -> GroupMember:
        """Rendezvous with the trainer (off the event loop; returns once every rank joined).

        Raises:
            InvalidRequestError: a field that cannot work.
            GroupJoinError: the rendezvous failed or timed out.
        """
        cls.check(spec, device)

        def rendezvous() -> WeightGroup:
            return stateless_group(
                backend=spec.backend, master_address=spec.master_address,
                master_port=spec.master_port, rank=spec.rank, world_size=spec.world_size,
                group_name=spec.name, timeout=datetime.timedelta(seconds=spec.timeout_s),
            )  # fmt: skip

        try:
            group = await run_off_engine(rendezvous, name="sitsd-weight-group")
        except (RuntimeError, TimeoutError, OSError, ValueError) as exc:  # torch's store errors
            where = f"{spec.master_address}:{spec.master_port}"
            raise GroupJoinError(
                f"could not join weight group {spec.name!r} at {where} as rank {spec.rank} of "
                f"{spec.world_size} ({spec.backend}): {type(exc).__name__}: {exc}"
            ) from exc
        return cls(spec, group, device)


@dataclass(frozen=True)
class Placement:
    """Where one tensor lies in the broadcasts of a push."""

    bucket: int  # which broadcast
    offset: int  # its first byte in the bucket


class GroupPush:
    """A `PushSource` receiving a push's buckets from the group (see the module docstring)."""

    def __init__(
        self,
        plan: PushPlan,
        member: GroupMember,
        bucket_bytes: tuple[int, ...],
        placements: tuple[Placement, ...],
        src_rank: int = 0,
    ) -> None:
        self._plan = plan
        self._member = member
        self._bucket_bytes = bucket_bytes
        self._placements = placements
        self._src_rank = src_rank

    @property
    def plan(self) -> PushPlan:
        return self._plan

    def check(self) -> None:
        """The bucket layout fits the table (see `_layout`)."""
        self._layout()

    async def receive(
        self, writer: SlotWriter, version: str, progress: ProgressSink, cpu_share: float
    ) -> int:
        buckets = self._layout()
        loop = asyncio.get_running_loop()
        on_bytes = ByteProgress(loop, progress, "receive", version, pace=Pacer(cpu_share))
        message = f"receiving {len(buckets)} broadcasts from rank {self._src_rank}"
        progress(SwapProgress(READY, version, bytes_total=sum(self._bucket_bytes), message=message))
        await run_off_engine(lambda: self._receive(writer, buckets, on_bytes), name="sitsd-push")
        return sum(self._bucket_bytes)

    def _layout(self) -> list[list[tuple[TensorSpec, int]]]:
        """Each bucket's (tensor, byte offset) pairs, checked against the buckets' sizes.

        Raises:
            VersionRejected: a placement outside its bucket, misaligned, too large a bucket,
                or a source rank that is not another rank of the group.
        """
        group = self._member.group
        if not 0 <= self._src_rank < group.size() or self._src_rank == group.rank():
            raise VersionRejected(
                f"src_rank {self._src_rank} is not another rank of the weight group (ranks 0 "
                f"to {group.size() - 1}; this daemon is rank {group.rank()})"
            )
        if len(self._placements) != len(self._plan.tensors):
            raise VersionRejected("the bucket layout does not place every tensor of the table")
        if any(not 0 < size <= MAX_BUCKET_BYTES for size in self._bucket_bytes):
            raise VersionRejected(f"a bucket must hold 1 to {MAX_BUCKET_BYTES} bytes")
        buckets: list[list[tuple[TensorSpec, int]]] = [[] for _ in self._bucket_bytes]
        for spec, place in zip(self._plan.tensors, self._placements, strict=True):
            if not 0 <= place.bucket < len(buckets):
                raise VersionRejected(f"{spec.name} is placed in bucket {place.bucket} of none")
            end = place.offset + spec.nbytes
            if place.offset < 0 or place.offset % _ALIGN or end > self._bucket_bytes[place.bucket]:
                raise VersionRejected(
                    f"{spec.name} at bytes [{place.offset}, {end}) of bucket {place.bucket} "
                    f"({self._bucket_bytes[place.bucket]} bytes; offsets are multiples of "
                    f"{_ALIGN})"
                )
            buckets[place.bucket].append((spec, place.offset))
        return buckets

    def _receive(
        self,
        writer: SlotWriter,
        buckets: list[list[tuple[TensorSpec, int]]],
        on_bytes: ByteProgress,
    ) -> None:
        """Each broadcast into the buffer, then its tensors into the slot (stager thread)."""
        member = self._member
        buffer = torch.empty(
            max(self._bucket_bytes), dtype=torch.uint8, device=member.bucket_device
        )
        total, done = sum(self._bucket_bytes), 0
        # On the writer's stream: NCCL's broadcast waits for the copies out of the buffer
        # queued before it, and the copies after it wait for the broadcast.
        with writer.side_stream():
            for size, tensors in zip(self._bucket_bytes, buckets, strict=True):
                bucket = buffer[:size]
                try:
                    broadcast(member.group, bucket, self._src_rank)
                except RuntimeError as exc:  # the trainer went away, or the group timed out
                    raise SwapFailedError(f"the weight group's broadcast failed: {exc}") from None
                for spec, offset in tensors:
                    raw = bucket[offset : offset + spec.nbytes]
                    try:
                        writer.write(spec.name, raw.view(spec.torch_dtype).view(spec.shape))
                    except SlotWriteError as exc:
                        raise VersionRejected(str(exc)) from None
                done += size
                on_bytes(done, total)
