"""The two generation endpoints: a body in, the engine's choices out, streamed or whole.

Each handler does the same steps as gRPC's `Generate`: check the model, tokenize the prompt
(`prompts`), build `SamplingParams` (`sampling`; the engine validates them), add the requests
(`generation`), then answer. A streamed answer waits for the first delta before it sends its
headers, so a request refused or shed in the queue still gets its status (429, 504, ...); after
that a failure is an `error` event. Whatever ends a request early (the client gone, a passed
deadline, a failure) reaches a `finally` that aborts its engine requests, which frees their
blocks; a client that leaves at its deadline (`x-sitsd-timeout-ms`, often its own timeout too)
counts as the deadline, not as a cancellation (`sitsd.api.deadlines`). The routes, auth and
error rendering are `sitsd.http.app`'s.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from sitsd.api.deadlines import CallDeadline
from sitsd.api.inference import EngineLike, EngineRef, check_model
from sitsd.http import prompts, sampling
from sitsd.http.errors import (
    HttpError,
    bad_request,
    client_closed,
    deadline_exceeded,
    error_for_exception,
    error_for_finish,
)
from sitsd.http.generation import Generation, RequestOptions
from sitsd.http.protocol import (
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionRequest,
    CompletionResponse,
)
from sitsd.http.responses import (
    Collected,
    Header,
    TokenTexts,
    chat_chunk,
    chat_role_chunk,
    completion_chunk,
)
from sitsd.http.sse import DONE, ClientGone, SseResponse, event, until_disconnect
from sitsd.http.telemetry import HttpTelemetry, RequestSpan
from sitsd.types import EndReason, GrammarSpec, RequestDelta, SamplingParams, Tier

TIER_HEADER = "x-sitsd-tier"
TIMEOUT_HEADER = "x-sitsd-timeout-ms"  # the request's deadline, in ms from its arrival

GrammarCheck = Callable[[EngineLike, GrammarSpec], None]


@dataclass
class _Call:
    """One generation request being answered."""

    request: Request
    span: RequestSpan
    tier: str
    deadline: CallDeadline
    generation: Generation
    collected: Collected
    header: Header
    texts: TokenTexts
    stream: bool
    include_usage: bool


class GenerationHandlers:
    """`/v1/completions` and `/v1/chat/completions` on the engine in an `EngineRef`."""

    def __init__(
        self,
        engines: EngineRef,
        telemetry: HttpTelemetry,
        *,
        max_tokens_default: int,
        retry_after_s: int,
        check_grammar: GrammarCheck | None = None,
    ) -> None:
        self._engines = engines
        self._telemetry = telemetry
        self._max_tokens_default = max_tokens_default
        self._retry_after_s = retry_after_s
        self._check_grammar = check_grammar
        self._texts: tuple[EngineLike, TokenTexts] | None = None

    # ------------------------------------------------------------------------- endpoints

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        route = "/v1/completions"
        span = self._telemetry.start(route, request.headers, "text_completion")
        tier = ""
        try:
            tier = _tier(body.tier, request)
            engine = self._engines.get()
            info = engine.model_info
            check_model(body.model, info)
            sampling.check_choices(body.n)
            prompt_ids, prompt_texts = await prompts.completion_prompts(
                body, engine.tokenizer, info
            )
            params = [
                sampling.completion_params(
                    body,
                    num_prompt_tokens=len(ids),
                    max_model_len=info.max_model_len,
                    vocab_size=info.vocab_size,
                )
                for ids in prompt_ids
            ]
            call = self._start(request, span, tier, engine, prompt_ids, params, body, "cmpl")
        except Exception as exc:
            raise self._fail(span, tier, exc) from exc
        echo = prompt_texts if body.echo else None
        if body.stream:
            return await self._stream(call, self._completion_events(call, echo))
        collected = await self._collect(call)
        return _json(collected.completion(call.header, call.texts, prompt_texts, body.echo))

    async def chat(self, body: ChatCompletionRequest, request: Request) -> Response:
        route = "/v1/chat/completions"
        span = self._telemetry.start(route, request.headers, "chat")
        tier = ""
        try:
            tier = _tier(body.tier, request)
            engine = self._engines.get()
            info = engine.model_info
            check_model(body.model, info)
            sampling.check_choices(body.n)
            prompt_ids = await prompts.chat_prompt(body, engine.tokenizer, info)
            params = sampling.chat_params(
                body, num_prompt_tokens=len(prompt_ids), max_model_len=info.max_model_len,
                max_tokens_default=self._max_tokens_default, vocab_size=info.vocab_size,
            )  # fmt: skip
            call = self._start(
                request, span, tier, engine, [prompt_ids], [params], body, "chatcmpl"
            )
        except Exception as exc:
            raise self._fail(span, tier, exc) from exc
        if body.stream:
            return await self._stream(call, self._chat_events(call, body.logprobs))
        collected = await self._collect(call)
        return _json(collected.chat(call.header, call.texts, body.logprobs))

    # ---------------------------------------------------------------------------- helpers

    def _start(
        self,
        request: Request,
        span: RequestSpan,
        tier: str,
        engine: EngineLike,
        prompt_ids: list[list[int]],
        params: list[SamplingParams],
        body: CompletionRequest | ChatCompletionRequest,
        id_prefix: str,
    ) -> _Call:
        grammar = params[0].grammar
        if grammar is not None and self._check_grammar is not None:
            self._check_grammar(engine, grammar)
        deadline = _deadline(request)
        options = RequestOptions(
            tier=Tier(tier) if tier else None,
            deadline=deadline.at,
            trace_context=span.trace_context,
        )
        generation = Generation(engine, prompt_ids, params, body.n, options)
        generation.start()
        name = engine.model_info.name
        header = Header(f"{id_prefix}-{os.urandom(12).hex()}", int(time.time()), name)
        options_usage = body.stream_options is not None and body.stream_options.include_usage
        return _Call(
            request=request, span=span, tier=tier, deadline=deadline, generation=generation,
            collected=Collected(generation.num_choices, [len(p) for p in prompt_ids], body.n),
            header=header, texts=self._token_texts(engine), stream=body.stream,
            include_usage=options_usage,
        )  # fmt: skip

    def _token_texts(self, engine: EngineLike) -> TokenTexts:
        if self._texts is None or self._texts[0] is not engine:
            self._texts = (engine, TokenTexts(engine.tokenizer))
        return self._texts[1]

    def _fail(self, span: RequestSpan, tier: str, exc: BaseException) -> HttpError:
        error = error_for_exception(exc, self._retry_after_s)
        span.finish(tier, error)
        return error

    def _finish_error(self, call: _Call, delta: RequestDelta) -> HttpError | None:
        return error_for_finish(
            delta,
            draining=self._engines.draining,
            deadline_passed=call.deadline.passed(),
            retry_after_s=self._retry_after_s,
        )

    async def _collect(self, call: _Call) -> Collected:
        """Every choice to its end (the whole answer), or the error that ended one."""
        error = None
        try:
            error = await until_disconnect(self._gather(call), call.request.receive)
        except ClientGone:
            error = _client_gone(call)
        except Exception as exc:
            error = error_for_exception(exc, self._retry_after_s)
        finally:
            _end(call, error)
        if error is not None:
            raise error
        return call.collected

    async def _gather(self, call: _Call) -> HttpError | None:
        async for index, delta in call.generation.deltas():
            error = self._finish_error(call, delta)
            if error is not None:
                return error
            call.collected.add(index, delta)
        return None

    async def _stream(self, call: _Call, events: AsyncGenerator[bytes, None]) -> Response:
        """SSE of `events` once its first event is there (an error before: a status)."""
        try:
            first = await until_disconnect(anext(events), call.request.receive)
        except ClientGone:
            await events.aclose()
            return Response(status_code=499)
        except HttpError as error:  # the first delta ended the request: answer with its status
            await events.aclose()
            raise error from None

        async def framed() -> AsyncIterator[bytes]:
            yield first
            async for chunk in events:
                yield chunk

        return SseResponse(framed())

    async def _events(
        self, call: _Call, chunk: Callable[[int, RequestDelta], str | None]
    ) -> AsyncGenerator[bytes, None]:
        """Framed chunks of every delta; raises `HttpError` only before the first one."""
        error: HttpError | None = None
        sent = False
        try:
            async for index, delta in call.generation.deltas():
                error = self._finish_error(call, delta)
                if error is not None:
                    if not sent:
                        raise error
                    yield event(error.body().model_dump_json())
                    break
                call.collected.add(index, delta)
                data = chunk(index, delta)
                if data is not None:
                    sent = True
                    yield event(data)
            if error is None and call.include_usage:
                yield event(self._usage_chunk(call))
            yield DONE
        except (asyncio.CancelledError, GeneratorExit):
            error = error or _client_gone(call)
            raise
        except HttpError as exc:
            error = exc
            raise
        except Exception as exc:
            error = error_for_exception(exc, self._retry_after_s)
            if sent:
                yield event(error.body().model_dump_json())
            else:
                raise error from exc
        finally:
            _end(call, error)

    @staticmethod
    def _usage_chunk(call: _Call) -> str:
        """The last chunk of `stream_options.include_usage`: no choices, the usage."""
        h, usage = call.header, call.collected.usage()
        kind = ChatCompletionChunk if h.id.startswith("chatcmpl") else CompletionResponse
        body = kind(id=h.id, created=h.created, model=h.model, choices=[], usage=usage)
        return body.model_dump_json()

    def _completion_events(
        self, call: _Call, echo: list[str | None] | None
    ) -> AsyncGenerator[bytes, None]:
        echoed: set[int] = set()
        n = call.generation.n

        def chunk(index: int, delta: RequestDelta) -> str | None:
            prefix = ""
            if echo is not None and index not in echoed:
                echoed.add(index)
                prefix = echo[index // n] or ""
            versions = call.collected.unsent_versions(index)
            out = completion_chunk(call.header, index, delta, call.texts, prefix, versions)
            return None if out is None else _sent(call, index, out)

        return self._events(call, chunk)

    def _chat_events(self, call: _Call, logprobs: bool) -> AsyncGenerator[bytes, None]:
        async def with_role() -> AsyncGenerator[bytes, None]:
            inner = self._events(call, chunk)
            try:
                first = await anext(inner)  # the engine's first answer (or its error)
                roles = chat_role_chunk(call.header, call.generation.num_choices)
                yield event(roles.model_dump_json())
                yield first
                async for data in inner:
                    yield data
            finally:
                await inner.aclose()

        def chunk(index: int, delta: RequestDelta) -> str | None:
            versions = call.collected.unsent_versions(index)
            out = chat_chunk(call.header, index, delta, call.texts, logprobs, versions)
            return None if out is None else _sent(call, index, out)

        return with_role()


def _sent(call: _Call, index: int, chunk: BaseModel) -> str:
    """`chunk` as JSON, its choice's token versions accounted for."""
    call.collected.mark_sent(index)
    return chunk.model_dump_json()


