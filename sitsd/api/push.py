"""The Admin RPCs of live weight pushes: proto messages in, push sources, events out.

`PushRpcs` holds the bodies of `UpdateWeights` (a client stream of chunks), `UpdateWeightsIpc`
and `UpdateWeightsFromGroup` (server streams of `PushEvent`) and `JoinWeightGroup`; the Admin
servicer (`admin.py`) delegates to it. Each turns its request into a header, a tensor table and
a transport (`sitsd.weights.push_stream`, `push_ipc`, `push_dist`) and hands them to the
daemon's `WeightPushes` (`sitsd.weights.push`), whose report is the answer. A push runs as a
task of its own: a client that goes away mid-stream ends its push (its bytes stop) but never
leaves the swap machinery half-way. Authentication and error statuses are the interceptors'.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable
from typing import Any

import grpc.aio

from sitsd.api import convert
from sitsd.api.inference import EngineRef
from sitsd.api.push_wire import UpdateRequest, WireChunk
from sitsd.api.v1 import admin_pb2
from sitsd.engine.errors import EngineStoppedError, InvalidRequestError
from sitsd.weights.errors import SwapRefusedError
from sitsd.weights.progress import SwapProgress
from sitsd.weights.push import PushHeader, UpdateReport, WeightPushes
from sitsd.weights.push_dist import GroupPush, GroupSpec, Placement
from sitsd.weights.push_ipc import IpcHandle, check_same_gpu
from sitsd.weights.push_plan import PushPlan, PushSource, TensorSpec
from sitsd.weights.push_stream import StreamedPush, TensorPiece

DEFAULT_GROUP_TIMEOUT_S = 600.0

Report = Awaitable[UpdateReport]


class PushRpcs:
    """The push RPCs of the Admin service (see the module docstring)."""

    def __init__(self, engines: EngineRef) -> None:
        self._engines = engines
        self._pushes_running: set[asyncio.Task[Any]] = set()

    async def update_weights(
        self,
        requests: AsyncIterator[UpdateRequest],
        context: grpc.aio.ServicerContext,
    ) -> admin_pb2.WeightUpdate:
        first = await anext(aiter(requests), None)  # bytes that do not parse: refused here
        pushes = self._pushes()
        if not isinstance(first, admin_pb2.UpdateWeightsRequest) or (
            first.WhichOneof("item") != "header"
        ):
            raise InvalidRequestError("header", "the first message of a push is its header")
        header, plan = header_of(first.header)
        source = StreamedPush(plan, _pieces(requests))
        task = self._start(pushes.push(header, source, "grpc", context.peer(), _no_progress))
        report = await asyncio.shield(task)  # the client going away ends its bytes, not this
        return weight_update(report)

    async def update_weights_ipc(
        self, request: admin_pb2.UpdateWeightsIpcRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PushEvent]:
        pushes = self._pushes()
        # Off the event loop, which streams every token: an 8B model's table is 291 tensors
        # of Python objects, milliseconds the streams would otherwise all wait for.
        header, source = await asyncio.to_thread(ipc_source, pushes, request)
        async for event in self._events(pushes, header, source, "ipc", context.peer()):
            yield event

    async def join_weight_group(
        self, request: admin_pb2.JoinWeightGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.JoinWeightGroupResponse:
        pushes = self._pushes()
        on_gpu = pushes.device.type == "cuda"
        spec = GroupSpec(
            master_address=request.master_address, master_port=request.master_port,
            world_size=request.world_size, rank=request.rank,
            backend=request.backend or ("nccl" if on_gpu else "gloo"),
            name=request.group_name or "default",
            timeout_s=request.timeout_s or DEFAULT_GROUP_TIMEOUT_S,
        )  # fmt: skip
        member = await pushes.join_group(spec)
        return admin_pb2.JoinWeightGroupResponse(
            backend=member.spec.backend, device=str(pushes.device)
        )

    async def update_weights_from_group(
        self, request: admin_pb2.UpdateWeightsFromGroupRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PushEvent]:
        pushes = self._pushes()
        if pushes.group is None:
            raise SwapRefusedError("no weight group joined: call JoinWeightGroup first")
        header, plan = header_of(request.header)
        placements = tuple(Placement(p.bucket, p.offset) for p in request.placements)
        source = GroupPush(plan, pushes.group, tuple(request.bucket_bytes), placements,
                           src_rank=request.src_rank)  # fmt: skip
        async for event in self._events(pushes, header, source, "dist", context.peer()):
            yield event

    # ------------------------------------------------------------------------------ helpers

    def _pushes(self) -> WeightPushes:
        pushes: WeightPushes | None = self._engines.pushes
        if pushes is None:
            raise EngineStoppedError("the model is still loading; retry when health is SERVING")
        return pushes

    def _start(self, push: Report) -> asyncio.Task[UpdateReport]:
        task = asyncio.ensure_future(push)
        self._pushes_running.add(task)
        task.add_done_callback(self._pushes_running.discard)
        return task

    async def _events(
        self,
        pushes: WeightPushes,
        header: PushHeader,
        source: PushSource,
        transport: str,
        peer: str,
    ) -> AsyncIterator[admin_pb2.PushEvent]:
        """Run a push, yielding its progress, then its report; its exception ends the stream."""
        updates: asyncio.Queue[SwapProgress] = asyncio.Queue()
        task = self._start(pushes.push(header, source, transport, peer, updates.put_nowait))
        while True:
            getter = asyncio.ensure_future(updates.get())
            await asyncio.wait((getter, task), return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield admin_pb2.PushEvent(progress=convert.swap_progress(getter.result()))
                continue
            getter.cancel()
            while not updates.empty():
                yield admin_pb2.PushEvent(progress=convert.swap_progress(updates.get_nowait()))
            yield admin_pb2.PushEvent(done=weight_update(task.result()))  # or its exception
            return


def _no_progress(progress: SwapProgress) -> None:
    """A client stream has no way back before its answer."""


async def _pieces(requests: AsyncIterator[UpdateRequest]) -> AsyncIterator[TensorPiece]:
    async for message in requests:
        if isinstance(message, WireChunk):  # read in place (`push_wire`)
            yield TensorPiece(message.name, message.data)
            continue
        if message.WhichOneof("item") != "chunk":
            raise InvalidRequestError("chunk", "only the first message of a push is a header")
        yield TensorPiece(message.chunk.name, message.chunk.data)


def header_of(message: admin_pb2.PushHeader) -> tuple[PushHeader, PushPlan]:
    """The push's own fields and its tensor table."""
    header = PushHeader(
        version=message.version,
        policy=convert.policy_from_proto(message.policy),
        commit=not message.stage_only,
        origin=message.origin,
    )
    specs = tuple(TensorSpec(t.name, t.dtype, tuple(t.shape)) for t in message.tensors)
    return header, PushPlan(specs, partial=message.partial)


