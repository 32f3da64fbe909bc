"""Messages on the engine core's inbox, posted from other threads, handled between steps; and
`SwapEvent`, what a swap command reports back."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from sitsd.types import EndReason, SamplingParams, Tier

if TYPE_CHECKING:
    import torch

    from sitsd.quant.source import QuantSource


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
    """Stop a request (client cancel, passed deadline, shutdown); its blocks are freed."""

    req_id: str
    reason: str = "aborted"  # for the client, in the last delta
    cause: EndReason = EndReason.CANCELLED  # what happened, for telemetry


@dataclass(frozen=True)
class SwapEvent:
    """Progress of one commit, as the engine thread reports it."""

    kind: str  # "migrating", "committed" or "failed"
    version: str  # the version being committed
    policy: str  # the policy applied (restart when one slot forced it)
    from_version: str = ""  # the version in-flight requests ran on
    num_migrating: int = 0  # requests whose KV is being recomputed
    num_caught_up: int = 0  # of those, shadows caught up with their request
    num_restarted: int = 0  # requests recomputed from their tokens on the new weights
    num_draining: int = 0  # requests left to finish on the old weights
    flip_s: float = 0.0  # the flip itself (the in-place copy with one slot)
    pause_s: float = 0.0  # longest time between two steps around the flip
    typical_gap_s: float = 0.0  # the median time between two busy steps before the commit
    message: str = ""  # why it failed


@dataclass(frozen=True, slots=True)
class InPlaceCopy:
    """With one weight slot: the checkpoint tensors a commit copies over the only slot."""

    tensors: Mapping[str, torch.Tensor]  # Hugging Face names, shapes already checked
    chunk_bytes: int  # the most copied at once
    source: QuantSource | None = None  # what the checkpoint stores quantized


@dataclass(frozen=True, slots=True)
class SwapCommand:
    """Commit weights `version` between two steps; in-flight requests follow `policy`.

    With two slots, `version` must already be in the standby slot: the commit flips the active
    index. With one slot, `in_place` is copied over the only slot on the engine thread, between
    two steps, and in-flight requests are recomputed (`restart`). `on_event` is called on the
    engine thread with each `SwapEvent`; the last one is "committed" or "failed".
    """

    version: str
    policy: str  # migrate, drain or restart
    on_event: Callable[[SwapEvent], None]
    in_place: InPlaceCopy | None = None


# Which step launched ahead an `EngineCall` waits for: "any" (the call may run the model, or
# change what any step reads), "standby" (it takes the standby slot's version away and runs
# nothing: only a step that reads that version), "none" (nothing a launched step reads: it
# queues work for the next steps, or marks a slot no step can read as filled).
AheadWait = Literal["any", "standby", "none"]


@dataclass(frozen=True, slots=True)
class EngineCall:
    """Run `fn()` on the engine thread between two steps; then `reply(result, error)`.

    For short work that must not race the step loop (the swap controller's slot operations,
    queueing a canary prompt). It delays the next step by as long as it takes. A step launched
    ahead is finished first as `waits_for` says: finishing it leaves the device idle while the
    host schedules the next (a step's host time, ~4 ms on an H200 with 32 streams).
    """

    fn: Callable[[], object]
    reply: Callable[[object, BaseException | None], None]
    waits_for: AheadWait = "any"
