"""Requests whose cost has no bound are refused before they cost anything (gRPC front end).

A text or chat too long to fit the context is refused before it is tokenized (or rendered); a
long one that may fit is tokenized off the event loop; stop strings are bounded in number and
length; a top_k past the vocabulary runs as no top_k. The rules are `sitsd.engine.validation`'s,
shared with the HTTP API (`tests/http/test_hostile_input.py`).
"""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from sitsd.api.inference import INLINE_TOKENIZE_CHARS
from sitsd.api.v1 import inference_pb2 as pb
from sitsd.types import MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS
from tests.api.fake_engine import FakeEngine, FakeTokenizer
from tests.api.test_inference import rpc_error

CONTEXT = 8192  # x 4 bytes a token (the fake's characters): 32 KiB of text fit


class RecordingTokenizer(FakeTokenizer):
    """Remembers the length of each text it encoded and the thread it ran on."""

    def __init__(self) -> None:
        super().__init__()
        self.encoded: list[tuple[int, str]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.encoded.append((len(text), threading.current_thread().name))
        return super().encode(text, add_special_tokens)


@pytest.fixture
def engine(server) -> FakeEngine:
    engine = FakeEngine(max_model_len=CONTEXT)
    engine.tokenizer = RecordingTokenizer()
    return server.attach(engine)


def text_of(rng: random.Random, num_chars: int) -> str:
    return "".join(rng.choice("abcdefgh ") for _ in range(num_chars))


def test_a_text_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(
    engine, inference, rng
):
    limit = engine.model_info.max_prompt_bytes
    for rpc in (
        lambda text: list(inference.Generate(pb.GenerateRequest(text=text), timeout=10)),
        lambda text: inference.Tokenize(pb.TokenizeRequest(text=text), timeout=10),
    ):
        error = rpc_error(lambda rpc=rpc: rpc(text_of(rng, limit + rng.randint(1, 10 * limit))))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert error.details().startswith("prompt: ")
        assert f"context of {CONTEXT} tokens" in error.details()
    assert engine.tokenizer.encoded == []
    assert engine.requests == {}


def test_a_chat_too_long_for_the_context_is_refused_before_it_is_rendered(engine, inference, rng):
    limit = engine.model_info.max_prompt_bytes
    messages = [pb.ChatMessage(role="user", content=text_of(rng, limit // 3 + 1)) for _ in range(3)]
    request = pb.GenerateRequest(chat=pb.ChatMessages(messages=messages))
    error = rpc_error(lambda: list(inference.Generate(request, timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("chat: ")
    assert engine.tokenizer.rendered == []
    assert engine.tokenizer.encoded == []


def test_long_text_is_tokenized_off_the_event_loop_and_short_text_on_it(engine, inference, rng):
    loop_thread = "test-grpc-loop"  # tests.api.harness.ServerThread's
    long_text = text_of(rng, INLINE_TOKENIZE_CHARS + rng.randint(1, 2000))
    response = inference.Tokenize(pb.TokenizeRequest(text=long_text), timeout=10)
    assert response.num_tokens == len(long_text) + 1
    inference.Tokenize(pb.TokenizeRequest(text="short"), timeout=10)
    (long_thread, short_thread) = [thread for _, thread in engine.tokenizer.encoded]
    assert long_thread != loop_thread
    assert short_thread == loop_thread


def test_a_token_id_prompt_longer_than_the_context_is_refused_by_its_length(engine, inference):
    ids = [engine.model_info.vocab_size + 1] * (CONTEXT + 1)  # out of range too: length first
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=ids))
    error = rpc_error(lambda: list(inference.Generate(request, timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"prompt: the prompt has {CONTEXT + 1} tokens")


@pytest.mark.parametrize(
    ("stops", "says"),
    [
        (["s"] * (MAX_STOP_STRINGS + 1), f"at most {MAX_STOP_STRINGS} stop strings"),
        (["x" * (MAX_STOP_STRING_CHARS + 1)], f"at most {MAX_STOP_STRING_CHARS} characters"),
        (["\n"] * 290_000, f"at most {MAX_STOP_STRINGS} stop strings, got 290000"),
    ],
    ids=["too many", "too long", "the reproduction's 290k"],
)
def test_stop_strings_past_their_bounds_are_refused_naming_stop(engine, inference, stops, says):
    request = pb.GenerateRequest(text="hi", stop=stops)
    error = rpc_error(lambda: list(inference.Generate(request, timeout=10)))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("stop: ")
    assert says in error.details()
    assert engine.requests == {}


def test_a_top_k_past_the_vocabulary_runs_as_no_top_k(engine, inference):
    request = pb.GenerateRequest(
        text="hi", request_id="k", sampling=pb.SamplingParams(top_k=2**32 - 1, max_tokens=2)
    )
    list(inference.Generate(request, timeout=10))
    assert engine.requests["k"].params.top_k == 0
