"""A test double of `sitsd.engine.async_engine.AsyncEngine` for the API and sitsctl tests.

It keeps the real engine's contract: the same validation (`sitsd.engine.validation`) and
exceptions from `add_request` (`InvalidRequestError` naming the field, `QueueFullError`,
`EngineStoppedError`), a stream of `RequestDelta`s whose last one has `finish_reason` and
`usage`, idempotent `abort()` that ends the stream with ABORT, `shutdown(grace_s)` that stops
admitting and waits for live requests.
Admission control is mimicked by `refuse_with` (refused in `add_request`) and `shed_with`
(the stream ends at once with ABORT and `AbortCause.OVERLOADED`). Instead of a model it
"generates" the characters of `completion`, one token per delta, with a character-level
tokenizer (token id = code point). It records what it was asked: `requests`, `aborts`, and
blocks held by live requests in `status()`.
"""

from __future__ import annotations

import asyncio
import itertools
import math
from collections.abc import AsyncIterator
from dataclasses import dataclass

from sitsd.engine.errors import (
    EngineStoppedError,
    InvalidRequestError,
    OverloadedError,
    QueueFullError,
)
from sitsd.engine.validation import validate_request
from sitsd.outputs import EngineStatus, ModelInfo, TierStats
from sitsd.types import (
    AbortCause,
    EndReason,
    FinishReason,
    RequestDelta,
    SamplingParams,
    Tier,
    Usage,
)

BOS_TOKEN_ID = 1
EOS_TOKEN_ID = 2


# What `status()` reports for the tiers: gold has P99s, silver and bronze have no samples yet.
FAKE_TIERS = (
    TierStats("gold", 0.08, 0.08, 0.12, 32, 1, 0, 0.095, 0.041, 12, 3, 1, 0),
    TierStats("silver", 0.2, 0.2, 0.25, 4, 0, 0, None, None, 0, 0, 0, 0),
    TierStats("bronze", 1.0, 1.0, 0.5, 4, 0, 2, None, None, 0, 7, 0, 5),
)


class FakeChatTemplateError(ValueError):
    """What `sitsd.weights.ChatTemplateError` is: a ValueError the template raised."""


class FakeTokenizer:
    """Character-level: token id = code point; BOS is prepended with special tokens."""

    def __init__(self) -> None:
        self.has_chat_template = True
        self.eos_token_ids = (EOS_TOKEN_ID,)
        self.rendered: list[str] = []  # every string apply_chat_template returned

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = [ord(c) for c in text]
        return [BOS_TOKEN_ID, *ids] if add_special_tokens else ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(i) for i in ids if i > EOS_TOKEN_ID)

    def apply_chat_template(
        self, messages: list[dict[str, str]], add_generation_prompt: bool = True
    ) -> str:
        for message in messages:
            if message["role"] not in ("system", "user", "assistant"):
                raise FakeChatTemplateError(f"unknown role {message['role']!r}")
        text = "".join(f"<{m['role']}>{m['content']}\n" for m in messages)
        text += "<assistant>" if add_generation_prompt else ""
        self.rendered.append(text)
        return text


@dataclass
class RecordedRequest:
    prompt_token_ids: list[int]
    params: SamplingParams
    tier: Tier | None
    deadline: float | None


class FakeStream:
    """One request's deltas; mirrors `RequestStream`."""

    def __init__(self, engine: FakeEngine, req_id: str, record: RecordedRequest) -> None:
        self.req_id = req_id
        self._engine = engine
        self._record = record
        self._aborted = asyncio.Event()
        self._abort_reason = ""
        self._finished = False
        self.num_output_tokens = 0

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        engine, params = self._engine, self._record.params
        completion = engine.completion
        if engine.shed_with is not None:  # dropped by the engine thread before it ran
            yield self._finish(
                FinishReason.ABORT, error=engine.shed_with, cause=AbortCause.OVERLOADED
            )
            return
        while not self._finished:
            n = self.num_output_tokens
            if engine.stalls_at(n):
                await self._wait_for_abort_or_release()  # a request stuck in the queue
            else:
                await asyncio.sleep(0)  # one "engine step": let other tasks (aborts) run
            if self._aborted.is_set():
                yield self._finish(FinishReason.ABORT, error=self._abort_reason)
                return
            if engine.fail_after is not None and n >= engine.fail_after:
                yield self._finish(FinishReason.ERROR, error="fake model step failed")
                return
            char = completion[n % len(completion)]
            self.num_output_tokens += 1
            switch = engine.version_switch
            version = switch[1] if switch is not None and n >= switch[0] else engine.weights_version
            delta = RequestDelta(self.req_id, [ord(char)], char, weights_version=version)
            if self.num_output_tokens >= params.max_tokens:
                delta = self._finish(FinishReason.LENGTH, delta=delta)
            elif self.num_output_tokens == len(completion) and not params.ignore_eos:
                delta = self._finish(FinishReason.STOP, delta=delta)
            yield delta

    async def _wait_for_abort_or_release(self) -> None:
        waiters = [
            asyncio.ensure_future(self._aborted.wait()),
            asyncio.ensure_future(self._engine._released.wait()),
        ]
        try:
            await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    def _finish(
        self,
        reason: FinishReason,
        *,
        error: str = "",
        delta: RequestDelta | None = None,
        cause: AbortCause | None = None,
    ) -> RequestDelta:
        self._finished = True
        self._engine._live.pop(self.req_id, None)
        delta = delta or RequestDelta(self.req_id, weights_version=self._engine.weights_version)
        delta.finish_reason = reason
        delta.error = error
        delta.abort_cause = cause
        delta.usage = Usage(len(self._record.prompt_token_ids), self.num_output_tokens, 0)
        return delta

    def abort(
        self, reason: str = "cancelled by the client", cause: EndReason = EndReason.CANCELLED
    ) -> None:
        if self._finished or self._aborted.is_set():
            return
        self._engine.aborts[self.req_id] = reason
        self._engine.abort_causes[self.req_id] = cause
        self._engine._live.pop(self.req_id, None)  # the engine frees the blocks at once
        self._abort_reason = reason
        self._aborted.set()

    @property
    def finished(self) -> bool:
        return self._finished


