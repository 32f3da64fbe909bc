"""Request validation: the rules a request must meet before the engine takes it, written once.

The engine and every front end call these functions and restate none of their rules:

- `validate_request(prompt_token_ids, params, model_info)`: what `AsyncEngine.add_request`
  checks on every request, whoever sends it, and the parameters the engine runs it with. In
  order: the prompt (empty, or no room left in the context for one new token), its token ids,
  the sampling parameters (`SamplingParams.validate`: ranges, and bounds on what the engine
  checks at every token, such as the number and length of stop strings; `max_tokens` against
  the room the prompt leaves), then the stop token ids. A `top_k` of the vocabulary's size or
  more is no filter at all, and runs as one (0): it would otherwise cost a sort per token.
- `check_model(requested, model_info)`: a request that names a model must name the served one.
- `check_prompt_text(text, model_info)` and `check_text_fits(field, texts, model_info)`: text
  a front end is about to tokenize (a prompt, chat messages, a rendered chat) must be valid
  Unicode (JSON can carry lone surrogates) and short enough to fit the context, at
  `ModelInfo.max_token_bytes` per token at most; longer text is refused before it is
  tokenized, which would cost more than the request could be worth. Front ends check a
  prompt before they tokenize, also since tokenizing "" can still give a BOS token.
- `check_token_ids(field_name, token_ids, vocab_size)`: for token ids a client sent in a field
  of its own (gRPC's `token_ids`), so the refusal names that field.
- `default_max_tokens(...)`: the completion length of a request that sets none.

Every refusal is an `InvalidRequestError` (`ModelNotFoundError` for the model) whose `field`
names the culprit and whose message starts with it ("max_tokens: must be at least 1, got 0").
The arguments are plain values (token id lists, `SamplingParams`, `ModelInfo`), never a gRPC or
HTTP message. Which status a refusal becomes is the front end's business; limits that depend on
the engine's state (live requests, admission control, duplicate request ids) are checked where
that state is, in `sitsd.engine.async_engine`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from sitsd.engine.errors import InvalidRequestError, ModelNotFoundError
from sitsd.outputs import ModelInfo
from sitsd.types import SamplingError, SamplingParams


def validate_request(
    prompt_token_ids: Sequence[int], params: SamplingParams, model_info: ModelInfo
) -> SamplingParams:
    """The parameters to run the request with; `InvalidRequestError` naming the first field of
    the request that breaks a rule.

    Args:
        prompt_token_ids: the tokenized prompt (chat template already applied).
        params: the sampling parameters, defaults filled in.
        model_info: the served model (context length, vocabulary size).
    """
    num_prompt_tokens = len(prompt_token_ids)
    check_prompt_length(num_prompt_tokens, model_info)
    max_len = model_info.max_model_len
    check_token_ids("prompt_token_ids", prompt_token_ids, model_info.vocab_size)
    try:
        params.validate(max_tokens_limit=max_len - num_prompt_tokens)
    except SamplingError as exc:
        raise InvalidRequestError(exc.field, str(exc).removeprefix(f"{exc.field}: ")) from None
    check_token_ids("stop_token_ids", params.stop_token_ids, model_info.vocab_size)
    if params.top_k >= model_info.vocab_size:
        return dataclasses.replace(params, top_k=0)
    return params


def check_prompt_length(num_prompt_tokens: int, model_info: ModelInfo) -> None:
    """Raise `InvalidRequestError` for a prompt of no tokens, or of too many to leave room in
    the context for one new token (checked before the ids themselves, which costs more)."""
    max_len = model_info.max_model_len
    if not num_prompt_tokens:
        raise InvalidRequestError("prompt", "the prompt is empty")
    if num_prompt_tokens >= max_len:
        raise InvalidRequestError(
            "prompt",
            f"the prompt has {num_prompt_tokens} tokens; the model's context is "
            f"{max_len}, which must leave room for at least one new token",
        )


def check_model(requested: str, model_info: ModelInfo) -> None:
    """Raise `ModelNotFoundError` unless `requested` is empty or the served model's name."""
    if requested and requested != model_info.name:
        raise ModelNotFoundError(
            f"model: {requested!r} is not served here; this daemon serves {model_info.name!r}"
        )


def check_prompt_text(text: str, model_info: ModelInfo) -> None:
    """Raise `InvalidRequestError` for an empty text prompt, or one `check_text_fits` refuses."""
    if not text:
        raise InvalidRequestError("prompt", "the prompt is empty")
    check_text_fits("prompt", (text,), model_info)


def check_text_fits(field_name: str, texts: Sequence[str], model_info: ModelInfo) -> None:
    """Raise `InvalidRequestError` naming `field_name` unless `texts` together are valid Unicode
    and could fit the model's context (at `max_token_bytes` per token at most)."""
    limit = model_info.max_prompt_bytes
    num_chars = sum(len(text) for text in texts)
    if num_chars > limit:  # a character is at least a byte: no need to encode a huge text
        raise _too_long(field_name, f"{num_chars} characters", model_info)
    num_bytes = 0
    for text in texts:
        try:
            num_bytes += len(text.encode())
        except UnicodeEncodeError as exc:  # a lone surrogate: JSON's "\ud800" can carry one
            raise InvalidRequestError(
                field_name, f"not valid Unicode text: a lone surrogate at character {exc.start}"
            ) from None
    if num_bytes > limit:
        raise _too_long(field_name, f"{num_bytes} bytes", model_info)


def _too_long(field_name: str, size: str, model_info: ModelInfo) -> InvalidRequestError:
    return InvalidRequestError(
        field_name,
        f"{size} of text cannot fit the model's context of {model_info.max_model_len} tokens "
        f"(at most {model_info.max_prompt_bytes} bytes: {model_info.max_token_bytes} per token "
        "at most); shorten it",
    )


def check_token_ids(field_name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    """Raise `InvalidRequestError` naming `field_name` if a token id is not in the vocabulary."""
    bad = next((t for t in token_ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequestError(field_name, f"token ids must be in [0, {vocab_size}), got {bad}")


def default_max_tokens(num_prompt_tokens: int, max_model_len: int, max_tokens_default: int) -> int:
    """The completion length of a request that sets no `max_tokens`.

    The daemon's default, capped by the room the prompt leaves in the context, so a long prompt
    with no explicit limit still runs. At least 1: when the prompt fills the context,
    `validate_request` then names the prompt as the culprit, not a max_tokens the client never
    sent.
    """
    return max(1, min(max_tokens_default, max_model_len - num_prompt_tokens))
