"""The HTTP API over a fake engine: routes, the OpenAI shapes the official client parses, every
error path with its status and error JSON, API keys, headers, and aborts on disconnect."""

from __future__ import annotations

import json
import os
import random
import time
from http.client import HTTPConnection

import openai
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from sitsd.types import EndReason, Tier
from tests.api.fake_engine import FakeEngine
from tests.api.late_proxy import LateStartProxy
from tests.api.test_inference import wait_for
from tests.api.test_telemetry import RecordingEngine
from tests.http.harness import HttpThread, request

API_KEY = "sk-test-key"


@pytest.fixture
def http():
    thread = HttpThread()
    thread.attach(FakeEngine(max_num_live_requests=16))
    yield thread
    thread.stop()


def client(thread: HttpThread, key: str = "unused") -> openai.OpenAI:
    return openai.OpenAI(base_url=thread.base_url + "/v1", api_key=key, max_retries=0)


def error_of(status_headers_body: tuple[int, dict, bytes]) -> tuple[int, dict]:
    status, _, body = status_headers_body
    payload = json.loads(body)
    assert set(payload) == {"error"}
    assert set(payload["error"]) == {"message", "type", "param", "code"}
    return status, payload["error"]


def chat_body(**fields) -> dict:
    return {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], **fields}


def sse_events(body: bytes) -> list[str]:
    return [line[len("data: ") :] for line in body.decode().split("\n\n") if line]


def test_models_lists_the_served_model(http):
    models = client(http).models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert models.data[0].object == "model"


def test_health_is_503_while_loading_200_when_warm_and_503_when_draining():
    thread = HttpThread()
    try:
        status, _headers, _ = request(thread.base_url, "/health")
        assert status == 503
        thread.attach(FakeEngine())
        assert request(thread.base_url, "/health")[0] == 200
        thread.engines.drain()
        assert request(thread.base_url, "/health")[0] == 503
    finally:
        thread.stop()


def test_requests_while_loading_are_503_with_retry_after():
    thread = HttpThread()
    try:
        answer = request(thread.base_url, "/v1/chat/completions", chat_body())
        status, error = error_of(answer)
        assert status == 503
        assert "loading" in error["message"]
        assert answer[1]["retry-after"] == "1"
    finally:
        thread.stop()


def test_chat_completion_returns_the_engine_text_and_usage(http):
    response = client(http).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}]
    )
    assert response.choices[0].message.content == "Hello, world!"
    assert response.choices[0].finish_reason == "stop"
    (record,) = http.engine.requests.values()
    assert response.usage.prompt_tokens == len(record.prompt_token_ids)
    assert response.usage.completion_tokens == len("Hello, world!")
    assert response.usage.total_tokens == response.usage.prompt_tokens + len("Hello, world!")


def test_completion_with_token_ids_and_echo_prepends_the_prompt_text(http):
    text = "".join(random.choice("abcdef") for _ in range(8))
    response = client(http).completions.create(
        model="fake-model", prompt=text, echo=True, max_tokens=5
    )
    assert response.choices[0].text == text + "Hello"
    assert response.choices[0].finish_reason == "length"
    ids = [ord(c) for c in text]
    response = client(http).completions.create(model="fake-model", prompt=ids, max_tokens=3)
    assert response.choices[0].text == "Hel"
    assert list(http.engine.requests.values())[-1].prompt_token_ids == ids


