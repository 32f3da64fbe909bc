"""The `sitsd.api.v1.Admin` servicer: daemon status, and weight versions (hot-swap).

Authentication is `interceptors.AdminAuthInterceptor`'s job: a call reaching this servicer is
authorized. The engine's counters come from `EngineStatus`; Deploy, Swap, Rollback and
ListVersions are the swap manager's (`sitsd.weights.swap.SwapManager`): this module streams its
progress as `SwapProgress` messages. A weight operation keeps running when its client goes
away (a half-done swap helps nobody); exceptions become statuses in `interceptors`. The live
pushes (UpdateWeights, UpdateWeightsIpc, JoinWeightGroup, UpdateWeightsFromGroup) are
`sitsd.api.push`'s, imported on the first one (it needs torch, which loading the model brings).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc.aio

import sitsd
from sitsd.api import convert
from sitsd.api.inference import EngineRef
from sitsd.api.push_wire import UpdateRequest
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc
from sitsd.engine.errors import EngineStoppedError, InvalidRequestError
from sitsd.weights.progress import ProgressSink, SwapProgress
from sitsd.weights.versions import VersionsView

if TYPE_CHECKING:
    from sitsd.api.push import PushRpcs


class SwapManagerLike(Protocol):
    """What the servicer needs of `sitsd.weights.swap.SwapManager`."""

    @property
    def busy(self) -> str: ...

    async def deploy(self, path: str, version: str, progress: ProgressSink) -> Any: ...

    async def swap(self, version: str, policy: str, progress: ProgressSink) -> Any: ...

    async def rollback(self, policy: str, progress: ProgressSink) -> Any: ...

    def versions(self) -> VersionsView: ...


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Serves `sitsd.api.v1.Admin`; Status answers while the model loads, too."""

    def __init__(self, engines: EngineRef) -> None:
        self._engines = engines
        self._operations: set[asyncio.Task[Any]] = set()  # running, whoever still listens
        self._push_rpcs: PushRpcs | None = None

    async def Status(
        self, request: admin_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatusResponse:
        engine = self._engines.engine
        response = convert.status_response(
            None if engine is None else engine.status(),
            state=self._engines.state,
            uptime_s=time.monotonic() - self._engines.started_at,
            version=sitsd.__version__,
        )
        if self._engines.pushes is not None:
            from sitsd.api.push import push_status

            response.weight_push.CopyFrom(push_status(self._engines.pushes))
        return response

    async def Deploy(
        self, request: admin_pb2.DeployRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.SwapProgress]:
        if not request.path:
            raise InvalidRequestError("path", "the version directory is required")
        swaps = self._swaps()
        async for message in self._stream(lambda p: swaps.deploy(request.path, request.version, p)):
            yield message

    async def Swap(
        self, request: admin_pb2.SwapRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.SwapProgress]:
        if not request.version:
            raise InvalidRequestError("version", "the version to swap to is required")
        swaps = self._swaps()
        policy = convert.policy_from_proto(request.policy)
        async for message in self._stream(lambda p: swaps.swap(request.version, policy, p)):
            yield message

    async def Rollback(
        self, request: admin_pb2.RollbackRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.SwapProgress]:
        swaps = self._swaps()
        policy = convert.policy_from_proto(request.policy)
        async for message in self._stream(lambda p: swaps.rollback(policy, p)):
            yield message

    async def ListVersions(
        self, request: admin_pb2.ListVersionsRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.ListVersionsResponse:
        swaps = self._swaps()
        view = swaps.versions()
        return admin_pb2.ListVersionsResponse(
            model=self._engines.get().model_info.name,
            versions=[
                convert.weight_version(v, view.slots.get(v.version, "")) for v in view.versions
            ],
            active_version=view.active,
            previous_version=view.previous,
            num_weight_slots=view.num_slots,
            operation_in_progress=swaps.busy,
        )

    async def UpdateWeights(
        self,
        request_iterator: AsyncIterator[UpdateRequest],  # `push_wire` reads them
        context: grpc.aio.ServicerContext,
    ) -> admin_pb2.WeightUpdate:
        return await self._pushes().update_weights(request_iterator, context)

    async def UpdateWeightsIpc(
        self, request: admin_pb2.UpdateWeightsIpcRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PushEvent]:
        async for event in self._pushes().update_weights_ipc(request, context):
            yield event

    async def JoinWeightGroup(
        self, request: admin_pb2.JoinWeightGroupRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.JoinWeightGroupResponse:
        return await self._pushes().join_weight_group(request, context)

    async def UpdateWeightsFromGroup(
        self, request: admin_pb2.UpdateWeightsFromGroupRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[admin_pb2.PushEvent]:
        async for event in self._pushes().update_weights_from_group(request, context):
            yield event

    # ------------------------------------------------------------------------------ helpers

    def _pushes(self) -> PushRpcs:
        if self._push_rpcs is None:
            from sitsd.api.push import PushRpcs

            self._push_rpcs = PushRpcs(self._engines)
        return self._push_rpcs

    def _swaps(self) -> SwapManagerLike:
        swaps = self._engines.swaps
        if swaps is None:
            raise EngineStoppedError("the model is still loading; retry when health is SERVING")
        return swaps

    async def _stream(
        self, run: Callable[[ProgressSink], Awaitable[Any]]
    ) -> AsyncIterator[admin_pb2.SwapProgress]:
        """Run a weight operation, yielding its progress; its exception ends the stream."""
        updates: asyncio.Queue[SwapProgress] = asyncio.Queue()
        task = asyncio.ensure_future(run(updates.put_nowait))
        self._operations.add(task)
        task.add_done_callback(self._operations.discard)
        while True:
            getter = asyncio.ensure_future(updates.get())
            await asyncio.wait((getter, task), return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                yield convert.swap_progress(getter.result())
                continue
            getter.cancel()
            while not updates.empty():
                yield convert.swap_progress(updates.get_nowait())
            task.result()  # its exception, if any, becomes the call's status
            return
