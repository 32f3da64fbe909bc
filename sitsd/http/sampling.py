"""An OpenAI request body -> the engine's `SamplingParams`, one per choice.

Maps field names and fills defaults the way OpenAI documents them (completions: 16 tokens;
chat: the daemon's `--max-tokens-default`, capped by the room the prompt leaves), turns
`response_format` / `structured_outputs` into a `GrammarSpec`, and refuses what sitsd cannot
honour (`suffix`, `best_of` other than `n`, tool choices that force a call) naming the field.
Range checks are `SamplingParams.validate`'s (the engine runs it, for gRPC and HTTP alike);
whether a grammar compiles is `sitsd.runtime.grammar`'s; token ids are checked against the
vocabulary by the shared `check_token_ids`.
"""

from __future__ import annotations

import dataclasses
import json

from sitsd.api.inference import check_token_ids
from sitsd.http.errors import bad_request
from sitsd.http.protocol import ChatCompletionRequest, CompletionRequest, _SamplingBody
from sitsd.types import GrammarSpec, SamplingParams

COMPLETIONS_MAX_TOKENS_DEFAULT = 16  # OpenAI's default for /v1/completions
MAX_CHOICES = 128  # n at most: each choice is a request in the engine


def completion_params(
    body: CompletionRequest, *, num_prompt_tokens: int, max_model_len: int, vocab_size: int
) -> SamplingParams:
    """`SamplingParams` of a `/v1/completions` body (the first choice's; see `for_choice`)."""
    if body.suffix:
        raise bad_request("suffix", "is not supported")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of", "is supported only equal to n")
    if body.echo and body.logprobs is not None:
        raise bad_request("echo", "echo with logprobs (prompt logprobs) is not supported")
    max_tokens = _default_max_tokens(
        body.max_tokens, COMPLETIONS_MAX_TOKENS_DEFAULT, num_prompt_tokens, max_model_len
    )
    return _params(body, max_tokens, body.logprobs, vocab_size)


def chat_params(
    body: ChatCompletionRequest,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    max_tokens_default: int,
    vocab_size: int,
) -> SamplingParams:
    """`SamplingParams` of a `/v1/chat/completions` body (the first choice's)."""
    if isinstance(body.tool_choice, dict) or body.tool_choice == "required":
        raise bad_request("tool_choice", "only 'none' and 'auto' are supported")
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs", "needs logprobs: true")
    requested = body.max_completion_tokens or body.max_tokens
    max_tokens = _default_max_tokens(
        requested, max_tokens_default, num_prompt_tokens, max_model_len
    )
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    return _params(body, max_tokens, logprobs, vocab_size)


def for_choice(params: SamplingParams, index: int) -> SamplingParams:
    """Choice `index` of `n`: a client's seed becomes seed + index, so the choices differ from
    each other and each is reproducible; without a seed the engine draws one per request."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % 2**63)


def check_choices(n: int) -> None:
    if not 1 <= n <= MAX_CHOICES:
        raise bad_request("n", f"must be in [1, {MAX_CHOICES}], got {n}")


def _default_max_tokens(
    requested: int | None, default: int, num_prompt_tokens: int, max_model_len: int
) -> int:
    if requested is not None:
        return requested
    # At least 1: when the prompt fills the context the engine names the prompt, not a
    # max_tokens the client never sent.
    return max(1, min(default, max_model_len - num_prompt_tokens))


def _params(
    body: _SamplingBody, max_tokens: int, logprobs: int | None, vocab_size: int
) -> SamplingParams:
    stop = (body.stop,) if isinstance(body.stop, str) else tuple(body.stop or ())
    stop_token_ids = tuple(body.stop_token_ids or ())
    check_token_ids("stop_token_ids", stop_token_ids, vocab_size)
    return SamplingParams(
        max_tokens=max_tokens,
        temperature=1.0 if body.temperature is None else body.temperature,
        top_k=0 if body.top_k is None or body.top_k < 0 else body.top_k,  # -1: vLLM's "off"
        top_p=1.0 if body.top_p is None else body.top_p,
        seed=body.seed,
        stop=stop,
        stop_token_ids=stop_token_ids,
        ignore_eos=body.ignore_eos,
        min_p=body.min_p or 0.0,
        presence_penalty=body.presence_penalty or 0.0,
        frequency_penalty=body.frequency_penalty or 0.0,
        repetition_penalty=(1.0 if body.repetition_penalty is None else body.repetition_penalty),
        logit_bias=_logit_bias(body.logit_bias, vocab_size),
        logprobs=logprobs,
        grammar=grammar_spec(body),
    )


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> tuple[tuple[int, float], ...]:
    if not bias:
        return ()
    try:
        pairs = tuple(sorted((int(token), float(value)) for token, value in bias.items()))
    except ValueError:
        raise bad_request("logit_bias", "keys must be token ids (integers as strings)") from None
    check_token_ids("logit_bias", [t for t, _ in pairs], vocab_size)
    if any(t < 0 for t, _ in pairs):
        raise bad_request("logit_bias", f"token ids must be in [0, {vocab_size})")
    return pairs


def grammar_spec(body: _SamplingBody) -> GrammarSpec | None:
    """The constraint of `response_format` or `structured_outputs` (not both); None if none."""
    fmt = body.response_format
    spec = None
    if fmt is not None and fmt.type == "json_object":
        spec = GrammarSpec("json_object")
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None:
            raise bad_request("response_format", "type json_schema needs a json_schema object")
        spec = GrammarSpec("json_schema", json.dumps(fmt.json_schema.json_schema))
    extra = body.structured_outputs
    if extra is None:
        return spec
    given = [
        name for name in ("json_", "regex", "grammar", "choice") if getattr(extra, name) is not None
    ]
    if len(given) != 1 or spec is not None:
        raise bad_request(
            "structured_outputs", "give exactly one of json, regex, grammar, choice, and no "
            "response_format beside it",
        )  # fmt: skip
    if extra.json_ is not None:
        schema = extra.json_ if isinstance(extra.json_, str) else json.dumps(extra.json_)
        return GrammarSpec("json_schema", schema)
    if extra.regex is not None:
        return GrammarSpec("regex", extra.regex)
    if extra.grammar is not None:
        return GrammarSpec("lark", extra.grammar)
    if not extra.choice:
        raise bad_request("structured_outputs", "choice needs at least one string")
    # A choice is a grammar whose start rule is one of the quoted strings.
    alternatives = " | ".join(json.dumps(c) for c in extra.choice)
    return GrammarSpec("lark", f"start: {alternatives}")
