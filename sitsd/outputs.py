"""Plain-data objects that travel between the scheduler, the model runner and the API.

Batch stages, and who owns what:
    Request (engine/request.py)      mutable, scheduler-owned, lists and ints only
      -> SchedulerOutput              what to compute this step; only what changed since the last
                                      step is sent for requests the runner already knows
      -> ModelRunner (runtime/)       owns every tensor: weights, KV pool, per-request token rows;
                                      builds AttentionMetadata on the host and copies it once
      -> ModelRunnerOutput            sampled token ids as Python lists
      -> Scheduler.update_from_output appends tokens, checks stop conditions, frees blocks
      -> RequestDelta (sitsd.types)   handed to the API's event loop

No object here holds a tensor: crossing the scheduler/runner boundary costs list copies only.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from sitsd.types import SamplingParams, TokenLogprob


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (new, or resumed after preemption)."""

    req_id: str
    token_ids: list[int]  # prompt + outputs so far (outputs are non-empty after preemption)
    num_prompt_tokens: int
    params: SamplingParams
    seed: int  # resolved seed: the client's, or one drawn at admission
    block_ids: list[int]  # the request's whole block table
    num_computed_tokens: int  # tokens whose KV is already in the cache (prefix-cache hits)
    weights_version: str = ""  # the weights slot this request runs on
    # Set for a migration shadow: it computes KV under `weights_version` for the tokens of
    # the request named here (the runner shares that request's token list) and never samples.
    shadow_of: str | None = None
    # A canary probe: it never samples; the runner keeps the log-probabilities of every
    # position it computes until the swap controller takes them (`sitsd.engine.probes`).
    probe: bool = False


@dataclass(slots=True)
class CachedRequestData:
    """A request the runner already holds: only what changed."""

    req_id: str
    new_block_ids: list[int]  # blocks appended to its table this step
    num_computed_tokens: int  # tokens whose KV is in the cache before this step


@dataclass(slots=True)
class MigratedRequest:
    """A request whose KV now lives in its shadow's blocks, under the shadow's weights."""

    req_id: str
    block_ids: list[int]  # the whole new block table (the shadow's)
    num_computed_tokens: int  # tokens whose KV the shadow computed
    weights_version: str  # the version it runs on from this step


class PreemptionReason(enum.StrEnum):
    """Why a running request lost its blocks (it is recomputed later)."""

    BLOCKS = "blocks"  # a running request needed KV blocks and none were free
    TIER = "tier"  # a higher tier's request took its place in the batch
    SWAP = "swap"  # a weight swap restarts it on the new weights


@dataclass(frozen=True, slots=True)
class Preemption:
    """One request taken out of the batch, why, and for whom (what telemetry reports)."""

    req_id: str  # the request preempted
    reason: PreemptionReason
    for_req_id: str = ""  # the request it made room for ("" for a swap)
    for_tier: str = ""  # that request's tier


@dataclass(frozen=True, slots=True)
class SwapWork:
    """A step as the pacing of a swap's work sees it (`sitsd.engine.pacing`): that work in
    it (canary probes, migration recompute; often none) and what it served."""

    num_tokens: int  # tokens of a swap's work in the step (0: none)
    alone: bool  # that work ran as a sub-batch of its own: its version served nothing else
    num_serving_versions: int  # weights versions the step's serving requests ran on
    # What set num_tokens (`sitsd.engine.pacing.Allowance.limit`, or "deadline": a migration
    # behind its deadline; "idle": nothing served; "recompute": a restart's); "" for none.
    limit: str = ""
    per_token_s: float = 0.0  # the pacer's price of one of its tokens then (0: not priced)
    smallest_s: float = 0.0  # ...and of its smallest piece, the test of the share (0: none)