class FakeEngine:
    """Stands in for `AsyncEngine`; knobs: `completion`, `stall_after`, `fail_after`."""

    def __init__(
        self,
        *,
        max_model_len: int = 64,
        vocab_size: int = 512,
        max_num_live_requests: int = 8,
        block_size: int = 4,
        completion: str = "Hello, world!",
    ) -> None:
        self.model_info = ModelInfo(
            name="fake-model",
            max_model_len=max_model_len,
            vocab_size=vocab_size,
            architecture="llama",
            dtype="float32",
            device="cpu",
            path="/nonexistent/fake",
            max_token_bytes=4,  # a character per token
        )
        self.tokenizer = FakeTokenizer()
        self.weights_version = "fake-v1"
        self.version_switch: tuple[int, str] | None = None  # (tokens, version): later ones its
        self.completion = completion
        self.stall_after: int | None = None  # tokens after which streams wait for abort/release
        self.fail_after: int | None = None  # tokens after which a stream ends with ERROR
        self.refuse_with: str | None = None  # add_request raises OverloadedError(this)
        self.shed_with: str | None = None  # streams end at once: ABORT, cause OVERLOADED
        self.max_num_live_requests = max_num_live_requests
        self.block_size = block_size
        self.requests: dict[str, RecordedRequest] = {}
        self.aborts: dict[str, str] = {}  # req_id -> reason
        self.abort_causes: dict[str, EndReason] = {}  # req_id -> what the API said happened
        self._live: dict[str, FakeStream] = {}
        self._ids = itertools.count()
        self._accepting = False

    async def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._released = asyncio.Event()
        self._accepting = True

    def stalls_at(self, num_output_tokens: int) -> bool:
        return (
            self.stall_after is not None
            and num_output_tokens >= self.stall_after
            and not self._released.is_set()
        )

    def release(self) -> None:
        """From any thread: let stalled streams run to their end."""
        self._loop.call_soon_threadsafe(self._released.set)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        self._accepting = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace_s
        while self._live and loop.time() < deadline:
            await asyncio.sleep(0.01)  # the real engine polls the same way
        for stream in list(self._live.values()):
            stream.abort("the daemon is shutting down")

    @property
    def accepting(self) -> bool:
        return self._accepting

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        req_id: str | None = None,
        tier: Tier | None = None,
        deadline: float | None = None,
        trace_context: object | None = None,
    ) -> FakeStream:
        if not self._accepting:
            raise EngineStoppedError("the engine is not accepting requests")
        params = validate_request(prompt_token_ids, params, self.model_info)
        if len(self._live) >= self.max_num_live_requests:
            raise QueueFullError(f"{len(self._live)} requests are in flight; retry later")
        if self.refuse_with is not None:
            raise OverloadedError(self.refuse_with)
        if req_id is None:
            req_id = f"fake-{next(self._ids)}"
        elif req_id in self._live:
            raise InvalidRequestError("request_id", f"{req_id!r} is already in flight")
        record = RecordedRequest(list(prompt_token_ids), params, tier, deadline)
        self.requests[req_id] = record
        stream = FakeStream(self, req_id, record)
        self._live[req_id] = stream
        return stream

    def status(self) -> EngineStatus:
        num_blocks_used = sum(
            math.ceil(
                (len(self.requests[r].prompt_token_ids) + s.num_output_tokens) / self.block_size
            )
            for r, s in self._live.items()
        )
        return EngineStatus(
            model=self.model_info.name,
            weights_version=self.weights_version,
            num_running=len(self._live),
            num_waiting=0,
            num_blocks_used=num_blocks_used,
            num_blocks_total=128,
            block_size=self.block_size,
            prefix_cache_queries=10,
            prefix_cache_hits=4,
            num_preemptions=0,
            num_steps=7,
            scheduling_policy="tiers",
            tiers=FAKE_TIERS,
        )
