"""The `sitsd.api.v1.Inference` servicer: Generate, Tokenize, ListModels.

Generate turns a request into prompt token ids (text, token ids, or chat messages rendered with
the model's chat template) and `SamplingParams`, hands them to the engine, and streams one
response per engine delta. Whatever ends the call early (client cancellation, a passed deadline,
a failure) aborts the request in the engine, so its KV blocks are freed at once; the abort says
whether the client cancelled or ran out of time (`sitsd.api.deadlines`).

`EngineRef` holds the engine the servicers talk to: the server starts before the model is loaded
and the daemon attaches the engine once it is warm. The rules a request must meet are
`sitsd.engine.validation`'s: this module calls the ones that need the request's own fields
(the model name, a text prompt, the `token_ids` field) and leaves the rest to the engine, which
checks every request it takes. Text is checked before it is tokenized, and a long one is
tokenized off the event loop (`encode_text`), which streams every other request's tokens.
Scheduling and sampling are the engine's; exception -> status mapping is `interceptors`'.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any, Protocol

import grpc.aio

from sitsd.api import convert
from sitsd.api.deadlines import CallDeadline
from sitsd.api.interceptors import status_for_finish
from sitsd.api.v1 import inference_pb2, inference_pb2_grpc
from sitsd.engine.errors import EngineStoppedError, InvalidRequestError
from sitsd.engine.validation import (
    check_model,
    check_prompt_length,
    check_prompt_text,
    check_text_fits,
    check_token_ids,
)
from sitsd.observability.tracing import current_request_span
from sitsd.outputs import EngineStatus, ModelInfo
from sitsd.types import EndReason, RequestDelta, SamplingParams, Tier


class TokenizerLike(Protocol):
    """What the API needs of a tokenizer (`sitsd.weights.Tokenizer`)."""

    has_chat_template: bool

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str: ...


class RequestStreamLike(Protocol):
    """An engine request's stream of deltas (`sitsd.engine.async_engine.RequestStream`)."""

    req_id: str

    def __aiter__(self) -> AsyncIterator[RequestDelta]: ...

    def abort(self, reason: str = ..., cause: EndReason = ...) -> None: ...

    @property
    def finished(self) -> bool: ...


class EngineLike(Protocol):
    """What the API needs of the engine (`sitsd.engine.async_engine.AsyncEngine`)."""

    model_info: ModelInfo
    tokenizer: Any  # a TokenizerLike; Any so tokenizers with richer signatures fit

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        req_id: str | None = None,
        tier: Tier | None = None,
        deadline: float | None = None,
        trace_context: object | None = None,
    ) -> RequestStreamLike: ...

    def status(self) -> EngineStatus: ...

    @property
    def accepting(self) -> bool: ...


class EngineRef:
    """The engine the servicers use, attached once warm, and where the daemon is in its life."""

    def __init__(self) -> None:
        self.started_at = time.monotonic()
        self._engine: EngineLike | None = None
        self.swaps: Any | None = None  # the weight-version manager, once the engine serves
        self.pushes: Any | None = None  # live weight pushes (`sitsd.weights.push.WeightPushes`)
        self._draining = False

    def attach(
        self, engine: EngineLike, swaps: Any | None = None, pushes: Any | None = None
    ) -> None:
        """Serve requests with `engine` (weight operations with `swaps`, pushes with `pushes`)
        from now on."""
        self._engine = engine
        self.swaps = swaps
        self.pushes = pushes

    def drain(self) -> None:
        """Refuse new requests from now on (UNAVAILABLE); in-flight ones continue."""
        self._draining = True

    @property
    def engine(self) -> EngineLike | None:
        return self._engine

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def state(self) -> str:
        """ "loading", "serving" or "draining"."""
        if self._draining:
            return "draining"
        return "loading" if self._engine is None else "serving"

    def get(self) -> EngineLike:
        """The engine, for a new request.

        Raises:
            EngineStoppedError: still loading, or shutting down.
        """
        if self._draining:
            raise EngineStoppedError("the daemon is shutting down; retry on another replica")
        if self._engine is None:
            raise EngineStoppedError("the model is still loading; retry when health is SERVING")
        return self._engine


# Texts up to this many characters are tokenized on the event loop (well under a millisecond);
# longer ones on a worker thread, where `sitsd.weights.Tokenizer.encode` runs without the GIL.
INLINE_TOKENIZE_CHARS = 4096


async def encode_text(
    tokenizer: TokenizerLike, text: str, *, add_special_tokens: bool
) -> list[int]:
    """`tokenizer.encode(text)`, off the event loop unless the text is short.

    Check the text first (`check_prompt_text`, `check_text_fits`): this tokenizes anything.
    """
    if len(text) <= INLINE_TOKENIZE_CHARS:
        return tokenizer.encode(text, add_special_tokens=add_special_tokens)
    return await asyncio.to_thread(tokenizer.encode, text, add_special_tokens)


