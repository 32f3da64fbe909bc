"""The OpenAI-compatible API of the real daemon (SmolLM2 on the CPU), through the official
`openai` client, sync and async, streamed and not, checked against the tokenizer, the model's
own log-softmax (transformers on the same weights), gRPC, and JSON schemas."""

from __future__ import annotations

import asyncio
import json
import random
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection
from urllib.parse import urlparse

import grpc
import jsonschema
import openai
import pytest
import torch

from sitsd.api.v1 import admin_pb2, admin_pb2_grpc, inference_pb2, inference_pb2_grpc
from tests.e2e.daemon_process import DaemonProcess, serving

pytestmark = pytest.mark.slow

MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Lyon", "Nice"]},
    },
    "required": ["name", "age", "city"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    # Dequantized: the weights transformers computes with (it reads the GGUF dequantized).
    flags = ("--scheduling-policy", "fcfs", "--kv-cache-memory", "256MiB", "--dequantize")
    with serving(tmp_path_factory.mktemp("state"), *flags) as process:
        yield process


@pytest.fixture(scope="module")
def client(daemon) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.http_url, api_key="none", max_retries=0, timeout=300)


def status_of(daemon: DaemonProcess) -> admin_pb2.StatusResponse:
    with grpc.insecure_channel(daemon.address) as channel:
        return admin_pb2_grpc.AdminStub(channel).Status(
            admin_pb2.StatusRequest(),
            metadata=[("authorization", f"Bearer {daemon.admin_token()}")],
            timeout=10,
        )


def metrics_url(daemon: DaemonProcess) -> str:
    match = re.search(r"metrics on http://\S+:(\d+)/metrics", daemon.log)
    assert match, daemon.log
    return f"http://127.0.0.1:{match.group(1)}"


def http_requests_by_tier(daemon: DaemonProcess, route: str) -> dict[str, float]:
    """`sitsd_requests_total{protocol="http", method=route}` per tier, from the live scrape."""
    with urllib.request.urlopen(metrics_url(daemon) + "/metrics", timeout=30) as r:
        text = r.read().decode()
    counts: dict[str, float] = {}
    for labels, value in re.findall(r"^sitsd_requests_total\{(.*)\} (\S+)$", text, re.M):
        fields = dict(re.findall(r'(\w+)="([^"]*)"', labels))
        if fields["protocol"] == "http" and fields["method"] == route:
            counts[fields["tier"]] = float(value)
    return counts


def wait_for(predicate, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_sync_async_streamed_and_whole_answers_are_the_same_greedy_text(daemon, client):
    whole = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=16, temperature=0
    )
    streamed = client.chat.completions.create(
        model="", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
    )
    chunks = list(streamed)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    reasons = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert reasons[-1] == whole.choices[0].finish_reason

    async def async_texts() -> tuple[str, str]:
        async_client = openai.AsyncOpenAI(base_url=daemon.http_url, api_key="none")
        answer = await async_client.chat.completions.create(
            model="", messages=MESSAGES, max_tokens=16, temperature=0
        )
        stream = await async_client.chat.completions.create(
            model="", messages=MESSAGES, max_tokens=16, temperature=0, stream=True
        )
        pieces = [c.choices[0].delta.content or "" async for c in stream if c.choices]
        await async_client.close()
        return answer.choices[0].message.content, "".join(pieces)

    assert asyncio.run(async_texts()) == (text, text)


def test_greedy_text_over_http_equals_greedy_text_over_grpc(daemon, client):
    prompt = random.choice(["Once upon a time", "The three primary colors are", "def fib(n):"])
    http_text = (
        client.completions.create(model="", prompt=prompt, max_tokens=24, temperature=0)
        .choices[0]
        .text
    )
    with grpc.insecure_channel(daemon.address) as channel:
        responses = inference_pb2_grpc.InferenceStub(channel).Generate(
            inference_pb2.GenerateRequest(
                text=prompt, sampling=inference_pb2.SamplingParams(max_tokens=24, temperature=0)
            ),
            timeout=300,
        )
        grpc_text = "".join(r.text for r in responses)
    assert http_text == grpc_text