def test_streamed_chat_sends_the_role_first_finish_reason_last_then_usage_and_done(http):
    status, headers, body = request(
        http.base_url,
        "/v1/chat/completions",
        chat_body(stream=True, stream_options={"include_usage": True}),
    )
    assert status == 200
    assert headers["content-type"].startswith("text/event-stream")
    events = sse_events(body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    choice_chunks = [c for c in chunks if c["choices"]]
    reasons = [c["choices"][0]["finish_reason"] for c in choice_chunks]
    assert reasons[-1] == "stop"
    assert all(r is None for r in reasons[:-1])
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in choice_chunks)
    assert text == "Hello, world!"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"]["completion_tokens"] == 13
    assert all(c["usage"] is None for c in chunks[:-1])


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_every_choice_says_which_weights_version_computed_each_of_its_tokens(http, route, stream):
    switch_at, max_tokens = random.randrange(1, 9), random.randrange(9, 13)
    http.engine.version_switch = (switch_at, "fake-v2")  # a commit between two tokens
    fields = {"max_tokens": max_tokens, "stream": stream, "n": 2}
    body = chat_body(**fields) if "chat" in route else {"prompt": "q", **fields}
    status, _, raw = request(http.base_url, route, body)
    assert status == 200
    if stream:
        chunks = [json.loads(e) for e in sse_events(raw)[:-1]]
        choices = [c for chunk in chunks for c in chunk["choices"]]
    else:
        choices = json.loads(raw)["choices"]
    for index in (0, 1):
        runs = [
            (run["version"], run["num_tokens"])
            for c in choices
            if c["index"] == index
            for run in c["weights_versions"] or ()
        ]
        per_token = [version for version, n in runs for _ in range(n)]
        assert per_token == ["fake-v1"] * switch_at + ["fake-v2"] * (max_tokens - switch_at)


def test_the_official_client_parses_the_stream(http):
    stream = client(http).completions.create(
        model="fake-model", prompt="q", max_tokens=6, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "Hello,"
    assert chunks[-1].usage.completion_tokens == 6


def test_n_choices_are_separate_requests_with_consecutive_seeds(http):
    seed = random.randrange(1000)
    response = client(http).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], n=3, seed=seed
    )
    assert [c.index for c in response.choices] == [0, 1, 2]
    assert all(c.message.content == "Hello, world!" for c in response.choices)
    seeds = sorted(r.params.seed for r in http.engine.requests.values())
    assert seeds == [seed, seed + 1, seed + 2]
    assert response.usage.completion_tokens == 3 * 13
    assert response.usage.prompt_tokens == len(
        next(iter(http.engine.requests.values())).prompt_token_ids
    )


def test_sampling_fields_reach_the_engine(http):
    client(http).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], max_completion_tokens=7,
        temperature=0.5, top_p=0.9, stop=["x", "yz"], presence_penalty=0.5,
        frequency_penalty=-0.5, logit_bias={"65": 3.0}, logprobs=True, top_logprobs=4,
        extra_body={"top_k": 40, "min_p": 0.05, "repetition_penalty": 1.1, "ignore_eos": True},
    )  # fmt: skip
    (record,) = http.engine.requests.values()
    p = record.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (7, 0.5, 0.9, 40, 0.05)
    assert p.stop == ("x", "yz")
    assert p.ignore_eos
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.1)
    assert p.logit_bias == ((65, 3.0),)
    assert p.logprobs == 4


def test_tier_and_timeout_headers_reach_the_engine(http):
    before = time.monotonic()
    status, _, _ = request(
        http.base_url, "/v1/chat/completions", chat_body(),
        headers={"x-sitsd-tier": "gold", "x-sitsd-timeout-ms": "5000"},
    )  # fmt: skip
    assert status == 200
    (record,) = http.engine.requests.values()
    assert record.tier is Tier.GOLD
    assert before + 5.0 <= record.deadline <= time.monotonic() + 5.0
    request(http.base_url, "/v1/chat/completions", chat_body(tier="bronze"))
    assert list(http.engine.requests.values())[-1].tier is Tier.BRONZE


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -1}, "temperature"),  # the engine's own range check
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": "many"}, "max_tokens"),  # pydantic's type check, 422 -> 400
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"n": 0}, "n"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"100000": 1}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_bad_parameters_are_400_naming_the_field(http, fields, param):
    status, error = error_of(request(http.base_url, "/v1/chat/completions", chat_body(**fields)))
    assert status == 400
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"
    assert http.engine.requests == {}


def test_a_body_that_is_not_json_is_400(http):
    status, error = error_of(request(http.base_url, "/v1/completions", raw=b"{not json"))
    assert status == 400
    assert error["param"] == "body"


