"""A request as the engine sees it: tokens, progress, blocks and timing. Engine thread only."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sitsd.types import EndReason, FinishReason, SamplingParams, Tier


class RequestStatus(enum.Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # scheduled in recent steps, holds blocks
    PREEMPTED = "preempted"  # blocks taken back; waits to be recomputed
    FINISHED = "finished"


@dataclass(eq=False, slots=True)
class Request:
    """One generation request.

    The scheduling rule that covers prefill, chunked prefill and decode alike: each step,
    `num_computed_tokens` (tokens whose KV is in the cache) catches up with `num_tokens`
    (prompt plus outputs) under the step's token budget. A request samples a token in a step
    whose scheduled tokens reach the end of its known tokens.
    """

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int
    tier: Tier
    arrival_time: float  # time.monotonic() at the API
    deadline: float | None = None  # time.monotonic() after which it is aborted
    trace_context: object | None = None
    eos_token_ids: frozenset[int] = frozenset()

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    # Asynchronous scheduling: tokens sampled by a launched step whose output has not reached
    # the host yet (0 or 1); the next step computes that token's KV all the same.
    num_pending_outputs: int = 0
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission
    block_ids: list[int] = field(default_factory=list)
    weights_version: str = ""
    finish_reason: FinishReason | None = None
    end_reason: EndReason | None = None  # how it ended, for telemetry (`OutputProcessor` sets it)
    num_preemptions: int = 0

    # Timing (time.monotonic()), for metrics and traces.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED
