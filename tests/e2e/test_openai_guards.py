"""The real daemon's HTTP API refusing, through the official `openai` client: 401 without one
of `--api-key-file`'s keys, 429 with `Retry-After` once the queue is full, and 503 with
`Retry-After` while the daemon drains (every answer in OpenAI's error JSON)."""

from __future__ import annotations

import json
import os
import random
import signal
import urllib.error
import urllib.request
from collections.abc import Iterator
from http.client import HTTPConnection, HTTPResponse
from urllib.parse import urlparse

import openai
import pytest

from tests.e2e.daemon_process import DaemonProcess, serving
from tests.e2e.test_openai_api import status_of, wait_for

pytestmark = pytest.mark.slow

KEYS = [f"sk-{os.urandom(8).hex()}", f"sk-{os.urandom(8).hex()}"]
LONG = {"model": "", "prompt": "Count to a thousand:", "max_tokens": 1000, "ignore_eos": True,
        "stream": True}  # fmt: skip


@pytest.fixture(scope="module")
def daemon(tmp_path_factory) -> Iterator[DaemonProcess]:
    state = tmp_path_factory.mktemp("state")
    key_file = state / "api-keys"
    key_file.write_text(f"# the test's keys\n{KEYS[0]}\n\n{KEYS[1]}\n")
    flags = ("--api-key-file", str(key_file), "--scheduling-policy", "fcfs", "--max-num-seqs",
             "1", "--max-num-waiting", "1", "--kv-cache-memory", "256MiB")  # fmt: skip
    with serving(state, *flags) as process:
        yield process


def client(daemon: DaemonProcess, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=daemon.http_url, api_key=key, max_retries=0, timeout=300)


def error_json(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def start_long_stream(daemon: DaemonProcess, key: str) -> HTTPConnection:
    """A streamed completion of 1000 tokens, sent; its answer is left unread."""
    url = urlparse(daemon.http_url)
    connection = HTTPConnection(url.hostname, url.port, timeout=300)
    headers = {"content-type": "application/json", "authorization": f"Bearer {key}"}
    connection.request("POST", "/v1/completions", json.dumps(LONG), headers)
    return connection


def num_live(daemon: DaemonProcess) -> int:
    status = status_of(daemon)
    return status.num_running + status.num_waiting


def test_v1_calls_need_one_of_the_keys_and_health_does_not(daemon):
    with pytest.raises(urllib.error.HTTPError) as unsigned:  # no Authorization header at all
        urllib.request.urlopen(daemon.http_url + "/models", timeout=60)
    assert unsigned.value.code == 401
    assert json.loads(unsigned.value.read())["error"]["type"] == "authentication_error"
    for presented in ("sk-wrong", KEYS[0][:-1], f"{KEYS[0]}{KEYS[1]}"):
        with pytest.raises(openai.AuthenticationError) as raised:
            client(daemon, presented).models.list()
        assert raised.value.status_code == 401
        assert error_json(raised.value)["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        client(daemon, "sk-wrong").completions.create(model="", prompt="hi", max_tokens=1)
    for key in KEYS:
        assert [m.id for m in client(daemon, key).models.list().data]
    health = daemon.http_url.removesuffix("/v1") + "/health"
    with urllib.request.urlopen(health, timeout=60) as answer:
        assert json.loads(answer.read()) == {"status": "serving"}


def test_a_full_queue_is_429_with_retry_after_and_frees_nothing_it_holds(daemon):
    key = random.choice(KEYS)
    running = [start_long_stream(daemon, key) for _ in range(2)]  # 1 running + 1 waiting
    try:
        wait_for(lambda: num_live(daemon) == 2, timeout=120)
        with pytest.raises(openai.RateLimitError) as raised:
            client(daemon, key).completions.create(model="", prompt="hi", max_tokens=4)
        assert raised.value.status_code == 429
        assert int(raised.value.response.headers["retry-after"]) >= 1
        assert error_json(raised.value)["type"] == "rate_limit_error"
        assert num_live(daemon) == 2  # the refusal took nothing from the requests in flight
    finally:
        for connection in running:
            connection.close()
    wait_for(lambda: num_live(daemon) == 0 and status_of(daemon).num_blocks_used == 0)


def test_while_draining_new_requests_are_503_with_retry_after(daemon):
    # Last in the module: it stops the daemon.
    key = random.choice(KEYS)
    connection = start_long_stream(daemon, key)
    response: HTTPResponse = connection.getresponse()
    assert response.status == 200
    assert b"data:" in response.read1(4096)
    daemon.proc.send_signal(signal.SIGTERM)
    wait_for(lambda: "draining:" in daemon.log, timeout=60)
    try:
        with pytest.raises(openai.InternalServerError) as raised:
            client(daemon, key).completions.create(model="", prompt="hi", max_tokens=4)
        assert raised.value.status_code == 503
        assert int(raised.value.response.headers["retry-after"]) >= 1
        assert error_json(raised.value)["code"] == "unavailable"
    finally:
        connection.close()  # the drain ends once the stream is aborted
    assert daemon.proc.wait(120) == 0