def test_unsupported_completion_fields_are_refused_by_name(http):
    for fields, param in (({"suffix": "x"}, "suffix"), ({"best_of": 3}, "best_of")):
        status, error = error_of(
            request(http.base_url, "/v1/completions", {"prompt": "q", **fields})
        )
        assert (status, error["param"]) == (400, param)


def test_an_unknown_model_is_404_and_an_unknown_route_too(http):
    status, error = error_of(
        request(http.base_url, "/v1/chat/completions", chat_body(model="gpt-9"))
    )
    assert (status, error["code"], error["param"]) == (404, "model_not_found", "model")
    status, error = error_of(request(http.base_url, "/v1/embeddings", {"input": "x"}))
    assert status == 404


def test_a_full_queue_is_429_with_retry_after(http):
    http.engine.refuse_with = "the gold tier's queue is full"
    answer = request(http.base_url, "/v1/chat/completions", chat_body(stream=True))
    status, error = error_of(answer)
    assert status == 429
    assert error["code"] == "rate_limit_exceeded"
    assert answer[1]["retry-after"] == "1"


def test_a_request_shed_in_the_queue_is_429_even_when_streamed(http):
    http.engine.shed_with = "waited 300 ms in the queue, over the silver tier's 250 ms"
    for stream in (False, True):
        status, error = error_of(
            request(http.base_url, "/v1/chat/completions", chat_body(stream=stream))
        )
        assert status == 429
        assert "queue" in error["message"]


def test_a_failure_mid_stream_is_an_error_event_the_client_raises(http):
    http.engine.fail_after = 3
    stream = client(http).chat.completions.create(
        model="fake-model", messages=[{"role": "user", "content": "hi"}], stream=True
    )
    with pytest.raises(openai.APIError, match="fake model step failed"):
        list(stream)


def test_api_keys_guard_v1_but_not_health():
    thread = HttpThread(api_keys=(API_KEY, "sk-other"))
    thread.attach(FakeEngine())
    try:
        status, error = error_of(request(thread.base_url, "/v1/models"))
        assert status == 401
        assert error["code"] == "invalid_api_key"
        assert error["message"].startswith("an API key is needed")
        headers = {"authorization": "Bearer sk-wrong"}
        status, error = error_of(request(thread.base_url, "/v1/models", headers=headers))
        assert status == 401
        assert error["message"].startswith("the API key is not valid")
        assert API_KEY not in error["message"]
        with pytest.raises(openai.AuthenticationError):
            client(thread, "sk-wrong").models.list()
        assert client(thread, API_KEY).models.list().data[0].id == "fake-model"
        assert (
            client(thread, "sk-other")
            .chat.completions.create(model="", messages=[{"role": "user", "content": "x"}])
            .choices
        )
        assert request(thread.base_url, "/health")[0] == 200
        assert request(thread.base_url, "/version")[0] == 200
    finally:
        thread.stop()


def test_a_client_that_disconnects_mid_stream_aborts_its_request(http):
    http.engine.stall_after = 2
    connection = HTTPConnection("127.0.0.1", http.port, timeout=30)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(chat_body(stream=True)),
        {"content-type": "application/json"},
    )  # fmt: skip
    response = connection.getresponse()
    assert response.status == 200
    assert b"data:" in response.read1(4096)
    connection.close()
    wait_for(lambda: len(http.engine.aborts) == 1)
    assert http.engine.status().num_blocks_used == 0


def test_a_client_that_disconnects_before_a_whole_answer_aborts_its_requests(http):
    http.engine.stall_after = 2
    connection = HTTPConnection("127.0.0.1", http.port, timeout=30)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(chat_body(n=2)),
        {"content-type": "application/json"},
    )  # fmt: skip
    wait_for(lambda: len(http.engine.requests) == 2)
    connection.close()
    wait_for(lambda: len(http.engine.aborts) == 2)
    assert http.engine.status().num_blocks_used == 0


