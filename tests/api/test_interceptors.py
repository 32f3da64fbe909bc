"""The failure -> status mapping and the admin token check, without a server."""

from __future__ import annotations

import grpc
import pytest

from sitsd.api.interceptors import AdminAuthInterceptor, status_for_exception, status_for_finish
from sitsd.engine.errors import (
    EngineStoppedError,
    InvalidRequestError,
    ModelNotFoundError,
    OverloadedError,
    QueueFullError,
)
from sitsd.types import AbortCause, FinishReason, RequestDelta


@pytest.mark.parametrize(
    ("exc", "code"),
    [
        (InvalidRequestError("top_p", "must be in (0, 1]"), grpc.StatusCode.INVALID_ARGUMENT),
        (ModelNotFoundError("model: 'x' is not served"), grpc.StatusCode.NOT_FOUND),
        (QueueFullError("busy"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (EngineStoppedError("loading"), grpc.StatusCode.UNAVAILABLE),
        (KeyError("surprise"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_exception_maps_to_its_status(exc, code):
    assert status_for_exception(exc)[0] == code


def test_invalid_argument_message_starts_with_the_field():
    assert status_for_exception(InvalidRequestError("top_p", "must be in (0, 1]"))[1] == (
        "top_p: must be in (0, 1]"
    )


def test_unexpected_exception_message_names_its_type():
    assert status_for_exception(ZeroDivisionError("x"))[1] == "internal error: ZeroDivisionError: x"


def finish(
    reason: FinishReason | None, error: str = "", cause: AbortCause | None = None
) -> RequestDelta:
    return RequestDelta("r", finish_reason=reason, error=error, abort_cause=cause)


@pytest.mark.parametrize("reason", [None, FinishReason.STOP, FinishReason.LENGTH])
def test_normal_endings_need_no_status(reason):
    assert status_for_finish(finish(reason), draining=True, deadline_passed=True) is None


@pytest.mark.parametrize(
    ("delta", "draining", "deadline_passed", "code"),
    [
        (finish(FinishReason.ERROR, "oom"), False, False, grpc.StatusCode.INTERNAL),
        (
            finish(FinishReason.ABORT, "the engine stopped"),
            True,
            False,
            grpc.StatusCode.UNAVAILABLE,
        ),
        (
            finish(FinishReason.ABORT, "deadline exceeded"),
            False,
            False,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ),
        (finish(FinishReason.ABORT, "x"), False, True, grpc.StatusCode.DEADLINE_EXCEEDED),
        (finish(FinishReason.ABORT, "evicted"), False, False, grpc.StatusCode.ABORTED),
        (
            finish(FinishReason.ABORT, "too late", AbortCause.DEADLINE),
            False,
            False,
            grpc.StatusCode.DEADLINE_EXCEEDED,
        ),
        (
            finish(FinishReason.ABORT, "overloaded: queue", AbortCause.OVERLOADED),
            False,
            False,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
        (
            finish(FinishReason.ABORT, "overloaded: queue", AbortCause.OVERLOADED),
            True,
            True,
            grpc.StatusCode.RESOURCE_EXHAUSTED,
        ),
    ],
)
def test_engine_ended_requests_map_to_statuses(delta, draining, deadline_passed, code):
    status = status_for_finish(delta, draining=draining, deadline_passed=deadline_passed)
    assert status is not None
    assert status[0] == code


def test_overload_message_reaches_the_client():
    delta = finish(FinishReason.ABORT, "overloaded: waited 130 ms", AbortCause.OVERLOADED)
    status = status_for_finish(delta, draining=False, deadline_passed=False)
    assert status == (grpc.StatusCode.RESOURCE_EXHAUSTED, "overloaded: waited 130 ms")


def test_admission_refusal_is_resource_exhausted():
    assert status_for_exception(OverloadedError("overloaded: expected 900 ms"))[0] == (
        grpc.StatusCode.RESOURCE_EXHAUSTED
    )


def test_engine_error_message_reaches_the_client():
    status = status_for_finish(
        finish(FinishReason.ERROR, "CUDA OOM"), draining=False, deadline_passed=False
    )
    assert status == (grpc.StatusCode.INTERNAL, "CUDA OOM")


@pytest.mark.parametrize(
    ("metadata", "ok"),
    [
        ((("authorization", "Bearer s3cret"),), True),
        ((("Authorization", "BEARER s3cret"),), True),
        ((("x-other", "1"), ("authorization", b"Bearer s3cret")), True),
        ((("authorization", "Bearer s3cre"),), False),
        ((("authorization", "Bearer s3cretX"),), False),
        ((("authorization", "Basic s3cret"),), False),
        ((("authorization", "s3cret"),), False),
        ((("authorization", "Bearer ünïcode"),), False),
        ((), False),
        (None, False),
    ],
)
def test_admin_token_check(metadata, ok):
    assert AdminAuthInterceptor("s3cret").authorized(metadata) is ok


def test_empty_admin_token_is_refused():
    with pytest.raises(ValueError, match="must not be empty"):
        AdminAuthInterceptor("")
