"""Hostile input to the HTTP API: malformed bodies are 400s with no traceback in the log, and
requests whose cost has no bound are refused before they cost anything (the rules gRPC applies,
from `sitsd.engine.validation`: `tests/api/test_hostile_prompts.py`)."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterator

import pytest

from sitsd.api.inference import INLINE_TOKENIZE_CHARS
from sitsd.types import MAX_STOP_STRINGS
from tests.api.fake_engine import FakeEngine
from tests.api.test_hostile_prompts import CONTEXT, RecordingTokenizer, text_of
from tests.http.harness import HttpThread, request
from tests.http.test_app import chat_body, error_of


@pytest.fixture
def http() -> Iterator[HttpThread]:
    thread = HttpThread()
    engine = FakeEngine(max_model_len=CONTEXT)
    engine.tokenizer = RecordingTokenizer()
    thread.attach(engine)
    yield thread
    thread.stop()


def post(http: HttpThread, path: str, raw: bytes) -> tuple[int, dict]:
    return error_of(request(http.base_url, path, raw=raw))


MALFORMED = {
    "truncated JSON": b'{"prompt": "hi", "max_tokens": ',
    "not UTF-8": b'{"prompt": "\xff\xfe", "max_tokens": 2}',
    "nested past any parser's depth": b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    "a lone surrogate in the prompt": b'{"prompt": "ok \\ud800", "max_tokens": 2}',
    "a lone surrogate in a message": (
        b'{"messages": [{"role": "user", "content": "\\udc80"}], "max_tokens": 2}'
    ),
    "a JSON array": b"[]",
    "an empty body": b"",
    "an infinite temperature": b'{"prompt": "hi", "temperature": 1e999}',
    "a seed past 2**63": b'{"prompt": "hi", "seed": 99999999999999999999999}',
}


@pytest.mark.parametrize("body", MALFORMED.values(), ids=MALFORMED)
def test_a_malformed_body_is_a_400_and_leaves_no_traceback_in_the_log(http, caplog, body):
    caplog.set_level(logging.INFO)
    path = "/v1/chat/completions" if b"messages" in body else "/v1/completions"
    status, error = post(http, path, body)
    assert status == 400, error
    assert error["type"] == "invalid_request_error"
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    assert http.engine.requests == {}


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(http, rng):
    limit = http.engine.model_info.max_prompt_bytes
    long_text = text_of(rng, limit + rng.randint(1, limit))
    for prompt in (long_text, ["short", long_text]):
        body = json.dumps({"prompt": prompt, "max_tokens": 2}).encode()
        status, error = post(http, "/v1/completions", body)
        assert status == 400
        assert error["param"] == "prompt"
        assert f"context of {CONTEXT} tokens" in error["message"]
    assert http.engine.tokenizer.encoded == []  # not even the short one of the batch


def test_messages_too_long_for_the_context_are_refused_before_they_are_rendered(http, rng):
    limit = http.engine.model_info.max_prompt_bytes
    messages = [{"role": "user", "content": text_of(rng, limit // 2 + 1)} for _ in range(2)]
    body = json.dumps(chat_body(messages=messages)).encode()
    status, error = post(http, "/v1/chat/completions", body)
    assert status == 400
    assert error["param"] == "messages"
    assert http.engine.tokenizer.rendered == []
    assert http.engine.tokenizer.encoded == []


def test_long_text_is_tokenized_off_the_event_loop(http, rng):
    async def loop_thread() -> str:
        return threading.current_thread().name

    long_text = text_of(rng, INLINE_TOKENIZE_CHARS + rng.randint(1, 2000))
    body = json.dumps({"prompt": [long_text, "short"], "max_tokens": 2})
    status, _, _ = request(http.base_url, "/v1/completions", raw=body.encode())
    assert status == 200
    (long_thread, short_thread) = [thread for _, thread in http.engine.tokenizer.encoded]
    assert long_thread != http.call(loop_thread())
    assert short_thread == http.call(loop_thread())


def test_stop_strings_past_their_bound_are_refused_naming_stop(http):
    body = json.dumps({"prompt": "hi", "stop": ["s"] * (MAX_STOP_STRINGS + 1)}).encode()
    status, error = post(http, "/v1/completions", body)
    assert status == 400
    assert error["param"] == "stop"
    assert f"at most {MAX_STOP_STRINGS} stop strings" in error["message"]


def test_a_top_k_past_the_vocabulary_runs_as_no_top_k(http):
    body = json.dumps({"prompt": "hi", "max_tokens": 2, "top_k": 2**32 - 1}).encode()
    status, _, _ = request(http.base_url, "/v1/completions", raw=body)
    assert status == 200
    (recorded,) = http.engine.requests.values()
    assert recorded.params.top_k == 0
