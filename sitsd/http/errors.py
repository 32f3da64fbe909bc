"""The one mapping from failures to HTTP answers in OpenAI's error shape.

`{"error": {"message", "type", "param", "code"}}` with the status clients act on: 400 for a bad
parameter (FastAPI's 422 never leaves the server), 401 without a valid API key, 404 for an
unknown model or path, 429 with `Retry-After` when the queue is full or a tier refuses, 503
while the model loads or the daemon drains, 504 when the request's deadline passes, 500 for a
failure of sitsd's own. `error_for_exception` covers what a handler raises before the first
byte; `error_for_finish` a request the engine ended with ABORT or ERROR (mid-stream it becomes
an `error` event, which the `openai` client raises as an `APIError`).

Which error class a failure counts as in the metrics is `error_class` here too, with the names
the gRPC side uses, so one dashboard reads both protocols.
"""

from __future__ import annotations

from dataclasses import dataclass

from sitsd.engine.errors import (
    EngineStoppedError,
    InvalidRequestError,
    ModelNotFoundError,
    QueueFullError,
)
from sitsd.http.protocol import ErrorInfo, ErrorResponse
from sitsd.types import AbortCause, FinishReason, RequestDelta


@dataclass(eq=False)  # not frozen: raising sets `__traceback__`, which a frozen one refuses
class HttpError(Exception):
    """An answer other than 200: raised by the handlers, written by the app's handler.

    Create one per answer (a shared instance would collect every raise's traceback).
    """

    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None
    retry_after_s: int | None = None  # sets Retry-After

    def body(self) -> ErrorResponse:
        info = ErrorInfo(message=self.message, type=self.type, param=self.param, code=self.code)
        return ErrorResponse(error=info)

    def headers(self) -> dict[str, str]:
        return {} if self.retry_after_s is None else {"retry-after": str(self.retry_after_s)}

    @property
    def error_class(self) -> str:
        """The error class of the request metrics (`sitsd_request_errors_total`)."""
        return _ERROR_CLASSES.get(self.status, "internal")


_ERROR_CLASSES = {
    400: "invalid_argument",
    401: "unauthenticated",
    404: "not_found",
    429: "resource_exhausted",
    499: "cancelled",
    503: "unavailable",
    504: "deadline",
}


def bad_request(param: str, message: str) -> HttpError:
    """400 naming `param`; `message` is prefixed with it, as the engine's errors are."""
    return HttpError(400, f"{param}: {message}", param=param, code="invalid_parameter")


def unauthorized(message: str) -> HttpError:
    """401: `message` says whether the key was missing or wrong (never which key is right)."""
    return HttpError(401, message, type="authentication_error", code="invalid_api_key")


def not_found(path: str) -> HttpError:
    return HttpError(404, f"no such route: {path}", code="not_found")


def error_for_exception(exc: BaseException, retry_after_s: int) -> HttpError:
    """The answer for an exception raised while serving a request, before its first byte."""
    if isinstance(exc, HttpError):
        return exc
    if isinstance(exc, InvalidRequestError):
        return HttpError(400, str(exc), param=exc.field, code="invalid_parameter")
    if isinstance(exc, ModelNotFoundError):
        return HttpError(404, str(exc), param="model", code="model_not_found")
    if isinstance(exc, QueueFullError):  # OverloadedError too: a tier's admission control
        return HttpError(
            429, str(exc), type="rate_limit_error", code="rate_limit_exceeded",
            retry_after_s=retry_after_s,
        )  # fmt: skip
    if isinstance(exc, EngineStoppedError):
        return HttpError(
            503, str(exc), type="server_error", code="unavailable", retry_after_s=retry_after_s
        )
    return HttpError(
        500, f"internal error: {type(exc).__name__}: {exc}", type="server_error", code="internal"
    )


def error_for_finish(
    delta: RequestDelta, *, draining: bool, deadline_passed: bool, retry_after_s: int
) -> HttpError | None:
    """The error a request the engine stopped ends with; None if it ended well (stop, length)."""
    if delta.finish_reason is FinishReason.ERROR:
        message = delta.error or "the engine failed serving the request"
        return HttpError(500, message, type="server_error", code="internal")
    if delta.finish_reason is not FinishReason.ABORT:
        return None
    if delta.abort_cause is AbortCause.OVERLOADED:
        return HttpError(
            429, delta.error or "overloaded; retry later", type="rate_limit_error",
            code="rate_limit_exceeded", retry_after_s=retry_after_s,
        )  # fmt: skip
    if draining:
        return HttpError(
            503, "the daemon is shutting down; the request was aborted", type="server_error",
            code="unavailable", retry_after_s=retry_after_s,
        )  # fmt: skip
    if deadline_passed or delta.abort_cause is AbortCause.DEADLINE:
        return deadline_exceeded()
    return HttpError(
        500, delta.error or "the request was aborted", type="server_error", code="aborted"
    )


def client_closed() -> HttpError:
    """What a request whose client went away counts as (499, nginx's code; never sent)."""
    return HttpError(499, "the client closed the connection", code="cancelled")


def deadline_exceeded() -> HttpError:
    return HttpError(
        504, "deadline exceeded; the request was aborted", type="timeout", code="timeout"
    )
