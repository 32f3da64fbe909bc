"""The request rules every front end and the engine share: which field each refusal names."""

from __future__ import annotations

import dataclasses
import math
import random

import pytest

from sitsd.engine.errors import InvalidRequestError, ModelNotFoundError
from sitsd.engine.validation import (
    check_model,
    check_prompt_text,
    check_text_fits,
    check_token_ids,
    default_max_tokens,
    validate_request,
)
from sitsd.outputs import ModelInfo
from sitsd.types import (
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)


@pytest.fixture
def info(rng: random.Random) -> ModelInfo:
    return ModelInfo(
        name=f"model-{rng.randrange(10**6)}",
        max_model_len=rng.randint(16, 256),
        vocab_size=rng.randint(64, 50_000),
        architecture="llama",
        dtype="float32",
        device="cpu",
        path="/nonexistent",
    )


def prompt_of(rng: random.Random, info: ModelInfo, length: int | None = None) -> list[int]:
    length = rng.randint(1, info.max_model_len - 1) if length is None else length
    return [rng.randrange(info.vocab_size) for _ in range(length)]


def refusal(prompt: list[int], params: SamplingParams, info: ModelInfo) -> InvalidRequestError:
    with pytest.raises(InvalidRequestError) as caught:
        validate_request(prompt, params, info)
    return caught.value


def test_a_request_within_every_limit_passes(rng, info):
    prompt = prompt_of(rng, info)
    room = info.max_model_len - len(prompt)
    params = SamplingParams(
        max_tokens=room,  # exactly the room the prompt leaves
        temperature=rng.uniform(0, 2),
        top_k=rng.randint(0, 100),
        top_p=rng.uniform(0.01, 1.0),
        seed=rng.randrange(2**63),
        stop=("\n",),
        stop_token_ids=(rng.randrange(info.vocab_size),),
    )
    validate_request(prompt, params, info)


def test_an_empty_prompt_names_the_prompt(info):
    error = refusal([], SamplingParams(max_tokens=1), info)
    assert error.field == "prompt"
    assert str(error) == "prompt: the prompt is empty"


@pytest.mark.parametrize("extra", [0, 1, 7])
def test_a_prompt_that_leaves_no_room_in_the_context_names_the_prompt(rng, info, extra):
    prompt = prompt_of(rng, info, info.max_model_len + extra)
    error = refusal(prompt, SamplingParams(max_tokens=1), info)
    assert error.field == "prompt"
    assert f"has {len(prompt)} tokens" in str(error)
    assert f"context is {info.max_model_len}" in str(error)


@pytest.mark.parametrize("bad", ["negative", "vocab_size", "far_above"])
def test_a_prompt_token_outside_the_vocabulary_is_named_with_the_id(rng, info, bad):
    prompt = prompt_of(rng, info)
    wrong = {"negative": -1, "vocab_size": info.vocab_size, "far_above": 10 * info.vocab_size}[bad]
    prompt[rng.randrange(len(prompt))] = wrong
    error = refusal(prompt, SamplingParams(max_tokens=1), info)
    assert error.field == "prompt_token_ids"
    assert str(error) == (
        f"prompt_token_ids: token ids must be in [0, {info.vocab_size}), got {wrong}"
    )


def test_a_stop_token_outside_the_vocabulary_names_stop_token_ids(rng, info):
    stop_ids = (rng.randrange(info.vocab_size), info.vocab_size + rng.randrange(100))
    error = refusal(
        prompt_of(rng, info), SamplingParams(max_tokens=1, stop_token_ids=stop_ids), info
    )
    assert error.field == "stop_token_ids"
    assert str(error).endswith(f"got {stop_ids[1]}")


SAMPLING_REFUSALS = {
    "max_tokens 0": ("max_tokens", dict(max_tokens=0)),
    "temperature -1": ("temperature", dict(temperature=-1.0)),
    "temperature NaN": ("temperature", dict(temperature=math.nan)),
    "top_p 0": ("top_p", dict(top_p=0.0)),
    "top_p 1.5": ("top_p", dict(top_p=1.5)),
    "top_k -1": ("top_k", dict(top_k=-1)),
    "empty stop string": ("stop", dict(stop=("end", ""))),
    "seed 2**63": ("seed", dict(seed=2**63)),
}


@pytest.mark.parametrize("field_and_fields", SAMPLING_REFUSALS.values(), ids=SAMPLING_REFUSALS)
def test_a_sampling_parameter_out_of_range_is_named_once(rng, info, field_and_fields):
    field, fields = field_and_fields
    params = dataclasses.replace(SamplingParams(max_tokens=1), **fields)
    error = refusal(prompt_of(rng, info), params, info)
    assert error.field == field
    assert str(error).startswith(f"{field}: ")
    assert not str(error).startswith(f"{field}: {field}: ")


def test_max_tokens_may_not_exceed_the_room_the_prompt_leaves(rng, info):
    prompt = prompt_of(rng, info)
    room = info.max_model_len - len(prompt)
    error = refusal(prompt, SamplingParams(max_tokens=room + 1), info)
    assert str(error) == f"max_tokens: must be at most {room}, got {room + 1}"


