"""Messages on the engine core's inbox, posted from other threads, handled between steps."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

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


@dataclass(frozen=True, slots=True)
class SwapCommand:
    """Commit weights `version` between two steps; in-flight requests follow `policy`.

    With two slots, `version` must already be in the standby slot: the commit flips the active
    index. With one slot, `copy_in_place` (run on the engine thread, between two steps) copies
    the new version over the only slot, and in-flight requests are recomputed (`restart`).
    `on_event` is called on the engine thread with each `sitsd.engine.commit.SwapEvent`; the
    last one is "committed" or "failed".
    """

    version: str
    policy: str  # migrate, drain or restart
    on_event: Callable[[Any], None]
    copy_in_place: Callable[[], None] | None = None


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Run `fn(core)` on the engine thread between two steps; then `reply(result, error)`.

    For short work that must not race the step loop: reserving a weight slot, one canary
    prompt. It delays the next step by as long as it takes.
    """

    fn: Callable[[Any], Any]
    reply: Callable[[Any, BaseException | None], None]