@dataclass(slots=True)
class SchedulerOutput:
    """What the runner computes in one step."""

    new_reqs: list[NewRequestData] = field(default_factory=list)
    cached_reqs: list[CachedRequestData] = field(default_factory=list)
    num_scheduled_tokens: dict[str, int] = field(default_factory=dict)  # req_id -> tokens
    total_num_scheduled_tokens: int = 0
    finished_req_ids: set[str] = field(default_factory=set)  # runner drops their state
    preempted_req_ids: set[str] = field(default_factory=set)  # runner drops their state too
    preemptions: list[Preemption] = field(default_factory=list)  # why, one per preempted id
    # Applied before `cached_reqs`: requests that flipped to new weights at this step's start.
    migrated: list[MigratedRequest] = field(default_factory=list)
    committed_version: str | None = None  # a migration to this version completed this step
    # Asynchronous scheduling: the next `schedule()` already advanced the requests' computed
    # tokens by this step's, so `update_from_output` must not again.
    applied_ahead: bool = False
    swap_work: SwapWork | None = None  # for the pacing of a swap's work (not the runner's)
    # The weights versions whose slots the step reads, its serving requests' and its swap
    # work's (None: not known, any; a step cut short by a preemption).
    weights_versions: frozenset[str] | None = None

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class ModelRunnerOutput:
    """The tokens one step sampled, in plain lists."""

    req_ids: list[str]
    # One list per req_id: the sampled token, or empty when the request was mid-prefill.
    sampled_token_ids: list[list[int]]
    # Per req_id, a `TokenLogprob` per sampled token of the requests that asked for logprobs
    # (`SamplingParams.logprobs`; empty for the others); None when no request asked.
    logprobs: list[list[TokenLogprob]] | None = None


@dataclass(frozen=True)
class ModelInfo:
    """What clients may know about the served model."""

    name: str
    max_model_len: int
    vocab_size: int
    architecture: str
    dtype: str
    device: str
    path: str
    # UTF-8 bytes of text one token stands for at most (the longest vocabulary entry): a text
    # prompt longer than the context times this cannot fit, and is refused before tokenizing.
    max_token_bytes: int = 128

    @property
    def max_prompt_bytes(self) -> int:
        """The longest prompt text, in UTF-8 bytes, that can fit the context."""
        return self.max_model_len * self.max_token_bytes


@dataclass(frozen=True)
class TierStats:
    """One SLA tier as the scheduler sees it: targets, cap, live P99s and counters."""

    tier: str  # "gold", "silver" or "bronze"
    ttft_p99_target_s: float
    itl_p99_target_s: float
    max_queue_wait_s: float
    batch_cap: int  # running requests of this tier allowed at once (the controller's output)
    num_running: int
    num_waiting: int
    ttft_p99_s: float | None  # over the sliding window; None without samples
    itl_p99_s: float | None
    num_samples: int  # first tokens in the window
    num_refused: int  # refused at admission since start-up (RESOURCE_EXHAUSTED)
    num_shed: int  # dropped after waiting past max_queue_wait_s since start-up
    num_preempted: int  # preempted (for a higher tier or for blocks) since start-up


@dataclass(frozen=True)
class EngineStatus:
    """A snapshot of the engine, for `Admin.Status` and `sitsctl status`."""

    model: str
    weights_version: str
    num_running: int
    num_waiting: int
    num_blocks_used: int
    num_blocks_total: int
    block_size: int
    prefix_cache_queries: int  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int  # of those, tokens found
    num_preemptions: int
    num_steps: int
    scheduling_policy: str = ""  # "tiers" or "fcfs"
    tiers: tuple[TierStats, ...] = ()  # gold, silver, bronze
    slot_versions: tuple[str, ...] = ()  # the version in each weight slot ("" = none)
    active_slot: int = 0  # the slot new requests run on
    slot_precisions: tuple[str, ...] = ()  # what runs in which bits in each slot
    slot_weight_bytes: tuple[int, ...] = ()  # bytes each slot's weights take
    swapping: bool = False  # a commit is in progress (a migration catching up)
