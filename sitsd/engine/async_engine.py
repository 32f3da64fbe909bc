"""The asyncio face of the engine: requests in, streams of `RequestDelta`s out.

`AsyncEngine` lives on the asyncio event loop of the API layer. It validates a request, puts an
`AddRequest` on the engine core's inbox and hands back a `RequestStream`; the engine thread
posts each step's deltas back with `loop.call_soon_threadsafe`. Hot-swap crosses threads
through its own door, `swap_port()` (`sitsd.engine.swap_port`). Model execution and scheduling
are `EngineCore`'s business (`sitsd.engine.core`); this module only crosses threads.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time
from collections import deque
from collections.abc import AsyncIterator

from sitsd.engine.core import EngineCore
from sitsd.engine.errors import (
    EngineStoppedError,
    InvalidRequestError,
    OverloadedError,
    QueueFullError,
)
from sitsd.engine.messages import AbortRequest, AddRequest
from sitsd.engine.swap_port import SwapPort
from sitsd.engine.validation import validate_request
from sitsd.outputs import EngineStatus, ModelInfo
from sitsd.types import EndReason, FinishReason, RequestDelta, SamplingParams, Tier


class RequestStream:
    """An async iterator over one request's deltas; `abort()` cancels the request.

    A consumer that falls behind (the event loop busy streaming to many clients) gets the
    deltas that piled up as one: fewer, larger messages exactly when sending them is what
    lags. Deltas of different weights versions are never joined, so every token keeps the
    version that produced it.
    """

    def __init__(self, engine: AsyncEngine, req_id: str, num_prompt_tokens: int) -> None:
        self.req_id = req_id
        self.num_prompt_tokens = num_prompt_tokens
        self._engine = engine
        self._pending: deque[RequestDelta] = deque()
        self._ready = asyncio.Event()
        self._finished = False
        self.aborted = False  # abort() was called: on its way out, no longer in flight

    def _put(self, delta: RequestDelta) -> None:
        self._pending.append(delta)
        self._ready.set()

    def __aiter__(self) -> AsyncIterator[RequestDelta]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[RequestDelta]:
        pending = self._pending
        while not self._finished:
            if not pending:
                self._ready.clear()
                await self._ready.wait()
                continue
            delta = pending.popleft()
            while pending and not delta.finished:
                if pending[0].weights_version != delta.weights_version:
                    break
                delta = delta.followed_by(pending.popleft())
            if delta.finished:
                self._finished = True
            yield delta

    def abort(
        self, reason: str = "cancelled by the client", cause: EndReason = EndReason.CANCELLED
    ) -> None:
        """Cancel the request (`cause`: what happened, for telemetry); its blocks are freed
        by the engine. Idempotent."""
        if not self._finished:
            self._engine._abort(self, reason, cause)

    @property
    def finished(self) -> bool:
        return self._finished


class AsyncEngine:
    """Thread-safe bridge between the API's event loop and the engine core's thread."""

    def __init__(self, core: EngineCore, model_info: ModelInfo) -> None:
        self.core = core
        self.model_info = model_info
        self.tokenizer = core.tokenizer
        self._streams: dict[str, RequestStream] = {}
        self._num_aborted = 0  # of `_streams`, those aborted and waiting for their last delta
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ids = itertools.count()
        self._id_prefix = os.urandom(4).hex()
        self._accepting = False

    # ----------------------------------------------------------------------------- lifecycle

    async def start(self) -> None:
        """Start the engine thread; deltas are delivered on the calling event loop."""
        self.bind(asyncio.get_running_loop())
        self.core.start(on_deltas=self._on_deltas_threadsafe)

    def bind(self, loop: asyncio.AbstractEventLoop) -> None:
        """Deliver deltas on `loop` and accept requests (the loop runs elsewhere: `run_core`)."""
        self._loop = loop
        self._accepting = True

    def run_core(self) -> None:
        """Run the engine loop on the calling thread (see `sitsd.builder.launch_engine`)."""
        self.core.run(self._on_deltas_threadsafe)

    async def shutdown(self, grace_s: float = 30.0) -> None:
        """Stop admitting, let in-flight requests finish for up to `grace_s`, then stop."""
        self._accepting = False
        deadline = time.monotonic() + grace_s
        while self._streams and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        for stream in list(self._streams.values()):
            stream.abort("the daemon is shutting down", EndReason.SHUTDOWN)
        await asyncio.to_thread(self.core.stop)
        # The engine thread has gone: finish any stream it could not answer.
        for req_id in list(self._streams):
            self._deliver(
                [
                    RequestDelta(
                        req_id,
                        finish_reason=FinishReason.ABORT,
                        error="the daemon is shutting down",
                    )
                ]
            )

    @property
    def accepting(self) -> bool:
        return self._accepting

    # ------------------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        req_id: str | None = None,
        tier: Tier | None = None,
        deadline: float | None = None,
        trace_context: object | None = None,
    ) -> RequestStream:
        """Queue a request and return the stream of its deltas.

        Args:
            prompt_token_ids: the tokenized prompt (chat template already applied).
            params: sampling parameters; validated here (`validate_request`, which may
                normalize them: a top_k past the vocabulary runs as no top_k).
            req_id: the caller's id; must be unique among live requests. Generated if None.
            tier: SLA tier; None = the configured default.
            deadline: `time.monotonic()` after which the request is aborted.
            trace_context: an OpenTelemetry context the engine's spans continue.

        Raises:
            InvalidRequestError: a field is out of range (its name is in `.field`).
            QueueFullError: too many requests are waiting.
            OverloadedError: admission control expects the tier's queue wait to be broken.
            EngineStoppedError: the engine is not accepting requests.
        """
        if not self._accepting or self._loop is None:
            raise EngineStoppedError("the engine is not accepting requests")
        params = validate_request(prompt_token_ids, params, self.model_info)
        # Aborted streams are not in flight: the engine takes their abort before this add.
        num_in_flight = len(self._streams) - self._num_aborted
        if num_in_flight >= self.core.max_num_live_requests:
            raise QueueFullError(
                f"{num_in_flight} requests are in flight, the limit is "
                f"{self.core.max_num_live_requests}; retry later"
            )
        if req_id is None:
            req_id = f"{self._id_prefix}-{next(self._ids)}"
        elif req_id in self._streams:
            raise InvalidRequestError("request_id", f"{req_id!r} is already in flight")
        elif "\x00" in req_id:  # the engine names migration shadows with it
            raise InvalidRequestError("request_id", "must not contain a NUL character")
        message = AddRequest(
            req_id=req_id,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            tier=tier,
            deadline=deadline,
            arrival_time=time.monotonic(),
            trace_context=trace_context,
        )
        refusal = self.core.admission_refusal(message)
        if refusal is not None:
            raise OverloadedError(refusal.message)
        stream = RequestStream(self, req_id, len(prompt_token_ids))
        self._streams[req_id] = stream
        self.core.submit(message)
        return stream

    def _abort(self, stream: RequestStream, reason: str, cause: EndReason) -> None:
        if stream.aborted:
            return  # told the engine already
        stream.aborted = True
        if self._streams.get(stream.req_id) is stream:  # not finished yet
            self._num_aborted += 1
        self.core.submit(AbortRequest(stream.req_id, reason, cause))

    # ------------------------------------------------------------------------------- outputs

    def _on_deltas_threadsafe(self, deltas: list[RequestDelta]) -> None:
        """Called on the engine thread; hops to the event loop."""
        loop = self._loop
        if loop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(self._deliver, deltas)

    def _deliver(self, deltas: list[RequestDelta]) -> None:
        for delta in deltas:
            stream = self._streams.get(delta.req_id)
            if stream is None:
                continue
            if delta.finished:
                del self._streams[delta.req_id]
                self._num_aborted -= stream.aborted  # counted while it was in `_streams`
            stream._put(delta)

    # ---------------------------------------------------------------------------- hot-swap

    def swap_port(self) -> SwapPort:
        """The engine's hot-swap operations, for the weights subsystem (`SwapPort`)."""
        return SwapPort(self.core)

    # -------------------------------------------------------------------------------- status

    def status(self) -> EngineStatus:
        """A consistent snapshot of the engine state (read under the core's lock)."""
        return self.core.status()

    @property
    def num_live_requests(self) -> int:
        return len(self._streams)
