"""Request bytes that do not parse are INVALID_ARGUMENT on every RPC, logged once, at a bounded
rate.

grpc answers UNKNOWN ("Unexpected <class 'DecodeError'>") and logs an error-level traceback for
each such call, which lets any client flood the log; sitsd's decoding interceptor refuses them
before any servicer runs. Every method of every service the daemon serves is tried, with the
token Admin needs (without it, auth refuses first: UNAUTHENTICATED).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf.descriptor import FieldDescriptor, MethodDescriptor
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from sitsd.api.v1 import admin_pb2, inference_pb2
from sitsd.api.v1 import inference_pb2 as pb
from tests.api.harness import ADMIN_TOKEN
from tests.api.test_telemetry import GENERATE, Rig, attach, wait_for

METHODS: list[MethodDescriptor] = [
    method
    for file in (inference_pb2, admin_pb2, health_pb2, reflection_pb2)
    for service in file.DESCRIPTOR.services_by_name.values()
    for method in service.methods
]
AUTH = [("authorization", f"Bearer {ADMIN_TOKEN}")]


def path_of(method: MethodDescriptor, service: str | None = None) -> str:
    return f"/{service or method.containing_service.full_name}/{method.name}"


def string_field(method: MethodDescriptor) -> FieldDescriptor | None:
    fields = method.input_type.fields
    return next((f for f in fields if f.type == FieldDescriptor.TYPE_STRING), None)


def key(number: int, wire_type: int) -> bytes:
    value, out = (number << 3) | wire_type, b""
    while value > 0x7F:
        out += bytes([value & 0x7F | 0x80])
        value >>= 7
    return out + bytes([value])


def malformed_payloads(method: MethodDescriptor) -> dict[str, bytes]:
    """Bytes no parser may accept as the method's request, by class of defect."""
    payloads = {
        "garbage": b"\xff" * 4 + os.urandom(8),
        "truncated": key(1, 2) + bytes([50]) + b"abc",  # a 50-byte field with 3 bytes
        # Unknown groups nested past the parser's depth limit (100).
        "nested": key(19, 3) * 200 + key(19, 4) * 200,
    }
    field = string_field(method)
    if field is not None:
        payloads["bad_utf8"] = key(field.number, 2) + b"\x02\xff\xfe"
    return payloads


def call(channel: grpc.Channel, method: MethodDescriptor, payload: bytes, path: str) -> None:
    """One raw call (no serializer: the bytes go as they are), read to its end."""
    if method.client_streaming and method.server_streaming:
        list(channel.stream_stream(path)(iter([payload]), metadata=AUTH, timeout=10))
    elif method.client_streaming:
        channel.stream_unary(path)(iter([payload]), metadata=AUTH, timeout=10)
    elif method.server_streaming:
        stream = channel.unary_stream(path)(payload, metadata=AUTH, timeout=10)
        # Health.Watch answers, then streams on: its first answer (or the error) is enough.
        next(iter(stream))
        stream.cancel()
    else:
        channel.unary_unary(path)(payload, metadata=AUTH, timeout=10)


CASES = [
    pytest.param(m, kind, path, id=f"{path.strip('/')}-{kind}")
    for m in METHODS
    for path in (
        [path_of(m), path_of(m, "grpc.reflection.v1.ServerReflection")]
        if m.containing_service.full_name.startswith("grpc.reflection")
        else [path_of(m)]
    )
    for kind in malformed_payloads(m)
]


@pytest.mark.parametrize(("method", "kind", "path"), CASES)
def test_malformed_request_bytes_are_invalid_argument_with_no_traceback(
    engine, channel, caplog, method, kind, path
):
    caplog.set_level(logging.INFO)
    with pytest.raises(grpc.RpcError) as raised:
        call(channel, method, malformed_payloads(method)[kind], path)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT, raised.value.details()
    assert raised.value.details().startswith("request: the message does not parse")
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert not engine.requests


def test_the_reproduction_bytes_give_invalid_argument_for_generate_and_tokenize(engine, channel):
    generate = channel.unary_stream("/sitsd.api.v1.Inference/Generate")
    tokenize = channel.unary_unary("/sitsd.api.v1.Inference/Tokenize")
    for rpc in (lambda data: list(generate(data, timeout=10)), lambda data: tokenize(data)):
        with pytest.raises(grpc.RpcError) as raised:
            rpc(bytes.fromhex("1202fffe"))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "bad UTF-8" in raised.value.details()


def test_a_well_formed_request_still_reaches_the_servicer(engine, channel):
    request = pb.TokenizeRequest(text="hello").SerializeToString()
    raw = channel.unary_unary("/sitsd.api.v1.Inference/Tokenize")(request, timeout=10)
    assert pb.TokenizeResponse.FromString(raw).num_tokens == len("hello") + 1  # BOS


@pytest.fixture
def rig() -> Iterator[Rig]:
    """A server with the telemetry interceptor, which writes each failed RPC's log line."""
    rig = Rig()
    yield rig
    rig.close()


def test_a_flood_of_malformed_requests_is_logged_once_each_up_to_a_bounded_rate(rig):
    attach(rig)
    generate = rig.channel.unary_stream("/sitsd.api.v1.Inference/Generate")
    num_calls = 40
    for _ in range(num_calls):
        with pytest.raises(grpc.RpcError) as raised:
            list(generate(bytes.fromhex("1202fffe") + os.urandom(2), timeout=10))
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    wait_for(lambda: rig.errors("invalid_argument", tier="") == num_calls)
    failed = [x for x in rig.log_lines() if x["event"] == "rpc failed"]
    assert 1 <= len(failed) <= 5  # every call is counted, few are written
    assert all(x["rpc_method"] == GENERATE for x in failed)
    assert all(x["grpc_message"].startswith("request: the message does not parse") for x in failed)
