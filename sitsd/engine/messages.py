"""Messages on the engine core's inbox, posted from other threads, handled between steps."""

from __future__ import annotations

from dataclasses import dataclass

from sitsd.types import SamplingParams, Tier


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Admit a new request."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    tier: Tier | None
    deadline: float | None  # time.monotonic() after which the request is aborted
    arrival_time: float  # time.monotonic() when the API received it
    trace_context: object | None = None


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request (client cancel, passed deadline); its blocks are freed."""

    req_id: str
    reason: str = "aborted"
