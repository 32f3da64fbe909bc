"""The daemon's gRPC server: servicers, health, reflection (v1 and v1alpha: `sitsd.api.reflection`)
and interceptors on `grpc.aio`.

`ApiServer` goes through the daemon's life in steps the daemon drives:

    start()          bind host:port (port 0 = a free one); health NOT_SERVING, Admin answers
    attach_engine()  the model is warm: Inference takes requests, health SERVING
    drain()          shutdown begins: health NOT_SERVING, new Generate calls UNAVAILABLE
    stop(grace)      wait up to `grace` seconds for calls in flight, then close

Building and stopping the engine is the daemon's business (`sitsd.daemon`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio

from sitsd.api.admin import AdminServicer
from sitsd.api.inference import EngineLike, EngineRef, InferenceServicer
from sitsd.api.interceptors import (
    AdminAuthInterceptor,
    ErrorInterceptor,
    RequestDecodingInterceptor,
)
from sitsd.api.push_wire import MAX_MESSAGE_BYTES, update_weights_handler
from sitsd.api.reflection import enable_reflection
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from sitsd.config import ServerConfig

log = logging.getLogger(__name__)

INFERENCE_SERVICE = inference_pb2.DESCRIPTOR.services_by_name["Inference"].full_name
ADMIN_SERVICE = admin_pb2.DESCRIPTOR.services_by_name["Admin"].full_name
UPDATE_WEIGHTS = f"/{ADMIN_SERVICE}/UpdateWeights"
HEALTH_SERVICE = health_pb2.DESCRIPTOR.services_by_name["Health"].full_name
OVERALL_HEALTH = ""  # the health service name that stands for the whole server

_NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
_SERVING = health_pb2.HealthCheckResponse.SERVING
_REPORTED = (OVERALL_HEALTH, INFERENCE_SERVICE, ADMIN_SERVICE)  # what health reports on


class HealthServicer(health_aio.HealthServicer):
    """grpc's asyncio health servicer with `List`, which it leaves UNIMPLEMENTED although the
    service it registers (and reflection) lists it: every reported service with the status
    `Check` gives it."""

    async def List(
        self, request: health_pb2.HealthListRequest, context: grpc.aio.ServicerContext
    ) -> health_pb2.HealthListResponse:
        statuses = {}
        for service in _REPORTED:
            check = health_pb2.HealthCheckRequest(service=service)
            statuses[service] = await self.Check(check, context)
        return health_pb2.HealthListResponse(statuses=statuses)


class ApiServer:
    """The gRPC front end; create and drive it on the event loop that serves it."""

    def __init__(
        self,
        config: ServerConfig,
        *,
        admin_token: str,
        max_tokens_default: int,
        interceptors: Sequence[grpc.aio.ServerInterceptor] = (),
    ) -> None:
        """Args:
        config: host, port.
        admin_token: the bearer token Admin RPCs must present.
        max_tokens_default: completion length for requests that set no max_tokens.
        interceptors: run first, around everything else (telemetry: it must see every outcome).
        """
        self._config = config
        self.engines = EngineRef()
        self._health = HealthServicer()
        self._server = grpc.aio.server(
            # Auth runs first, so a refused Admin call never reaches the error mapping either.
            interceptors=[
                *interceptors,
                AdminAuthInterceptor(admin_token),
                RequestDecodingInterceptor(larger={UPDATE_WEIGHTS: MAX_MESSAGE_BYTES}),
                ErrorInterceptor(),
            ],
            # gRPC turns SO_REUSEPORT on by default: a second daemon on this port would then
            # bind too, and clients would be spread over both. Off, its bind fails. A pushed
            # chunk may be larger than gRPC's default 4 MiB (no other RPC's message may: the
            # decoding interceptor holds them to it).
            options=[
                ("grpc.so_reuseport", 0),
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        inference_pb2_grpc.add_InferenceServicer_to_server(
            InferenceServicer(self.engines, max_tokens_default=max_tokens_default), self._server
        )
        admin = AdminServicer(self.engines)
        admin_pb2_grpc.add_AdminServicer_to_server(admin, self._server)
        self._server.add_registered_method_handlers(
            ADMIN_SERVICE, {"UpdateWeights": update_weights_handler(admin.UpdateWeights)}
        )  # its chunks read in place, not parsed
        health_pb2_grpc.add_HealthServicer_to_server(self._health, self._server)
        enable_reflection((INFERENCE_SERVICE, ADMIN_SERVICE, HEALTH_SERVICE), self._server)
        self.port = 0

    async def start(self) -> int:
        """Bind and start serving; Inference is NOT_SERVING until `attach_engine`.

        Returns:
            The bound port (the one picked when the configured port is 0).

        Raises:
            RuntimeError: the address cannot be bound.
        """
        host = self._config.host
        address = f"[{host}]:{self._config.port}" if ":" in host else f"{host}:{self._config.port}"
        try:
            self.port = self._server.add_insecure_port(address)
        except RuntimeError:  # grpc raises a bare RuntimeError, its reason on stderr
            raise RuntimeError(
                f"cannot listen on {address}: the port is in use (another daemon?) or the "
                "address is not this host's; choose another --port or --host"
            ) from None
        for service in (OVERALL_HEALTH, INFERENCE_SERVICE):
            await self._health.set(service, _NOT_SERVING)
        await self._health.set(ADMIN_SERVICE, _SERVING)
        await self._server.start()
        shown_host = f"[{host}]" if ":" in host else host
        log.info("listening on %s:%d", shown_host, self.port)
        return self.port

    async def attach_engine(
        self, engine: EngineLike, swaps: object | None = None, pushes: object | None = None
    ) -> None:
        """Serve requests with `engine` (loaded and warm) and report SERVING; `swaps` (a
        `sitsd.weights.swap.SwapManager`) serves the Admin weight RPCs, `pushes` (a
        `sitsd.weights.push.WeightPushes`) the live pushes."""
        self.engines.attach(engine, swaps, pushes)
        for service in (OVERALL_HEALTH, INFERENCE_SERVICE):
            await self._health.set(service, _SERVING)

    async def drain(self) -> None:
        """Report NOT_SERVING everywhere and refuse new requests; calls in flight continue."""
        self.engines.drain()
        await self._health.enter_graceful_shutdown()

    async def stop(self, grace_s: float | None) -> None:
        """Stop the server; calls still in flight after `grace_s` seconds are cancelled."""
        await self._server.stop(grace_s)

    async def wait_for_termination(self) -> None:
        await self._server.wait_for_termination()