def test_the_first_broken_rule_in_order_is_the_one_named(rng, info):
    too_long = prompt_of(rng, info, info.max_model_len)
    bad_id = prompt_of(rng, info)
    bad_id[0] = info.vocab_size
    good = prompt_of(rng, info)
    everything_wrong = SamplingParams(max_tokens=0, top_p=2.0, stop_token_ids=(-5,))
    assert refusal(too_long, everything_wrong, info).field == "prompt"
    assert refusal(bad_id, everything_wrong, info).field == "prompt_token_ids"
    assert refusal(good, everything_wrong, info).field == "max_tokens"
    # The ids are checked one by one only once their number is within bounds.
    in_range = dataclasses.replace(everything_wrong, max_tokens=1, top_p=1.0)
    assert refusal(good, in_range, info).field == "stop_token_ids"


def test_check_token_ids_names_the_callers_field(rng, info):
    ids = prompt_of(rng, info)
    check_token_ids("token_ids", ids, info.vocab_size)
    with pytest.raises(InvalidRequestError) as caught:
        check_token_ids("token_ids", [*ids, info.vocab_size], info.vocab_size)
    assert caught.value.field == "token_ids"


def test_an_empty_text_prompt_is_refused_and_a_short_one_passes(rng, info):
    check_prompt_text(" " * rng.randint(1, 5), info)
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_text("", info)
    assert str(caught.value) == "prompt: the prompt is empty"


def test_text_that_cannot_fit_the_context_is_refused_naming_the_limit(rng, info):
    limit = info.max_prompt_bytes
    assert limit == info.max_model_len * info.max_token_bytes
    check_prompt_text("x" * limit, info)
    for text in ("x" * (limit + 1), "é" * (limit // 2 + 1), "x" * 40 * limit):
        with pytest.raises(InvalidRequestError) as caught:
            check_prompt_text(text, info)
        assert caught.value.field == "prompt"
        assert f"context of {info.max_model_len} tokens" in str(caught.value)
        assert f"at most {limit} bytes" in str(caught.value)


def test_texts_checked_together_count_together(rng, info):
    half = "y" * (info.max_prompt_bytes // 2)
    check_text_fits("messages", [half, half], info)
    with pytest.raises(InvalidRequestError) as caught:
        check_text_fits("messages", [half, half, "z"], info)
    assert caught.value.field == "messages"


def test_a_lone_surrogate_is_refused_as_text_no_tokenizer_takes(rng, info):
    with pytest.raises(InvalidRequestError) as caught:
        check_prompt_text("ok \ud800 then", info)
    assert str(caught.value) == ("prompt: not valid Unicode text: a lone surrogate at character 3")


def test_a_top_k_past_the_vocabulary_runs_as_no_top_k(rng, info):
    prompt = prompt_of(rng, info)
    for top_k in (info.vocab_size, info.vocab_size + rng.randint(1, 2**32), 2**32 - 1):
        assert validate_request(prompt, SamplingParams(max_tokens=1, top_k=top_k), info).top_k == 0
    kept = rng.randint(1, info.vocab_size - 1)
    assert validate_request(prompt, SamplingParams(max_tokens=1, top_k=kept), info).top_k == kept


@pytest.mark.parametrize(
    ("field", "fields", "says"),
    [
        ("stop", dict(stop=("s",) * (MAX_STOP_STRINGS + 1)), f"at most {MAX_STOP_STRINGS} stop"),
        ("stop", dict(stop=("x" * (MAX_STOP_STRING_CHARS + 1),)), "at most 256 characters"),
        ("stop_token_ids", dict(stop_token_ids=(3,) * (MAX_STOP_TOKEN_IDS + 1)), "at most 128"),
        ("temperature", dict(temperature=math.inf), "finite"),
    ],
    ids=["many stop strings", "long stop string", "many stop ids", "infinite temperature"],
)
def test_what_the_engine_checks_at_every_token_is_bounded(rng, info, field, fields, says):
    error = refusal(prompt_of(rng, info), SamplingParams(max_tokens=1, **fields), info)
    assert error.field == field
    assert says in str(error)


def test_stop_strings_at_the_bounds_pass(rng, info):
    stops = tuple(
        "".join(rng.choice("abc") for _ in range(MAX_STOP_STRING_CHARS))
        for _ in range(MAX_STOP_STRINGS)
    )
    ids = tuple(rng.randrange(info.vocab_size) for _ in range(MAX_STOP_TOKEN_IDS))
    params = SamplingParams(max_tokens=1, stop=stops, stop_token_ids=ids)
    assert validate_request(prompt_of(rng, info), params, info) == params


def test_only_the_served_model_or_none_is_accepted(info):
    check_model("", info)
    check_model(info.name, info)
    with pytest.raises(ModelNotFoundError) as caught:
        check_model(info.name + "-other", info)
    assert str(caught.value).startswith("model: ")
    assert repr(info.name + "-other") in str(caught.value)
    assert repr(info.name) in str(caught.value)


def test_the_default_max_tokens_fits_the_room_the_prompt_leaves(rng, info):
    default = rng.randint(1, 2 * info.max_model_len)
    prompt = prompt_of(rng, info)
    room = info.max_model_len - len(prompt)
    max_tokens = default_max_tokens(len(prompt), info.max_model_len, default)
    assert max_tokens == min(default, room)
    validate_request(prompt, SamplingParams(max_tokens=max_tokens), info)


def test_a_prompt_that_fills_the_context_gets_one_default_token_and_is_refused_as_the_prompt(
    rng, info
):
    prompt = prompt_of(rng, info, info.max_model_len)
    max_tokens = default_max_tokens(len(prompt), info.max_model_len, rng.randint(1, 512))
    assert max_tokens == 1
    assert refusal(prompt, SamplingParams(max_tokens=max_tokens), info).field == "prompt"