def test_usage_counts_equal_the_tokenizers(client, smollm2_hf_tokenizer):
    prompt = "Tell me about " + random.choice(["cats", "the sea", "prime numbers"])
    answer = client.completions.create(
        model="", prompt=prompt, max_tokens=12, temperature=0, logprobs=1,
        stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(answer)
    usage = chunks[-1].usage
    assert chunks[-1].choices == []
    expected_prompt = smollm2_hf_tokenizer(prompt)["input_ids"]
    assert usage.prompt_tokens == len(expected_prompt)
    tokens = [
        t
        for c in chunks
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.tokens
    ]
    assert usage.completion_tokens == len(tokens) == 12
    chat = client.chat.completions.create(model="", messages=MESSAGES, max_tokens=4)
    rendered = smollm2_hf_tokenizer.apply_chat_template(
        MESSAGES, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert chat.usage.prompt_tokens == len(rendered)


def test_logprobs_equal_the_models_log_softmax_at_the_chosen_tokens(
    client, smollm2_hf_model, smollm2_hf_tokenizer
):
    prompt = random.choice(["The weather today is", "My favourite food is"])
    answer = client.completions.create(
        model="", prompt=prompt, max_tokens=6, temperature=0, logprobs=5
    )
    logprobs = answer.choices[0].logprobs
    ids = smollm2_hf_tokenizer(prompt, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for position in range(6):  # transformers' greedy path, the same as ours
            reference = torch.log_softmax(smollm2_hf_model(ids).logits[0, -1].float(), -1)
            chosen = int(reference.argmax())
            expected = reference[chosen].item()
            assert logprobs.token_logprobs[position] == pytest.approx(expected, abs=2e-3)
            assert logprobs.tokens[position] == smollm2_hf_tokenizer.decode([chosen])
            top = torch.topk(reference, 5)
            ours = logprobs.top_logprobs[position]
            assert len(ours) == 5
            for token_id, value in zip(top.indices.tolist(), top.values.tolist()):
                text = smollm2_hf_tokenizer.decode([token_id])
                if text in ours:  # two ids may decode to one text
                    assert ours[text] == pytest.approx(value, abs=2e-3)
            ids = torch.cat([ids, torch.tensor([[chosen]])], dim=1)


def test_a_seed_gives_the_same_sampled_text_twice(client):
    seed = random.randrange(2**31)
    texts = [
        client.completions.create(
            model="", prompt="A short poem:", max_tokens=16, temperature=1.0, seed=seed
        )
        .choices[0]
        .text
        for _ in range(2)
    ]
    assert texts[0] == texts[1]


def test_n3_choices_share_the_prompts_cached_blocks(daemon, client):
    # A fresh prompt of several blocks: the hits can only come from the first choice.
    words = " ".join(random.choice(["red", "blue", "green", "tea", "sky"]) for _ in range(60))
    before = status_of(daemon).prefix_cache_hits
    answer = client.completions.create(
        model="", prompt=words, max_tokens=4, temperature=1.0, n=3, seed=1
    )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    block_size = status_of(daemon).block_size
    full_blocks = (answer.usage.prompt_tokens - 1) // block_size
    assert status_of(daemon).prefix_cache_hits - before >= 2 * full_blocks * block_size
    assert 3 <= answer.usage.completion_tokens <= 3 * 4


def test_stop_strings_cut_the_text_before_them(client):
    greedy = (
        client.completions.create(model="", prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    stop = greedy.split(",")[2].strip()  # a number in the middle of the greedy text
    answer = client.completions.create(
        model="", prompt="Count: 1, 2, 3,", max_tokens=16, temperature=0, stop=[stop, "zzz"]
    )
    assert answer.choices[0].text == greedy[: greedy.index(stop)]
    assert answer.choices[0].finish_reason == "stop"


@pytest.mark.timeout(1800)  # 100 sampled completions on a shared 2-core machine
def test_json_schema_output_always_parses_and_validates(client):
    answer = client.with_options(timeout=1800).chat.completions.create(
        model="", messages=[{"role": "user", "content": "Describe a person as JSON."}],
        temperature=1.0, max_tokens=80, n=100, seed=random.randrange(2**31),
        response_format={"type": "json_schema",
                         "json_schema": {"name": "person", "schema": PERSON}},
    )  # fmt: skip
    assert len(answer.choices) == 100
    for choice in answer.choices:
        assert choice.finish_reason == "stop", choice.message.content
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_tool_messages_render_as_transformers_renders_them(client, smollm2_hf_tokenizer):
    call = {"id": "call_1", "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    messages = [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    ]
    answer = client.chat.completions.create(model="", messages=messages, max_tokens=2)
    # Templates take tool call arguments as data (transformers' documented form).
    as_data = json.loads(json.dumps(messages))
    as_data[2]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris"}
    rendered = smollm2_hf_tokenizer.apply_chat_template(
        as_data, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert answer.usage.prompt_tokens == len(rendered)


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"temperature": -1}, 400, "temperature"),
        ({"model": "gpt-9"}, 404, "model"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            400,
            "response_format",
        ),
        ({"max_tokens": 10**6}, 400, "max_tokens"),
    ],
)
def test_bad_requests_get_their_status_and_error_json(daemon, body, status, param):
    data = json.dumps({"model": "", "messages": MESSAGES, **body}).encode()
    req = urllib.request.Request(
        daemon.http_url + "/chat/completions",
        data=data,
        headers={"content-type": "application/json"},
    )
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(req, timeout=60)
    error = json.loads(raised.value.read())["error"]
    assert (raised.value.code, error["param"]) == (status, param)


def test_a_passed_deadline_is_504_and_frees_the_blocks(daemon):
    data = json.dumps({"model": "", "prompt": "Count to a thousand:", "max_tokens": 1000,
                       "ignore_eos": True}).encode()  # fmt: skip
    req = urllib.request.Request(
        daemon.http_url + "/completions", data=data,
        headers={"content-type": "application/json", "x-sitsd-timeout-ms": "1500"},
    )  # fmt: skip
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(req, timeout=120)
    assert raised.value.code == 504
    wait_for(lambda: status_of(daemon).num_blocks_used == 0)


def test_a_client_that_disconnects_mid_stream_frees_every_block(daemon):
    url = urlparse(daemon.http_url)
    connection = HTTPConnection(url.hostname, url.port, timeout=120)
    body = {"model": "", "prompt": "Count to a thousand:", "max_tokens": 1000,
            "ignore_eos": True, "stream": True}  # fmt: skip
    connection.request(
        "POST", "/v1/completions", json.dumps(body), {"content-type": "application/json"}
    )
    response = connection.getresponse()
    assert response.status == 200
    assert b"data:" in response.read1(4096)
    assert status_of(daemon).num_blocks_used > 0
    connection.close()
    wait_for(lambda: status_of(daemon).num_blocks_used == 0)
    assert status_of(daemon).num_running == 0


def sitsctl_bench(daemon: DaemonProcess, *flags: str) -> dict:
    command = [sys.executable, "-m", "sitsd.ctl", "--address", daemon.address, "bench",
               "--json", "--no-progress", *flags]  # fmt: skip
    result = subprocess.run(command, capture_output=True, text=True, env=daemon.env, timeout=420)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout)


@pytest.mark.timeout(900)  # two sitsctl runs on a shared 2-core machine
def test_sitsctl_bench_openai_sends_the_grpc_workload_to_the_http_port(daemon):
    flags = ("--concurrency", "2", "--num-requests", "4", "--prompt-tokens", "8:16",
             "--max-tokens", "2:5", "--seed", str(random.randrange(2**31)))  # fmt: skip
    before = http_requests_by_tier(daemon, "/v1/completions")
    over_grpc = sitsctl_bench(daemon, *flags)
    over_http = sitsctl_bench(daemon, *flags, "--openai", daemon.http_url)
    after = http_requests_by_tier(daemon, "/v1/completions")

    assert over_http["settings"]["target"] == daemon.http_url
    for report in (over_grpc, over_http):
        assert report["total"]["sent"] == report["total"]["completed"] == 4
    # The same draws: the tiers, and outputs of the drawn lengths (greedy, ignore_eos).
    assert over_http["total"]["output_tokens"] == over_grpc["total"]["output_tokens"]
    sent = {tier: stats["sent"] for tier, stats in over_http["tiers"].items()}
    assert sent == {tier: stats["sent"] for tier, stats in over_grpc["tiers"].items()}
    # The daemon counted each HTTP request in the tier its header named.
    counted = {tier: after[tier] - before.get(tier, 0) for tier in after}
    assert {tier: n for tier, n in counted.items() if n} == sent
    assert over_http["total"]["ttft_ms"]["p50"] is not None


def test_the_metrics_port_answers_metrics_only(daemon):
    with pytest.raises(openai.NotFoundError):  # a plain failure, not Prometheus text parsed
        openai.OpenAI(base_url=metrics_url(daemon) + "/v1", api_key="none").models.list()
    with pytest.raises(urllib.error.HTTPError) as raised:
        urllib.request.urlopen(metrics_url(daemon) + "/health", timeout=30)
    assert raised.value.code == 404
    with urllib.request.urlopen(metrics_url(daemon) + "/metrics", timeout=30) as r:
        assert b"sitsd_requests_total" in r.read()
