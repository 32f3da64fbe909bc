"""Server interceptors (admin auth, request decoding, errors) and the one mapping from failures
to gRPC statuses.

- `status_for_exception` and `status_for_finish` are the only places that decide which gRPC status
  a failure becomes: an engine exception raised by a servicer, or a request the engine ended with
  ABORT or ERROR.
- `ErrorInterceptor` wraps the sitsd servicers so an exception they raise becomes that status;
  anything unexpected is INTERNAL, logged with its traceback, and the daemon keeps serving.
- `AdminAuthInterceptor` refuses Admin RPCs without the right bearer token before the servicer
  runs, so a refused call does nothing.
- `RequestDecodingInterceptor` makes request bytes that do not parse (bad UTF-8, truncated,
  garbage, nested too deep) INVALID_ARGUMENT on every service, where grpc would answer UNKNOWN
  and log a traceback per call, and holds every method but a push's to gRPC's default size.
- `replace_behavior` wraps a method handler's behavior; these interceptors and
  `sitsd.api.telemetry`'s use it.

Servicers raise; they never pick status codes themselves. Health and reflection pass untouched,
but for their request decoding. Lines a client can cause are logged at a bounded rate.
"""

from __future__ import annotations

import hmac
import inspect
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio

from sitsd.engine.errors import (
    EngineStoppedError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
)
from sitsd.observability.log_limit import RateLimitedLog
from sitsd.types import AbortCause, FinishReason, RequestDelta
from sitsd.weights.errors import (
    GroupJoinError,
    InvalidVersionIdError,
    SwapFailedError,
    SwapRefusedError,
    UnknownVersionError,
    VersionConflictError,
)

log = logging.getLogger(__name__)

SITSD_METHOD_PREFIX = "/sitsd.api.v1."
ADMIN_METHOD_PREFIX = "/sitsd.api.v1.Admin/"