def _tier(body_tier: str | None, request: Request) -> str:
    """The request's tier name ("" = the daemon's default): the header wins over the body."""
    value = request.headers.get(TIER_HEADER, body_tier or "")
    if value and value not in {t.value for t in Tier}:
        raise bad_request(TIER_HEADER, f"must be gold, silver or bronze, got {value!r}")
    return value


def _deadline(request: Request) -> CallDeadline:
    """The request's deadline, from its header (the engine aborts it then)."""
    text = request.headers.get(TIMEOUT_HEADER)
    if text is None:
        return CallDeadline()
    try:
        ms = float(text)
    except ValueError:
        ms = -1.0
    if not ms > 0:
        raise bad_request(TIMEOUT_HEADER, f"must be a positive number of ms, got {text!r}")
    return CallDeadline.after(ms / 1e3)


def _client_gone(call: _Call) -> HttpError:
    """What a client that closed the connection counts as: its deadline, or a cancellation."""
    return deadline_exceeded() if call.deadline.explains_leaving() else client_closed()


def _end(call: _Call, error: HttpError | None) -> None:
    """Abort whatever of the request still runs (saying why), then count and end its span."""
    if error is not None and error.error_class == "deadline":
        call.generation.abort("deadline exceeded", EndReason.DEADLINE)
    else:
        call.generation.abort()
    call.span.finish(call.tier, error)


def _json(body: BaseModel) -> Response:
    return Response(body.model_dump_json(), media_type="application/json")