def test_http_requests_are_counted_with_the_protocol_label(http):
    request(http.base_url, "/v1/chat/completions", chat_body())
    request(http.base_url, "/v1/chat/completions", chat_body(temperature=-1))
    labels = {"model": "fake-model", "tier": "silver", "method": "/v1/chat/completions"}
    registry = http.metrics.registry
    assert registry.get_sample_value("sitsd_requests_total", {**labels, "protocol": "http"}) == 2
    errors = {**labels, "protocol": "http", "error_class": "invalid_argument"}
    assert registry.get_sample_value("sitsd_request_errors_total", errors) == 1


def read_until(connection: HTTPConnection, deadline: float) -> None:
    """Read the whole response; TimeoutError at `deadline`, as a client with a timeout does."""

    def time_left() -> float:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the client's deadline passed")
        return left

    connection.sock.settimeout(time_left())
    response = connection.getresponse()
    while True:
        connection.sock.settimeout(time_left())
        if not response.read1(4096):
            return


def http_errors(thread: HttpThread, error_class: str) -> float:
    labels = {"model": "fake-model", "tier": "silver", "method": "/v1/chat/completions",
              "protocol": "http", "error_class": error_class}  # fmt: skip
    return thread.metrics.registry.get_sample_value("sitsd_request_errors_total", labels) or 0.0


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_times_out_at_its_deadline_counts_as_the_deadline_though_its_clock_led(
    http, stream
):
    # The client's timeout is its x-sitsd-timeout-ms, and its request reaches the server 0.2 s
    # late (a busy machine's latency): it leaves 0.2 s before the server's deadline passes.
    http.engine.stall_after = 1 if stream else 0
    with LateStartProxy(http.port, delay_s=0.2) as proxy:
        connection = HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        deadline = time.monotonic() + 1.5  # the client's clock starts before it sends
        connection.request(
            "POST", "/v1/chat/completions", json.dumps(chat_body(stream=stream)),
            {"content-type": "application/json", "x-sitsd-timeout-ms": "1500"},
        )  # fmt: skip
        with pytest.raises(TimeoutError):
            read_until(connection, deadline)  # the answer (or the stream's end) never comes
        connection.close()
        wait_for(lambda: http_errors(http, "deadline") + http_errors(http, "cancelled") == 1)
    assert http_errors(http, "deadline") == 1
    (cause,) = http.engine.abort_causes.values()
    assert cause is EndReason.DEADLINE


def test_a_client_that_leaves_well_before_its_deadline_counts_as_cancelled(http):
    http.engine.stall_after = 0
    connection = HTTPConnection("127.0.0.1", http.port, timeout=30)
    connection.request(
        "POST", "/v1/chat/completions", json.dumps(chat_body()),
        {"content-type": "application/json", "x-sitsd-timeout-ms": "60000"},
    )  # fmt: skip
    wait_for(lambda: len(http.engine.requests) == 1)
    connection.close()
    wait_for(lambda: http_errors(http, "cancelled") == 1)
    assert http_errors(http, "deadline") == 0
    (cause,) = http.engine.abort_causes.values()
    assert cause is EndReason.CANCELLED


def test_a_callers_traceparent_is_continued_into_the_span_the_engine_gets():
    spans = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(spans))
    thread = HttpThread(tracer=provider.get_tracer("test"))
    engine = thread.attach(RecordingEngine())
    try:
        trace_id, parent_id = os.urandom(16).hex(), os.urandom(8).hex()
        traceparent = {"traceparent": f"00-{trace_id}-{parent_id}-01"}
        status, _, _ = request(thread.base_url, "/v1/chat/completions", chat_body(), traceparent)
        assert status == 200
        wait_for(lambda: spans.get_finished_spans())
        (span,) = spans.get_finished_spans()
    finally:
        thread.stop()
    assert span.name == "POST /v1/chat/completions"
    assert span.kind is SpanKind.SERVER
    assert format(span.context.trace_id, "032x") == trace_id
    assert format(span.parent.span_id, "016x") == parent_id
    assert span.parent.is_remote
    assert span.attributes["http.response.status_code"] == 200
    (handed,) = engine.trace_contexts
    assert handed.get_span_context().span_id == span.context.span_id
