"""Server-Sent Events, and ending a request's work when its client goes away.

`SseResponse` streams an async iterator of events as `data: ...` lines and watches the
connection meanwhile: when the client disconnects, the iterator is cancelled at once (not at
the next token), so the handler's `finally` aborts the engine requests and their blocks are
freed. `until_disconnect` does the same for an answer that is not streamed: it runs a
coroutine and cancels it if the client leaves first. What the events say is the handlers'.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")

DONE = b"data: [DONE]\n\n"


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def event(data: str) -> bytes:
    """One SSE event carrying `data` (a JSON text: it has no newline)."""
    return b"data: " + data.encode() + b"\n\n"


async def wait_for_disconnect(receive: Receive) -> None:
    """Return once the client has disconnected (the request body was read already)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnect(work: Awaitable[T], receive: Receive) -> T:
    """The result of `work`, or `ClientGone` (with `work` cancelled) if the client leaves."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        await asyncio.wait((task, watcher), return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


class SseResponse(Response):
    """`text/event-stream` of `events` (already framed bytes); cancelled on disconnect."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[bytes], headers: dict[str, str] | None = None):
        # Not Response.__init__: it would declare the length of an empty body.
        self.status_code = 200
        self.background = None
        self.init_headers(
            {"cache-control": "no-cache", "x-accel-buffering": "no", **(headers or {})}
        )
        self._events = events

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        streaming = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait((streaming, watcher), return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            streaming.cancel()
            with contextlib.suppress(asyncio.CancelledError, OSError):
                await streaming  # its cancellation runs the events' `finally`
            aclose = getattr(self._events, "aclose", None)
            if aclose is not None:
                await aclose()

    async def _stream(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        async for chunk in self._events:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
