"""The `sitsd.api.v1.Admin` servicer: daemon and engine status (later: weight deployment).

Authentication is `interceptors.AdminAuthInterceptor`'s job: a call reaching this servicer is
authorized. The engine's counters come from `EngineStatus`; this module only adds the daemon's
own state (loading, serving, draining), uptime and version.
"""

from __future__ import annotations

import time

import grpc.aio

import sitsd
from sitsd.api import convert
from sitsd.api.inference import EngineRef
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc


class AdminServicer(admin_pb2_grpc.AdminServicer):
    """Serves `sitsd.api.v1.Admin`; answers while the model loads, too."""

    def __init__(self, engines: EngineRef) -> None:
        self._engines = engines

    async def Status(
        self, request: admin_pb2.StatusRequest, context: grpc.aio.ServicerContext
    ) -> admin_pb2.StatusResponse:
        engine = self._engines.engine
        return convert.status_response(
            None if engine is None else engine.status(),
            state=self._engines.state,
            uptime_s=time.monotonic() - self._engines.started_at,
            version=sitsd.__version__,
        )
