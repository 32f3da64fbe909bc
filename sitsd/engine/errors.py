"""Errors the engine raises to its callers; the API layer maps each to one gRPC status."""

from __future__ import annotations


class EngineError(Exception):
    """Base class: a request the engine could not take or finish."""


class InvalidRequestError(EngineError):
    """The request itself is wrong (gRPC INVALID_ARGUMENT); `field` names the culprit."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


class QueueFullError(EngineError):
    """Too many requests are waiting (gRPC RESOURCE_EXHAUSTED)."""


class OverloadedError(QueueFullError):
    """Admission control: the queue ahead would break the tier's queue wait (RESOURCE_EXHAUSTED)."""


class EngineStoppedError(EngineError):
    """The engine is not running: not started yet, or shutting down (gRPC UNAVAILABLE)."""


class ModelNotFoundError(EngineError):
    """The request names a model this daemon does not serve (gRPC NOT_FOUND)."""