_EXCEPTION_STATUS: tuple[tuple[type[Exception], grpc.StatusCode], ...] = (
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),  # message starts with the field
    (ModelNotFoundError, grpc.StatusCode.NOT_FOUND),
    (QueueFullError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (EngineStoppedError, grpc.StatusCode.UNAVAILABLE),  # loading, or shutting down
    (InvalidVersionIdError, grpc.StatusCode.INVALID_ARGUMENT),
    (UnknownVersionError, grpc.StatusCode.NOT_FOUND),
    (VersionConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (SwapRefusedError, grpc.StatusCode.FAILED_PRECONDITION),  # rejected versions too
    (SwapFailedError, grpc.StatusCode.ABORTED),
    (GroupJoinError, grpc.StatusCode.FAILED_PRECONDITION),  # the trainer is not there (yet)
)


def status_for_exception(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status and message an exception raised while serving an RPC becomes."""
    for exc_type, code in _EXCEPTION_STATUS:
        if isinstance(exc, exc_type):
            return code, str(exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}: {exc}"


def status_for_finish(
    delta: RequestDelta, *, draining: bool, deadline_passed: bool
) -> tuple[grpc.StatusCode, str] | None:
    """The status that ends a Generate call whose request the engine stopped; None if it ended well.

    Args:
        delta: the request's last delta.
        draining: the daemon is shutting down.
        deadline_passed: the call's gRPC deadline has passed.
    """
    if delta.finish_reason is FinishReason.ERROR:
        return grpc.StatusCode.INTERNAL, delta.error or "the engine failed serving the request"
    if delta.finish_reason is not FinishReason.ABORT:
        return None
    if delta.abort_cause is AbortCause.OVERLOADED:  # admission control or the tier queue limit
        return grpc.StatusCode.RESOURCE_EXHAUSTED, delta.error or "overloaded; retry later"
    if draining:
        return grpc.StatusCode.UNAVAILABLE, "the daemon is shutting down; the request was aborted"
    if (
        deadline_passed
        or delta.abort_cause is AbortCause.DEADLINE
        or delta.error == "deadline exceeded"  # the API's own abort after the call's deadline
    ):
        return grpc.StatusCode.DEADLINE_EXCEEDED, "deadline exceeded; the request was aborted"
    return grpc.StatusCode.ABORTED, delta.error or "the request was aborted"


# A behavior of a grpc method handler: (request, context) -> response or response iterator.
Behavior = Callable[[Any, grpc.aio.ServicerContext], Any]


def replace_behavior(
    handler: grpc.RpcMethodHandler,
    wrap_unary: Callable[[Behavior], Behavior],
    wrap_stream: Callable[[Behavior], Behavior],
) -> grpc.RpcMethodHandler:
    """A copy of `handler` with its behavior wrapped (unary or server-streaming responses)."""
    # grpc's method handlers are namedtuples; exactly one behavior field is set.
    for name in ("unary_unary", "stream_unary"):
        behavior = getattr(handler, name)
        if behavior is not None:
            return handler._replace(**{name: wrap_unary(behavior)})
    for name in ("unary_stream", "stream_stream"):
        behavior = getattr(handler, name)
        if behavior is not None:
            return handler._replace(**{name: wrap_stream(behavior)})
    return handler


async def _abort_for(exc: Exception, context: grpc.aio.ServicerContext, method: str) -> None:
    code, message = status_for_exception(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("%s failed", method, exc_info=exc)
    # A refusal is logged once, by the telemetry interceptor ("rpc failed", at a bounded rate).
    await context.abort(code, message)


@dataclass(frozen=True)
class MalformedRequest:
    """What a guarded deserializer hands the behavior for bytes that do not parse, or more
    bytes than the method takes.

    grpc itself would answer UNKNOWN and log an error-level traceback for each such call.
    """

    reason: str  # the parser's words, or the size

    @property
    def message(self) -> str:
        return f"request: {self.reason}"


def _guarded_deserializer(
    deserialize: Callable[[bytes], Any] | None, max_bytes: int
) -> Callable[[bytes], Any]:
    def guarded(data: bytes) -> Any:
        if len(data) > max_bytes:
            return MalformedRequest(f"{len(data)} bytes, more than the {max_bytes} it may have")
        try:
            return data if deserialize is None else deserialize(data)
        except Exception as exc:  # DecodeError: bad UTF-8, truncated, garbage, nested too deep
            return MalformedRequest(f"the message does not parse: {str(exc) or type(exc).__name__}")

    return guarded


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):
    """Request bytes that do not parse are INVALID_ARGUMENT, for every service (health too),
    and so is a message over `max_message_bytes` (gRPC's own default limit), but for the
    methods `larger` names (the server's limit holds those).

    The handler's deserializer returns a `MalformedRequest` instead of raising, and the
    behavior aborts on one (for request streams, at the message that does not parse). sitsd's
    own methods are logged by the telemetry interceptor; others here, at a bounded rate.
    """

    def __init__(
        self, max_message_bytes: int = 4 * 2**20, larger: Mapping[str, int] | None = None
    ) -> None:
        self._log = RateLimitedLog(log)
        self._max_message_bytes = max_message_bytes
        self._larger = dict(larger or {})  # method -> its limit

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None:
            return handler
        method = handler_call_details.method

        async def refuse(malformed: MalformedRequest, context: grpc.aio.ServicerContext) -> None:
            if not method.startswith(SITSD_METHOD_PREFIX):
                self._log.log(logging.INFO, method, "%s refused: %s", method, malformed.message)
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, malformed.message)

        max_bytes = self._larger.get(method, self._max_message_bytes)
        changes: dict[str, Any] = {
            "request_deserializer": _guarded_deserializer(handler.request_deserializer, max_bytes)
        }
        if handler.unary_unary is not None:
            changes["unary_unary"] = _checked_unary(handler.unary_unary, refuse)
        elif handler.unary_stream is not None:
            changes["unary_stream"] = _checked_unary(handler.unary_stream, refuse)
        elif handler.stream_unary is not None:
            changes["stream_unary"] = _checked_stream(handler.stream_unary, refuse)
        elif handler.stream_stream is not None:
            changes["stream_stream"] = _checked_stream(handler.stream_stream, refuse)
        return handler._replace(**changes)


Refuse = Callable[[MalformedRequest, grpc.aio.ServicerContext], Awaitable[None]]


def _checked_unary(behavior: Behavior, refuse: Refuse) -> Behavior:
    """`behavior` (one request in) refusing a `MalformedRequest` before it runs."""
    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(request: Any, context: grpc.aio.ServicerContext) -> Any:
            if isinstance(request, MalformedRequest):
                await refuse(request, context)
            async for response in behavior(request, context):
                yield response

        return checked_stream

    async def checked(request: Any, context: grpc.aio.ServicerContext) -> Any:
        if isinstance(request, MalformedRequest):
            await refuse(request, context)
        return await behavior(request, context)

    return checked


def _checked_stream(behavior: Behavior, refuse: Refuse) -> Behavior:
    """`behavior` (a stream of requests in) refusing at the first `MalformedRequest`."""

    def checked_requests(
        requests: AsyncIterator[Any], context: grpc.aio.ServicerContext
    ) -> AsyncIterator[Any]:
        async def each() -> AsyncIterator[Any]:
            async for request in requests:
                if isinstance(request, MalformedRequest):
                    await refuse(request, context)
                yield request

        return each()

    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(requests: Any, context: grpc.aio.ServicerContext) -> Any:
            async for response in behavior(checked_requests(requests, context), context):
                yield response

        return checked_stream

    async def checked(requests: Any, context: grpc.aio.ServicerContext) -> Any:
        return await behavior(checked_requests(requests, context), context)

    return checked


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Turns exceptions raised by sitsd servicers into gRPC statuses (`status_for_exception`)."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method
        if handler is None or not method.startswith(SITSD_METHOD_PREFIX):
            return handler

        def wrap_unary(behavior: Behavior) -> Behavior:
            async def guarded(request: Any, context: grpc.aio.ServicerContext) -> Any:
                try:
                    return await behavior(request, context)
                except grpc.aio.AbortError:
                    raise  # the servicer chose its status already
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return guarded

        def wrap_stream(behavior: Behavior) -> Behavior:
            if not inspect.isasyncgenfunction(behavior):
                return behavior  # writes through context.write(); none of ours does

            async def guarded_stream(
                request: Any, context: grpc.aio.ServicerContext
            ) -> AsyncIterator[Any]:
                try:
                    async for response in behavior(request, context):
                        yield response
                except grpc.aio.AbortError:
                    raise
                except Exception as exc:
                    await _abort_for(exc, context, method)

            return guarded_stream

        return replace_behavior(handler, wrap_unary, wrap_stream)


class AdminAuthInterceptor(grpc.aio.ServerInterceptor):
    """Admin RPCs need `authorization: Bearer <token>`; others pass untouched.

    A refusal says which it was (no token, another scheme, a wrong token) and never what the
    right token is or how close a guess came.
    """

    def __init__(self, token: str) -> None:
        """Args: token: the bearer token Admin RPCs must present; must not be empty."""
        if not token:
            raise ValueError("the admin token must not be empty")
        self._expected = token.encode()
        self._log = RateLimitedLog(log)

    def refusal(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
        """Why `metadata` is refused for an Admin RPC; None when it holds the right token."""
        for key, value in metadata or ():
            if key.lower() != "authorization":
                continue
            presented = value if isinstance(value, bytes) else value.encode()
            scheme, _, token = presented.strip().partition(b" ")
            if scheme.lower() != b"bearer":
                return "the authorization metadata must be 'Bearer <admin token>'"
            # Constant-time: the comparison must not tell an attacker how much of a guess is right.
            if hmac.compare_digest(token.strip(), self._expected):
                return None
            return (
                "the admin token is wrong: it is not this daemon's (sitsctl reads the daemon's "
                "from its state directory, --token-file or $SITSD_ADMIN_TOKEN)"
            )
        return "no admin token: Admin RPCs need the metadata 'authorization: Bearer <admin token>'"

    def authorized(self, metadata: Sequence[tuple[str, str | bytes]] | None) -> bool:
        """True when `metadata` holds the right `authorization` header."""
        return self.refusal(metadata) is None

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(ADMIN_METHOD_PREFIX):
            return handler
        message = self.refusal(handler_call_details.invocation_metadata)
        if message is None:
            return handler
        method = handler_call_details.method
        self._log.log(logging.WARNING, (method, message), "refused %s: %s", method, message)

        async def deny(request: Any, context: grpc.aio.ServicerContext) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

        async def deny_stream(
            request: Any, context: grpc.aio.ServicerContext
        ) -> AsyncIterator[Any]:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)
            yield  # unreachable: makes this an async generator like the behavior it replaces

        return replace_behavior(handler, lambda _: deny, lambda _: deny_stream)
