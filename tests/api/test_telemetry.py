"""The telemetry interceptor on a real gRPC server (fake engine): server spans, error classes."""

from __future__ import annotations

import io
import json
import logging
import os
import time
from collections.abc import Iterator

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from sitsd.api.server import ApiServer
from sitsd.api.telemetry import TelemetryInterceptor
from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2_grpc
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.config import ServerConfig
from sitsd.observability.logs import stdout_formatter
from sitsd.observability.metrics import Metrics
from sitsd.types import EndReason
from tests.api.fake_engine import FakeEngine
from tests.api.harness import ADMIN_TOKEN, MAX_TOKENS_DEFAULT, ServerThread
from tests.api.late_proxy import LateStartProxy

GENERATE = "Inference/Generate"
TIMEOUT = 10.0


class RecordingEngine(FakeEngine):
    """Remembers the trace context each request was handed."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.trace_contexts: list[object] = []

    def add_request(self, prompt_token_ids, params, **kwargs):
        self.trace_contexts.append(kwargs.get("trace_context"))
        return super().add_request(prompt_token_ids, params, **kwargs)


class TelemetryServer(ServerThread):
    """`ServerThread` whose server runs the telemetry interceptor."""

    def __init__(self, interceptor: TelemetryInterceptor) -> None:
        self.interceptor = interceptor
        super().__init__()

    async def _make_server(self, admin_token: str) -> ApiServer:  # type: ignore[override]
        return ApiServer(
            ServerConfig(host="127.0.0.1", port=0),
            admin_token=admin_token,
            max_tokens_default=MAX_TOKENS_DEFAULT,
            interceptors=[self.interceptor],
        )


class Rig:
    def __init__(self) -> None:
        self.spans = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(self.spans))
        self.metrics = Metrics("fake-model")
        self.server = TelemetryServer(TelemetryInterceptor(self.metrics, provider.get_tracer("t")))
        self.channel = grpc.insecure_channel(self.server.address)
        self.inference = inference_pb2_grpc.InferenceStub(self.channel)
        self.log = io.StringIO()
        self.handler = logging.StreamHandler(self.log)
        self.handler.setFormatter(stdout_formatter("json"))
        logger = logging.getLogger("sitsd.rpc")
        self._level = logger.level
        logger.setLevel(logging.INFO)
        logger.addHandler(self.handler)

    def close(self) -> None:
        logger = logging.getLogger("sitsd.rpc")
        logger.removeHandler(self.handler)
        logger.setLevel(self._level)
        self.channel.close()
        self.server.stop()

    def errors(self, error_class: str, method: str = GENERATE, tier: str = "silver") -> float:
        labels = {
            "model": "fake-model",
            "tier": tier,
            "method": method,
            "protocol": "grpc",
            "error_class": error_class,
        }
        return self.metrics.registry.get_sample_value("sitsd_request_errors_total", labels) or 0.0

    def server_spans(self, name: str = "sitsd.api.v1.Inference/Generate") -> list:
        return [s for s in self.spans.get_finished_spans() if s.name == name]

    def log_lines(self) -> list[dict]:
        complete = self.log.getvalue().split("\n")[:-1]  # a line being written is not done
        return [json.loads(line) for line in complete]


@pytest.fixture
def rig() -> Iterator[Rig]:
    rig = Rig()
    yield rig
    rig.close()


def attach(rig: Rig, **kwargs) -> RecordingEngine:
    return rig.server.attach(RecordingEngine(**kwargs))


def wait_for(predicate, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.01)


def test_caller_traceparent_is_continued_and_handed_to_the_engine(rig):
    engine = attach(rig)
    trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
    metadata = [("traceparent", f"00-{trace_id}-{parent_id}-01")]
    request = pb.GenerateRequest(text="hi", tier=pb.TIER_GOLD)
    responses = list(rig.inference.Generate(request, metadata=metadata, timeout=TIMEOUT))
    assert responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED
    wait_for(lambda: rig.server_spans())
    (span,) = rig.server_spans()
    assert format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent_id
    assert span.parent.is_remote
    assert span.kind is SpanKind.SERVER
    assert span.attributes["rpc.system"] == "grpc"
    assert span.attributes["rpc.method"] == "Generate"
    assert span.attributes["gen_ai.operation.name"] == "text_completion"
    assert span.attributes["rpc.grpc.status_code"] == 0
    (handed,) = engine.trace_contexts
    assert handed.get_span_context().span_id == span.context.span_id
    labels = {"model": "fake-model", "tier": "gold", "method": GENERATE, "protocol": "grpc"}
    assert rig.metrics.registry.get_sample_value("sitsd_requests_total", labels) == 1


def test_a_call_without_traceparent_starts_a_new_trace_and_chat_is_named_chat(rig):
    attach(rig)
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hello")])
    list(rig.inference.Generate(pb.GenerateRequest(chat=chat), timeout=TIMEOUT))
    wait_for(lambda: rig.server_spans())
    (span,) = rig.server_spans()
    assert span.parent is None
    assert span.attributes["gen_ai.operation.name"] == "chat"


def generate(rig: Rig, **fields):
    return list(rig.inference.Generate(pb.GenerateRequest(**fields), timeout=TIMEOUT))


FAILURES = {
    "invalid_argument": (dict(), lambda rig: generate(rig, text="")),
    "not_found": (dict(), lambda rig: generate(rig, text="hi", model="no-such-model")),
    "resource_exhausted": (
        dict(max_num_live_requests=0),
        lambda rig: generate(rig, text="hi"),
    ),
    "internal": (
        dict(),
        lambda rig: (setattr(rig.server.engine, "fail_after", 1), generate(rig, text="hi")),
    ),
}


@pytest.mark.parametrize("error_class", FAILURES)
def test_each_failed_generate_is_counted_and_logged_with_its_class_and_trace(rig, error_class):
    engine_kwargs, call = FAILURES[error_class]
    attach(rig, **engine_kwargs)
    with pytest.raises(grpc.RpcError):
        call(rig)
    wait_for(lambda: rig.errors(error_class) == 1)
    wait_for(lambda: rig.server_spans())
    (span,) = rig.server_spans()
    assert span.attributes["error.type"] == error_class
    expect_error_status = error_class in ("resource_exhausted", "internal")
    assert (span.status.status_code is StatusCode.ERROR) == expect_error_status
    wait_for(lambda: [x for x in rig.log_lines() if x.get("error_class") == error_class])
    (line,) = [x for x in rig.log_lines() if x.get("error_class") == error_class]
    assert line["event"] == "rpc failed"
    assert line["rpc_method"] == GENERATE
    assert line["trace_id"] == format(span.context.trace_id, "032x")
    assert line["span_id"] == format(span.context.span_id, "016x")
    assert line["level"] == ("warning" if expect_error_status else "info")


def test_a_cancelled_stream_is_classed_cancelled(rig):
    engine = attach(rig)
    engine.stall_after = 1
    call = rig.inference.Generate(pb.GenerateRequest(text="hi"), timeout=TIMEOUT)
    next(call)
    call.cancel()
    wait_for(lambda: rig.errors("cancelled") == 1)
    assert rig.errors("deadline") == 0


def test_a_passed_deadline_is_classed_deadline(rig):
    engine = attach(rig)
    engine.stall_after = 1
    with pytest.raises(grpc.RpcError) as info:
        list(rig.inference.Generate(pb.GenerateRequest(text="hi"), timeout=0.5))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: rig.errors("deadline") == 1)
    assert rig.errors("cancelled") == 0


@pytest.mark.parametrize("timeout_s", [1.0, 2.0])
def test_a_client_that_gives_up_at_its_deadline_is_classed_deadline_though_its_clock_led(
    rig, timeout_s
):
    # The call reaches the server 0.2 s after the client started its deadline's clock, so the
    # client cancels 0.2 s before the server's deadline passes (a busy machine's latency).
    engine = attach(rig)
    engine.stall_after = 1
    proxy = LateStartProxy(rig.server.port, delay_s=0.2)
    with proxy, grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        with pytest.raises(grpc.RpcError) as info:
            list(stub.Generate(pb.GenerateRequest(text="hi"), timeout=timeout_s))
    assert info.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: rig.errors("deadline") + rig.errors("cancelled") == 1)
    assert rig.errors("deadline") == 1
    (cause,) = engine.abort_causes.values()
    assert cause is EndReason.DEADLINE  # the engine hears the same
    wait_for(lambda: rig.server_spans())
    (span,) = rig.server_spans()
    assert span.attributes["sitsd.finish_reason"] == "deadline"


def test_a_client_that_cancels_well_before_its_deadline_stays_cancelled(rig):
    engine = attach(rig)
    engine.stall_after = 1
    proxy = LateStartProxy(rig.server.port, delay_s=0.2)
    with proxy, grpc.insecure_channel(f"127.0.0.1:{proxy.port}") as channel:
        stub = inference_pb2_grpc.InferenceStub(channel)
        call = stub.Generate(pb.GenerateRequest(text="hi"), timeout=60)
        next(call)
        call.cancel()
        wait_for(lambda: rig.errors("cancelled") == 1)
    assert rig.errors("deadline") == 0
    (cause,) = engine.abort_causes.values()
    assert cause is EndReason.CANCELLED
    wait_for(lambda: rig.server_spans())
    (span,) = rig.server_spans()
    assert span.attributes["sitsd.finish_reason"] == "cancelled"


def test_the_server_span_names_the_tier_and_request_id_even_when_the_engine_refuses(rig):
    engine = attach(rig)
    engine.refuse_with = "overloaded: the test says so"
    request_id = f"client-{os.urandom(4).hex()}"
    with pytest.raises(grpc.RpcError):
        generate(rig, text="hi", tier=pb.TIER_BRONZE, request_id=request_id)
    wait_for(lambda: rig.server_spans())
    (span,) = rig.server_spans()
    assert span.attributes["sitsd.tier"] == "bronze"
    assert span.attributes["sitsd.request_id"] == request_id
    wait_for(lambda: [x for x in rig.log_lines() if x.get("request_id") == request_id])
    (line,) = [x for x in rig.log_lines() if x.get("request_id") == request_id]
    assert line["error_class"] == "resource_exhausted"


def test_a_refused_admin_call_is_classed_unauthenticated(rig):
    attach(rig)
    admin = admin_pb2_grpc.AdminStub(rig.channel)
    with pytest.raises(grpc.RpcError):
        admin.Status(admin_pb2.StatusRequest(), timeout=TIMEOUT)
    wait_for(lambda: rig.errors("unauthenticated", method="Admin/Status", tier="") == 1)
    ok = [("authorization", f"Bearer {ADMIN_TOKEN}")]
    admin.Status(admin_pb2.StatusRequest(), metadata=ok, timeout=TIMEOUT)
    labels = {"model": "fake-model", "tier": "", "method": "Admin/Status", "protocol": "grpc"}
    wait_for(lambda: rig.metrics.registry.get_sample_value("sitsd_requests_total", labels) == 2)


def test_a_draining_server_is_classed_unavailable(rig):
    attach(rig)
    rig.server.call(rig.server.server.drain())
    with pytest.raises(grpc.RpcError) as info:
        generate(rig, text="hi")
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: rig.errors("unavailable") == 1)
