"""Fixtures: one in-process server per module, a fresh fake engine per test, client stubs."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import pytest

from sitsd.api.v1 import admin_pb2_grpc, inference_pb2_grpc
from tests.api.fake_engine import FakeEngine
from tests.api.harness import ServerThread


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    thread = ServerThread()
    yield thread
    thread.stop()


@pytest.fixture
def engine(server: ServerThread) -> FakeEngine:
    return server.attach(FakeEngine())


@pytest.fixture
def channel(server: ServerThread) -> Iterator[grpc.Channel]:
    with grpc.insecure_channel(server.address) as chan:
        yield chan


@pytest.fixture
def inference(channel: grpc.Channel) -> inference_pb2_grpc.InferenceStub:
    return inference_pb2_grpc.InferenceStub(channel)


@pytest.fixture
def admin(channel: grpc.Channel) -> admin_pb2_grpc.AdminStub:
    return admin_pb2_grpc.AdminStub(channel)
