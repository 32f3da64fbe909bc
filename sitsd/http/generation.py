"""The engine requests behind one HTTP request: `n` choices of each prompt, as one stream.

`Generation` adds the first choice of every prompt to the engine at once and the other `n - 1`
once the first has its first token: by then the prompt's full KV blocks are in the prefix cache,
so the siblings take them (reference-counted, shared) and compute only the prompt's last,
partial block. `deltas()` yields (choice index, `RequestDelta`) in the order the engine
produces them; choice `p * n + j` is choice `j` of prompt `p`. `abort()` ends every request
still running and frees its blocks; the handlers call it from a `finally`, so a client that
disconnects, a passed deadline or a failure all end the engine's work at once.

Turning deltas into OpenAI bodies is `sitsd.http.responses`'; which engine errors become which
statuses is `sitsd.http.errors`'.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from sitsd.api.inference import EngineLike, RequestStreamLike
from sitsd.http.sampling import for_choice
from sitsd.types import EndReason, RequestDelta, SamplingParams, Tier


@dataclass(frozen=True)
class RequestOptions:
    """What an HTTP request says besides its body (headers, the trace it continues)."""

    tier: Tier | None = None
    deadline: float | None = None  # time.monotonic() after which the engine aborts it
    trace_context: object | None = None  # the request's server span


class Generation:
    """The choices of one HTTP request in the engine; see the module docstring."""

    def __init__(
        self,
        engine: EngineLike,
        prompts: Sequence[list[int]],
        params: Sequence[SamplingParams],  # one per prompt
        n: int,
        options: RequestOptions,
    ) -> None:
        self._engine = engine
        self._prompts = prompts
        self._params = params
        self.n = n
        self.options = options
        self.streams: dict[int, RequestStreamLike] = {}  # choice index -> its request
        self._pumps: list[asyncio.Future[None]] = []  # one task per choice (n > 1, batches)

    @property
    def num_choices(self) -> int:
        return len(self._prompts) * self.n

    def start(self) -> None:
        """Add the first choice of every prompt; raises the engine's refusals (before any byte).

        Raises:
            InvalidRequestError, QueueFullError, OverloadedError, EngineStoppedError.
        """
        try:
            for prompt_index in range(len(self._prompts)):
                self._add(prompt_index * self.n)
        except Exception:
            self.abort()
            raise

    def _add(self, choice: int) -> RequestStreamLike:
        prompt_index, j = divmod(choice, self.n)
        stream = self._engine.add_request(
            self._prompts[prompt_index],
            for_choice(self._params[prompt_index], j),
            tier=self.options.tier,
            deadline=self.options.deadline,
            trace_context=self.options.trace_context,
        )
        self.streams[choice] = stream
        return stream

    def abort(
        self, reason: str = "cancelled by the client", cause: EndReason = EndReason.CANCELLED
    ) -> None:
        """Abort every request that has not finished (idempotent)."""
        for stream in self.streams.values():
            if not stream.finished:
                stream.abort(reason, cause)

    async def deltas(self) -> AsyncIterator[tuple[int, RequestDelta]]:
        """(choice index, delta) until every choice has finished."""
        if self.num_choices == 1:  # the common case: no task, no queue
            async for delta in self.streams[0]:
                yield 0, delta
            return
        queue: asyncio.Queue[tuple[int, RequestDelta] | BaseException] = asyncio.Queue()
        for choice in list(self.streams):
            self._pumps.append(asyncio.ensure_future(self._pump(choice, queue)))
        num_finished = 0
        try:
            while num_finished < self.num_choices:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                if item[1].finished:
                    num_finished += 1
                yield item
        finally:
            for pump in self._pumps:
                pump.cancel()

    async def _pump(
        self, choice: int, queue: asyncio.Queue[tuple[int, RequestDelta] | BaseException]
    ) -> None:
        siblings_due = self.n > 1 and choice % self.n == 0
        try:
            async for delta in self.streams[choice]:
                queue.put_nowait((choice, delta))
                if siblings_due:  # the prompt's KV is cached now: the siblings share it
                    siblings_due = False
                    for sibling in range(choice + 1, choice + self.n):
                        self._add(sibling)
                        self._pumps.append(asyncio.ensure_future(self._pump(sibling, queue)))
        except Exception as exc:  # a sibling refused (queue full): the whole request fails
            queue.put_nowait(exc)
