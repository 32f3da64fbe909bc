"""The server around the servicers: health, reflection, admin auth, loading and draining."""

from __future__ import annotations

import logging
import socket

import grpc
import pytest
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import (
    ProtoReflectionDescriptorDatabase,
)

from sitsd import __version__
from sitsd.api.server import ApiServer
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from sitsd.config import ServerConfig
from tests.api.fake_engine import FakeEngine
from tests.api.harness import ADMIN_TOKEN, ServerThread
from tests.api.test_inference import rpc_error, wait_for

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture
def fresh_server():
    """A server of its own: these tests change its life stage."""
    thread = ServerThread()
    yield thread
    thread.stop()


def health_of(channel: grpc.Channel, service: str) -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def bearer(token: str) -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {token}")]


def test_health_is_not_serving_until_the_engine_is_attached_then_serving(fresh_server):
    with grpc.insecure_channel(fresh_server.address) as channel:
        assert health_of(channel, "") == NOT_SERVING
        assert health_of(channel, "sitsd.api.v1.Inference") == NOT_SERVING

        fresh_server.attach(FakeEngine())

        assert health_of(channel, "") == SERVING
        assert health_of(channel, "sitsd.api.v1.Inference") == SERVING


def test_health_list_reports_every_service_as_check_does(fresh_server):
    """grpc's asyncio servicer answered List with UNIMPLEMENTED (found by the fuzz test)."""

    def listed(channel: grpc.Channel) -> dict[str, int]:
        reply = health_pb2_grpc.HealthStub(channel).List(health_pb2.HealthListRequest(), timeout=5)
        return {name: status.status for name, status in reply.statuses.items()}

    services = ("", "sitsd.api.v1.Inference", "sitsd.api.v1.Admin")
    with grpc.insecure_channel(fresh_server.address) as channel:
        assert listed(channel) == {s: health_of(channel, s) for s in services}
        assert listed(channel)["sitsd.api.v1.Inference"] == NOT_SERVING
        fresh_server.attach(FakeEngine())
        assert listed(channel) == dict.fromkeys(services, SERVING)


