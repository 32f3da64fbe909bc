"""The Inference servicer against a fake engine: streaming, conversions, every error status."""

from __future__ import annotations

import time

import grpc
import pytest
from google.protobuf.message import Message

from sitsd.api.v1 import inference_pb2 as pb
from sitsd.types import SamplingParams, Tier
from tests.api.fake_engine import BOS_TOKEN_ID, FakeEngine
from tests.api.harness import MAX_TOKENS_DEFAULT, ServerThread


def wait_for(predicate, timeout: float = 120.0) -> None:
    """Poll `predicate` until it is true; fail after `timeout` seconds (a last guard only)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.005)


def _run(call) -> None:
    result = call()
    if not isinstance(result, Message):
        list(result)  # a stream: its error comes while reading it


def rpc_error(call) -> grpc.RpcError:
    """The RpcError that `call()` (a unary call, or a stream to drain) ends with."""
    with pytest.raises(grpc.RpcError) as info:
        _run(call)
    return info.value


def test_generate_streams_one_response_per_delta_with_usage_on_the_last(engine, inference):
    engine.completion = "Hi there"
    request = pb.GenerateRequest(text="abc", sampling=pb.SamplingParams(max_tokens=5))

    responses = list(inference.Generate(request))

    assert [r.text for r in responses] == ["H", "i", " ", "t", "h"]
    assert [list(r.token_ids) for r in responses] == [[ord(c)] for c in "Hi th"]
    assert [r.finish_reason for r in responses] == [pb.FINISH_REASON_UNSPECIFIED] * 4 + [
        pb.FINISH_REASON_LENGTH
    ]
    assert all(not r.HasField("usage") for r in responses[:-1])
    assert responses[-1].usage == pb.Usage(prompt_tokens=4, completion_tokens=5, cached_tokens=0)
    assert {r.weights_version for r in responses} == {"fake-v1"}
    assert {r.model for r in responses} == {"fake-model"}
    assert len({r.request_id for r in responses}) == 1


def test_generate_ends_with_stop_when_the_model_does(engine, inference):
    engine.completion = "ok"
    responses = list(inference.Generate(pb.GenerateRequest(text="x")))
    assert "".join(r.text for r in responses) == "ok"
    assert responses[-1].finish_reason == pb.FINISH_REASON_STOP


def test_text_prompt_is_tokenized_with_special_tokens(engine, inference):
    list(inference.Generate(pb.GenerateRequest(text="hey", request_id="r-text")))
    assert engine.requests["r-text"].prompt_token_ids == [BOS_TOKEN_ID, *map(ord, "hey")]


def test_token_id_prompt_is_passed_as_is(engine, inference):
    request = pb.GenerateRequest(token_ids=pb.TokenIds(ids=[7, 300, 5]), request_id="r-ids")
    list(inference.Generate(request))
    assert engine.requests["r-ids"].prompt_token_ids == [7, 300, 5]


def test_explicit_sampling_fields_and_tier_reach_the_engine(engine, inference):
    request = pb.GenerateRequest(
        text="q",
        sampling=pb.SamplingParams(max_tokens=3, temperature=0.5, top_k=40, top_p=0.25, seed=99),
        stop=["\n\n", "END"],
        stop_token_ids=[13, 14],
        ignore_eos=True,
        tier=pb.TIER_GOLD,
        request_id="client-id-1",
    )
    responses = list(inference.Generate(request))

    assert {r.request_id for r in responses} == {"client-id-1"}
    recorded = engine.requests["client-id-1"]
    assert recorded.params == SamplingParams(
        max_tokens=3,
        temperature=0.5,
        top_k=40,
        top_p=0.25,
        seed=99,
        stop=("\n\n", "END"),
        stop_token_ids=(13, 14),
        ignore_eos=True,
    )
    assert recorded.tier is Tier.GOLD


def test_unset_sampling_fields_take_the_documented_defaults(engine, inference):
    list(inference.Generate(pb.GenerateRequest(text="q", request_id="r-defaults")))
    recorded = engine.requests["r-defaults"]
    assert recorded.params == SamplingParams(
        max_tokens=MAX_TOKENS_DEFAULT, temperature=1.0, top_k=0, top_p=1.0, seed=None
    )
    assert recorded.tier is None
    assert recorded.deadline is None  # no gRPC deadline, no engine deadline


def test_unset_max_tokens_is_capped_by_the_room_left_in_the_context(engine, inference):
    prompt = "p" * (engine.model_info.max_model_len - 1 - 5)  # + BOS leaves 5 free tokens
    responses = list(inference.Generate(pb.GenerateRequest(text=prompt, request_id="r-cap")))
    assert engine.requests["r-cap"].params.max_tokens == 5
    assert responses[-1].usage.completion_tokens == 5


def test_grpc_deadline_becomes_the_engine_deadline(engine, inference):
    before = time.monotonic()
    list(inference.Generate(pb.GenerateRequest(text="q", request_id="r-dl"), timeout=30))
    deadline = engine.requests["r-dl"].deadline
    assert deadline is not None
    # gRPC rounds the timeout it sends up a little: allow a second either way.
    assert before + 29 < deadline < time.monotonic() + 31


def test_chat_is_rendered_with_the_model_template_without_extra_special_tokens(engine, inference):
    chat = pb.ChatMessages(
        messages=[
            pb.ChatMessage(role="system", content="Be brief."),
            pb.ChatMessage(role="user", content="Capital of France?"),
        ]
    )
    list(inference.Generate(pb.GenerateRequest(chat=chat, request_id="r-chat")))

    (rendered,) = engine.tokenizer.rendered
    assert rendered == "<system>Be brief.\n<user>Capital of France?\n<assistant>"
    assert engine.requests["r-chat"].prompt_token_ids == [ord(c) for c in rendered]


def _sampling(**fields) -> pb.SamplingParams:
    return pb.SamplingParams(**fields)


BAD_REQUESTS = {
    "empty text": (pb.GenerateRequest(text=""), "prompt"),
    "no prompt at all": (pb.GenerateRequest(), "prompt"),
    "empty token ids": (pb.GenerateRequest(token_ids=pb.TokenIds()), "prompt"),
    "prompt longer than the context": (pb.GenerateRequest(text="x" * 64), "prompt"),
    "token id outside the vocabulary": (
        pb.GenerateRequest(token_ids=pb.TokenIds(ids=[3, 512])),
        "token_ids",
    ),
    "max_tokens 0": (pb.GenerateRequest(text="q", sampling=_sampling(max_tokens=0)), "max_tokens"),
    "max_tokens over the room in the context": (
        pb.GenerateRequest(text="q", sampling=_sampling(max_tokens=1000)),
        "max_tokens",
    ),
    "temperature -1": (
        pb.GenerateRequest(text="q", sampling=_sampling(temperature=-1)),
        "temperature",
    ),
    "top_p 0": (pb.GenerateRequest(text="q", sampling=_sampling(top_p=0)), "top_p"),
    "top_p 1.5": (pb.GenerateRequest(text="q", sampling=_sampling(top_p=1.5)), "top_p"),
    "seed of 2**63": (pb.GenerateRequest(text="q", sampling=_sampling(seed=2**63)), "seed"),
    "empty stop string": (pb.GenerateRequest(text="q", stop=[""]), "stop"),
    "stop token id outside the vocabulary": (
        pb.GenerateRequest(text="q", stop_token_ids=[9999]),
        "stop_token_ids",
    ),
    "no chat messages": (pb.GenerateRequest(chat=pb.ChatMessages()), "chat"),
    "chat the template refuses": (
        pb.GenerateRequest(chat=pb.ChatMessages(messages=[pb.ChatMessage(role="robot")])),
        "chat",
    ),
}


@pytest.mark.parametrize("request_and_field", BAD_REQUESTS.values(), ids=BAD_REQUESTS.keys())
def test_bad_input_is_invalid_argument_naming_the_field(engine, inference, request_and_field):
    request, field = request_and_field

    error = rpc_error(lambda: inference.Generate(request, timeout=5))

    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith(f"{field}: ")
    assert engine.requests == {}  # refused before anything reached the engine


def test_unknown_model_is_not_found(engine, inference):
    error = rpc_error(lambda: inference.Generate(pb.GenerateRequest(model="gpt-9", text="q")))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "gpt-9" in error.details()
    assert "fake-model" in error.details()


def test_the_served_model_name_is_accepted(engine, inference):
    responses = list(inference.Generate(pb.GenerateRequest(model="fake-model", text="q")))
    assert responses[-1].finish_reason != pb.FINISH_REASON_UNSPECIFIED


def test_duplicate_request_id_in_flight_is_invalid_argument(engine, inference):
    engine.stall_after = 0
    first = inference.Generate(pb.GenerateRequest(text="q", request_id="dup"))
    wait_for(lambda: "dup" in engine.requests)
    error = rpc_error(lambda: inference.Generate(pb.GenerateRequest(text="q", request_id="dup")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("request_id: ")
    first.cancel()


def test_full_queue_is_resource_exhausted(server: ServerThread, inference):
    engine = server.attach(FakeEngine(max_num_live_requests=2))
    engine.stall_after = 0
    calls = [inference.Generate(pb.GenerateRequest(text="q", request_id=f"q{i}")) for i in range(2)]
    wait_for(lambda: len(engine.requests) == 2)

    error = rpc_error(lambda: inference.Generate(pb.GenerateRequest(text="q"), timeout=5))

    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    for call in calls:
        call.cancel()


def test_admission_refusal_is_resource_exhausted_with_the_reason(engine, inference):
    engine.refuse_with = "overloaded: expected queue wait 900 ms exceeds the gold tier's 120 ms"
    error = rpc_error(lambda: inference.Generate(pb.GenerateRequest(text="q", tier=pb.TIER_GOLD)))
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == engine.refuse_with
    assert engine.requests == {}


def test_request_shed_by_the_engine_is_resource_exhausted_with_the_reason(engine, inference):
    engine.shed_with = "overloaded: waited 130 ms in the queue, over the gold tier's 120 ms"
    call = inference.Generate(pb.GenerateRequest(text="q", tier=pb.TIER_GOLD))
    error = rpc_error(lambda: call)
    assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.details() == engine.shed_with


def test_client_cancellation_mid_stream_aborts_the_request(engine, inference):
    engine.stall_after = 2
    call = inference.Generate(pb.GenerateRequest(text="q", request_id="to-cancel"))
    assert [next(call).text, next(call).text] == ["H", "e"]

    call.cancel()

    wait_for(lambda: "to-cancel" in engine.aborts)
    assert engine.aborts["to-cancel"] == "cancelled by the client"
    wait_for(lambda: engine.status().num_blocks_used == 0)


def test_passed_deadline_aborts_the_request(engine, inference):
    engine.stall_after = 1
    call = inference.Generate(pb.GenerateRequest(text="q", request_id="slow"), timeout=0.5)

    error = rpc_error(lambda: call)

    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    wait_for(lambda: "slow" in engine.aborts)
    assert engine.aborts["slow"] == "deadline exceeded"


def test_engine_failure_mid_request_is_internal_with_its_message(engine, inference):
    engine.fail_after = 2
    error = rpc_error(lambda: inference.Generate(pb.GenerateRequest(text="q")))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "fake model step failed" in error.details()


def test_unexpected_exception_is_internal_and_the_server_keeps_serving(engine, inference):
    def broken_add_request(*args, **kwargs):
        raise RuntimeError("boom")

    real_add_request = engine.add_request
    engine.add_request = broken_add_request
    error = rpc_error(lambda: inference.Generate(pb.GenerateRequest(text="q")))
    assert error.code() == grpc.StatusCode.INTERNAL
    assert "RuntimeError: boom" in error.details()

    engine.add_request = real_add_request
    assert list(inference.Generate(pb.GenerateRequest(text="q")))[-1].finish_reason


def test_tokenize_matches_what_generate_sends_for_text_and_chat(engine, inference):
    chat = pb.ChatMessages(messages=[pb.ChatMessage(role="user", content="hi")])
    for request, generate in (
        (pb.TokenizeRequest(text="hello"), pb.GenerateRequest(text="hello", request_id="t1")),
        (pb.TokenizeRequest(chat=chat), pb.GenerateRequest(chat=chat, request_id="t2")),
    ):
        response = inference.Tokenize(request)
        list(inference.Generate(generate))
        assert list(response.token_ids) == engine.requests[generate.request_id].prompt_token_ids
        assert response.num_tokens == len(response.token_ids)
        assert response.model == "fake-model"


def test_tokenize_bad_input_names_the_field(engine, inference):
    error = rpc_error(lambda: inference.Tokenize(pb.TokenizeRequest(text="")))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error.details().startswith("prompt: ")
    error = rpc_error(lambda: inference.Tokenize(pb.TokenizeRequest(model="other", text="x")))
    assert error.code() == grpc.StatusCode.NOT_FOUND


def test_list_models_describes_the_served_model(engine, inference):
    (card,) = inference.ListModels(pb.ListModelsRequest()).models
    assert card == pb.ModelCard(
        name="fake-model",
        max_model_len=64,
        vocab_size=512,
        architecture="llama",
        dtype="float32",
        device="cpu",
    )