async def encode_chat(
    tokenizer: TokenizerLike, chat: inference_pb2.ChatMessages, info: ModelInfo
) -> list[int]:
    """Render `chat` with the model's template (plus the assistant prompt) and tokenize it."""
    if not chat.messages:
        raise InvalidRequestError("chat", "at least one message is needed")
    if not tokenizer.has_chat_template:
        raise InvalidRequestError("chat", "the model has no chat template; send a text prompt")
    messages = convert.chat_messages_from_proto(chat)
    check_text_fits("chat", [m["content"] for m in messages], info)  # before rendering them
    try:
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    except ValueError as exc:  # sitsd.weights.ChatTemplateError: the template refused them
        raise InvalidRequestError("chat", str(exc)) from exc
    check_text_fits("chat", [text], info)
    # The template writes the special tokens (BOS, role markers) itself.
    return await encode_text(tokenizer, text, add_special_tokens=False)


async def encode_prompt(
    tokenizer: TokenizerLike,
    kind: str | None,
    message: inference_pb2.GenerateRequest | inference_pb2.TokenizeRequest,
    info: ModelInfo,
) -> list[int]:
    """Token ids of the prompt oneof `kind` ("text", "token_ids" or "chat") of `message`.

    Raises:
        InvalidRequestError: the prompt is missing, the text is empty or cannot fit the
            context, a `token_ids` id is out of range, or the chat cannot be rendered. The
            rest of the prompt's rules are the engine's
            (`sitsd.engine.validation.validate_request`).
    """
    if kind == "text":
        check_prompt_text(message.text, info)
        return await encode_text(tokenizer, message.text, add_special_tokens=True)
    if kind == "token_ids" and isinstance(message, inference_pb2.GenerateRequest):
        ids = list(message.token_ids.ids)
        check_prompt_length(len(ids), info)
        check_token_ids("token_ids", ids, info.vocab_size)
        return ids
    if kind == "chat":
        return await encode_chat(tokenizer, message.chat, info)
    raise InvalidRequestError("prompt", "the request has no prompt")


class InferenceServicer(inference_pb2_grpc.InferenceServicer):
    """Serves `sitsd.api.v1.Inference` with the engine in an `EngineRef`."""

    def __init__(self, engines: EngineRef, *, max_tokens_default: int) -> None:
        """Args:
        engines: where the engine is (or will be).
        max_tokens_default: the completion length when a request sets no max_tokens.
        """
        self._engines = engines
        self._max_tokens_default = max_tokens_default

    async def Generate(
        self, request: inference_pb2.GenerateRequest, context: grpc.aio.ServicerContext
    ) -> AsyncIterator[inference_pb2.GenerateResponse]:
        deadline = CallDeadline.after(context.time_remaining())
        engine = self._engines.get()
        info = engine.model_info
        check_model(request.model, info)
        prompt_ids = await encode_prompt(
            engine.tokenizer, request.WhichOneof("prompt"), request, info
        )
        params = convert.sampling_params_from_proto(
            request,
            num_prompt_tokens=len(prompt_ids),
            max_model_len=info.max_model_len,
            max_tokens_default=self._max_tokens_default,
        )
        stream = engine.add_request(
            prompt_ids,
            params,
            req_id=request.request_id or None,
            tier=convert.tier_from_proto(request.tier),
            deadline=deadline.at,
            trace_context=current_request_span(),  # engine spans become its children
        )
        try:
            async for delta in stream:
                failure = status_for_finish(
                    delta, draining=self._engines.draining, deadline_passed=deadline.passed()
                )
                if failure is not None:
                    await context.abort(*failure)
                yield convert.delta_to_response(delta, model=info.name)
        finally:
            # Reached on cancellation, a passed deadline or any failure too: the engine must
            # stop the request and free its blocks. A no-op for a finished stream.
            if not stream.finished:
                if deadline.explains_leaving():
                    stream.abort("deadline exceeded", EndReason.DEADLINE)
                else:
                    stream.abort("cancelled by the client", EndReason.CANCELLED)

    async def Tokenize(
        self, request: inference_pb2.TokenizeRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.TokenizeResponse:
        engine = self._engines.get()
        info = engine.model_info
        check_model(request.model, info)
        token_ids = await encode_prompt(
            engine.tokenizer, request.WhichOneof("input"), request, info
        )
        return inference_pb2.TokenizeResponse(
            token_ids=token_ids, num_tokens=len(token_ids), model=info.name
        )

    async def ListModels(
        self, request: inference_pb2.ListModelsRequest, context: grpc.aio.ServicerContext
    ) -> inference_pb2.ListModelsResponse:
        engine = self._engines.engine
        if engine is None:
            raise EngineStoppedError("the model is still loading; retry when health is SERVING")
        return inference_pb2.ListModelsResponse(models=[convert.model_card(engine.model_info)])