def test_requests_while_loading_are_unavailable_and_status_says_loading(fresh_server):
    with grpc.insecure_channel(fresh_server.address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        error = rpc_error(lambda: inference.Generate(inference_pb2.GenerateRequest(text="q")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "loading" in error.details()
        error = rpc_error(lambda: inference.ListModels(inference_pb2.ListModelsRequest()))
        assert error.code() == grpc.StatusCode.UNAVAILABLE

        status = admin_pb2_grpc.AdminStub(channel).Status(
            admin_pb2.StatusRequest(), metadata=bearer(ADMIN_TOKEN)
        )
        assert status.state == admin_pb2.DAEMON_STATE_LOADING
        assert status.version == __version__
        assert status.num_blocks_total == 0


def test_draining_refuses_new_requests_and_lets_in_flight_ones_finish(fresh_server):
    engine = fresh_server.attach(FakeEngine())
    engine.stall_after = 1
    with grpc.insecure_channel(fresh_server.address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        in_flight = inference.Generate(inference_pb2.GenerateRequest(text="q", request_id="busy"))
        assert next(in_flight).text == "H"

        fresh_server.call(fresh_server.server.drain())

        assert health_of(channel, "") == NOT_SERVING
        assert health_of(channel, "sitsd.api.v1.Inference") == NOT_SERVING
        error = rpc_error(lambda: inference.Generate(inference_pb2.GenerateRequest(text="q")))
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in error.details()
        status = admin_pb2_grpc.AdminStub(channel).Status(
            admin_pb2.StatusRequest(), metadata=bearer(ADMIN_TOKEN)
        )
        assert status.state == admin_pb2.DAEMON_STATE_DRAINING

        engine.release()  # the in-flight request may now run to its end
        fresh_server.call(engine.shutdown(grace_s=5))
        rest = list(in_flight)
        assert rest[-1].finish_reason == inference_pb2.FINISH_REASON_STOP
        assert "".join(r.text for r in rest) == engine.completion[1:]


def test_request_aborted_by_shutdown_is_unavailable(fresh_server):
    engine = fresh_server.attach(FakeEngine())
    engine.stall_after = 1
    with grpc.insecure_channel(fresh_server.address) as channel:
        inference = inference_pb2_grpc.InferenceStub(channel)
        in_flight = inference.Generate(inference_pb2.GenerateRequest(text="q"))
        next(in_flight)

        fresh_server.call(fresh_server.server.drain())
        fresh_server.call(engine.shutdown(grace_s=0))

        error = rpc_error(lambda: in_flight)
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "shutting down" in error.details()


def test_reflection_lists_the_sitsd_and_health_services(server, channel):
    services = ProtoReflectionDescriptorDatabase(channel).get_services()
    assert {"sitsd.api.v1.Inference", "sitsd.api.v1.Admin", "grpc.health.v1.Health"} <= set(
        services
    )


def test_reflection_serves_the_api_descriptors(server, channel):
    database = ProtoReflectionDescriptorDatabase(channel)
    proto = database.FindFileContainingSymbol("sitsd.api.v1.Inference")
    assert proto.name == "sitsd/api/v1/inference.proto"
    assert "Generate" in [m.name for m in proto.service[0].method]


def v1_reflection(channel: grpc.Channel, request: dict) -> object:
    """One request over `grpc.reflection.v1`, with message classes built from v1's descriptors
    (as a client generated from v1/reflection.proto would send them)."""
    pool = descriptor_pool.Default()
    request_class = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionRequest")
    )
    response_class = message_factory.GetMessageClass(
        pool.FindMessageTypeByName("grpc.reflection.v1.ServerReflectionResponse")
    )
    call = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=request_class.SerializeToString,
        response_deserializer=response_class.FromString,
    )
    (response,) = list(call(iter([request_class(**request)]), timeout=10))
    return response


def test_reflection_v1_lists_the_services(server, channel):
    response = v1_reflection(channel, {"list_services": ""})
    names = {s.name for s in response.list_services_response.service}
    assert {"sitsd.api.v1.Inference", "sitsd.api.v1.Admin", "grpc.health.v1.Health"} <= names
    assert {"grpc.reflection.v1.ServerReflection", "grpc.reflection.v1alpha.ServerReflection"} <= (
        names
    )


@pytest.mark.parametrize(
    ("symbol", "file_name"),
    [
        ("sitsd.api.v1.Inference", "sitsd/api/v1/inference.proto"),
        ("grpc.reflection.v1.ServerReflection", "grpc/reflection/v1/reflection.proto"),
    ],
)
def test_reflection_v1_serves_descriptors(server, channel, symbol, file_name):
    response = v1_reflection(channel, {"file_containing_symbol": symbol})
    files = [
        descriptor_pb2.FileDescriptorProto.FromString(raw)
        for raw in response.file_descriptor_response.file_descriptor_proto
    ]
    described = next(f for f in files if f.name == file_name)
    service = next(s for s in described.service if symbol.endswith(s.name))
    assert service.method, described


@pytest.mark.parametrize(
    ("metadata", "says"),
    [
        (None, "no admin token"),
        ([("x-other", "1")], "no admin token"),
        (bearer("wrong-token"), "the admin token is wrong"),
        (bearer(ADMIN_TOKEN + "x"), "the admin token is wrong"),
        ([("authorization", ADMIN_TOKEN)], "must be 'Bearer <admin token>'"),
        ([("authorization", f"Basic {ADMIN_TOKEN}")], "must be 'Bearer <admin token>'"),
    ],
    ids=["missing", "other metadata", "wrong", "longer", "no scheme", "basic"],
)
def test_admin_without_the_right_token_is_unauthenticated_says_why_and_does_nothing(
    engine, admin, metadata, says, caplog
):
    calls = []
    engine.status = lambda: calls.append(1)  # type: ignore[method-assign]
    caplog.set_level(logging.WARNING, logger="sitsd.api.interceptors")

    error = rpc_error(lambda: admin.Status(admin_pb2.StatusRequest(), metadata=metadata))

    assert error.code() == grpc.StatusCode.UNAUTHENTICATED
    assert says in error.details()
    assert calls == []
    # Neither the answer nor the log reveals the token.
    assert ADMIN_TOKEN not in error.details()
    assert any(says in m for m in caplog.messages)
    assert not any(ADMIN_TOKEN in m for m in caplog.messages)


def test_admin_status_with_the_token_reports_the_engine(engine, admin, inference):
    engine.stall_after = 3
    call = inference.Generate(inference_pb2.GenerateRequest(text="abcdef", request_id="live"))
    next(call)

    status = admin.Status(admin_pb2.StatusRequest(), metadata=bearer(ADMIN_TOKEN))

    assert status.state == admin_pb2.DAEMON_STATE_SERVING
    assert (status.model, status.weights_version) == ("fake-model", "fake-v1")
    assert status.num_running == 1
    assert status.num_blocks_used > 0
    assert (status.num_blocks_total, status.block_size) == (128, 4)
    assert (status.prefix_cache_queries, status.prefix_cache_hits) == (10, 4)
    assert status.num_steps == 7
    assert status.uptime_s > 0
    assert status.version == __version__
    call.cancel()
    wait_for(lambda: engine.status().num_blocks_used == 0)


def test_bearer_scheme_is_case_insensitive(engine, admin):
    metadata = [("authorization", f"bearer {ADMIN_TOKEN}")]
    assert admin.Status(admin_pb2.StatusRequest(), metadata=metadata).model == "fake-model"


def test_inference_and_health_need_no_token(engine, channel):
    inference = inference_pb2_grpc.InferenceStub(channel)
    assert inference.ListModels(inference_pb2.ListModelsRequest()).models
    assert health_of(channel, "") == SERVING


def test_start_logs_the_bound_port(caplog):
    caplog.set_level(logging.INFO, logger="sitsd.api.server")
    thread = ServerThread()
    try:
        assert thread.port > 0
        assert f"listening on 127.0.0.1:{thread.port}" in caplog.messages
    finally:
        thread.stop()


def test_a_second_server_on_a_daemons_port_fails_instead_of_sharing_it():
    # gRPC servers turn SO_REUSEPORT on by default: two of them would both bind the port and
    # the kernel would spread clients over both.
    first = ServerThread()
    try:

        async def start_second() -> None:
            other = ApiServer(
                ServerConfig(host="127.0.0.1", port=first.port), admin_token="t",
                max_tokens_default=8,
            )  # fmt: skip
            await other.start()

        with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{first.port}: "):
            first.call(start_second())
    finally:
        first.stop()


def test_start_on_a_port_in_use_fails_clearly():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        thread = ServerThread()
        try:

            async def start_second() -> None:
                other = ApiServer(
                    ServerConfig(host="127.0.0.1", port=port), admin_token="t", max_tokens_default=8
                )
                await other.start()

            with pytest.raises(RuntimeError, match=f"cannot listen on 127.0.0.1:{port}"):
                thread.call(start_second())
        finally:
            thread.stop()