def ipc_source(
    pushes: WeightPushes, request: admin_pb2.UpdateWeightsIpcRequest
) -> tuple[PushHeader, PushSource]:
    """An IPC push's header and source from its request (its GPU checked first).

    Raises:
        InvalidRequestError: the trainer's tensors are on another GPU.
    """
    check_same_gpu(pushes.device, request.device_uuid)
    header, plan = header_of(request.header)
    return header, pushes.ipc_push(plan, [ipc_handle(t) for t in request.tensors])


def ipc_handle(message: admin_pb2.IpcTensor) -> IpcHandle:
    return IpcHandle(
        name=message.name, stride=tuple(message.stride), storage_offset=message.storage_offset,
        storage_handle=message.storage_handle, storage_size_bytes=message.storage_size_bytes,
        storage_offset_bytes=message.storage_offset_bytes,
        ref_counter_handle=message.ref_counter_handle,
        ref_counter_offset=message.ref_counter_offset, event_handle=message.event_handle,
        event_sync_required=message.event_sync_required,
    )  # fmt: skip


def weight_update(report: UpdateReport) -> admin_pb2.WeightUpdate:
    """A push's report as the proto answers it."""
    stage = report.stage_s
    return admin_pb2.WeightUpdate(
        version=report.version, transport=report.transport, outcome=report.outcome,
        message=report.message, num_tensors=report.num_tensors, num_bytes=report.num_bytes,
        receive_s=stage.get("receive", 0.0), validate_s=stage.get("validate", 0.0),
        canary_s=stage.get("canary", 0.0), commit_s=stage.get("commit", 0.0),
        total_s=report.total_s, pause_ms=report.pause_s * 1e3, policy=report.policy,
        finished_at=report.finished_at,
    )  # fmt: skip


def push_status(pushes: WeightPushes) -> admin_pb2.WeightPushStatus:
    """`Admin.Status`'s view of live pushes."""
    status = admin_pb2.WeightPushStatus(
        device=str(pushes.device),
        device_uuid=pushes.device_uuid,
        weight_group=pushes.group.spec.name if pushes.group is not None else "",
    )
    if pushes.last is not None:
        status.last_update.CopyFrom(weight_update(pushes.last))
    return status
