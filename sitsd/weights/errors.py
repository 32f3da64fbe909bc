"""Errors of weight-version operations; the API layer maps each to one gRPC status.

Light on purpose (no torch): `sitsd.api.interceptors` imports it.
"""

from __future__ import annotations


class VersionError(Exception):
    """Base class: a weight-version operation that cannot be done."""


class InvalidVersionIdError(VersionError):
    """A version id that is not a name (a path, odd characters, too long) (gRPC INVALID_ARGUMENT;
    the message starts with the field, "version: ")."""


class UnknownVersionError(VersionError):
    """No version has this id (gRPC NOT_FOUND)."""


class VersionConflictError(VersionError):
    """The version id is taken by other content (gRPC ALREADY_EXISTS)."""


class SwapRefusedError(VersionError):
    """Not now, or not this version: another swap runs, the version was rejected, nothing to
    roll back to, the standby slot still drains (gRPC FAILED_PRECONDITION)."""


class VersionRejectedError(SwapRefusedError):
    """The version failed a check (checksum, shapes, NaN, canary, ...); the message says which."""


class SwapFailedError(VersionError):
    """The engine could not commit (gRPC ABORTED); serving goes on with the old version."""


class GroupJoinError(VersionError):
    """The trainer's weight group could not be joined: its store did not answer, or a rank
    never came within the timeout (gRPC FAILED_PRECONDITION; the message says where and why)."""
