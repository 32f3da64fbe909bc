"""Continuous batching: which requests compute how many tokens in the next step.

One rule covers prefill, chunked prefill, prefix-cache hits and decode: each step, a request's
`num_computed_tokens` catches up with its `num_tokens` under the step's token budget. Running
requests go first, in admission order; waiting requests are admitted while budget, batch slots
and KV blocks last. When a running request cannot get a block, the most recently admitted
running request is preempted by recompute: its blocks are freed (they stay in the prefix cache
until evicted) and it goes back to the front of the queue.

What the model computes is the runner's business; stop strings and text are the detokenizer's;
the engine core (`core.py`) drives one `schedule()` -> execute -> `update_from_output()` cycle
per step.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.outputs import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from sitsd.engine.request import Request, RequestStatus
from sitsd.types import FinishReason


@dataclass(slots=True)
class TokenUpdate:
    """New tokens of one request from one step, and whether that finished it."""

    request: Request
    new_token_ids: list[int]
    finish_reason: FinishReason | None


class Scheduler:
    """Owns the waiting queue and the running batch; the only writer of `Request` state."""

    def __init__(
        self,
        config: SchedulerConfig,
        kv_cache: KVCacheManager,
        max_model_len: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.config = config
        self.kv_cache = kv_cache
        self.max_model_len = max_model_len
        self._now = clock
        self.requests: dict[str, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0
        # Told to the runner with the next SchedulerOutput, so it can drop their state.
        self._finished_req_ids: set[str] = set()

    # ------------------------------------------------------------------------------ requests

    def add_request(self, request: Request) -> None:
        if request.req_id in self.requests:
            raise ValueError(f"request {request.req_id!r} is already scheduled")
        self.requests[request.req_id] = request
        self.waiting.append(request)

    def finish_request(self, req_id: str, reason: FinishReason) -> Request | None:
        """Finish a live request (abort, stop string, error): free its blocks. None if unknown."""
        request = self.requests.pop(req_id, None)
        if request is None:
            return None
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request)
        self._release(request, reason)
        return request

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    # ------------------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Pick this step's work. See the module docstring for the rule."""
        out = SchedulerOutput(finished_req_ids=self._finished_req_ids)
        self._finished_req_ids = set()
        budget = self.config.max_num_batched_tokens

        # Phase: running requests, oldest first; preempt from the newest end when blocks run out.
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = min(request.num_tokens - request.num_computed_tokens, budget)
            new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            while new_block_ids is None:
                victim = self.running[-1]
                self._preempt(victim, out)
                preempted = True
                if victim is request:
                    break
                new_block_ids = self.kv_cache.allocate_slots(request, num_new)
            if new_block_ids is None:
                break  # the request itself was the newest and got preempted
            out.cached_reqs.append(
                CachedRequestData(request.req_id, new_block_ids, request.num_computed_tokens)
            )
            self._count(out, request, num_new)
            budget -= num_new
            i += 1

        # Phase: admit waiting requests while budget, batch slots and blocks last. Not after a
        # preemption: the freed blocks went to running requests, and admitting now would thrash.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            request = self.waiting[0]
            num_new = self._admit(request, budget, out)
            if num_new is None:
                break
            budget -= num_new
        return out

    def _admit(self, request: Request, budget: int, out: SchedulerOutput) -> int | None:
        """Move the queue's head into the batch; None if its first chunk's blocks don't fit."""
        computed_blocks = self.kv_cache.get_computed_blocks(request)
        num_hit = len(computed_blocks) * self.kv_cache.block_size
        num_new = min(request.num_tokens - num_hit, budget)
        new_block_ids = self.kv_cache.allocate_slots(request, num_new, computed_blocks)
        if new_block_ids is None:
            return None
        self.waiting.popleft()
        if request.num_cached_tokens < 0:  # first admission: count the prefix-cache lookup
            request.num_cached_tokens = num_hit
            self.kv_cache.record_lookup(request.num_prompt_tokens, num_hit)
            request.first_scheduled_time = self._now()
        request.status = RequestStatus.RUNNING
        request.num_computed_tokens = num_hit
        self.running.append(request)
        out.new_reqs.append(
            NewRequestData(
                req_id=request.req_id,
                token_ids=request.all_token_ids,
                num_prompt_tokens=request.num_prompt_tokens,
                params=request.params,
                seed=request.seed,
                block_ids=self.kv_cache.block_ids(request),
                num_computed_tokens=num_hit,
                weights_version=request.weights_version,
            )
        )
        self._count(out, request, num_new)
        return num_new

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        self.running.remove(request)
        self.kv_cache.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(request)
        out.preempted_req_ids.add(request.req_id)
        # Victims come from the tail of `running`, which this step has not scheduled yet,
        # so nothing in `out` needs undoing.

    @staticmethod
    def _count(out: SchedulerOutput, request: Request, num_new: int) -> None:
        out.num_scheduled_tokens[request.req_id] = num_new
        out.total_num_scheduled_tokens += num_new

    # ---------------------------------------------------------------------------- the update

    def update_from_output(
        self, sched_out: SchedulerOutput, runner_out: ModelRunnerOutput
    ) -> list[TokenUpdate]:
        """Advance computed tokens, append sampled tokens, finish what hit a stop condition."""
        for req_id, num_tokens in sched_out.num_scheduled_tokens.items():
            request = self.requests.get(req_id)
            if request is not None:
                request.num_computed_tokens += num_tokens
                self.kv_cache.cache_full_blocks(request)
        now = self._now()
        updates = []
        for req_id, token_ids in zip(runner_out.req_ids, runner_out.sampled_token_ids):
            request = self.requests.get(req_id)
            if request is None or not token_ids:
                continue
            accepted, reason = self._append_tokens(request, token_ids)
            if request.first_token_time is None:
                request.first_token_time = now
            request.last_token_time = now
            if reason is not None:
                self.finish_request(req_id, reason)
            updates.append(TokenUpdate(request, accepted, reason))
        return updates

    def _append_tokens(
        self, request: Request, token_ids: Iterable[int]
    ) -> tuple[list[int], FinishReason | None]:
        params = request.params
        accepted = []
        for token_id in token_ids:
            request.output_token_ids.append(token_id)
            accepted.append(token_id)
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return accepted, FinishReason.STOP
            if token_id in params.stop_token_ids:
                return accepted, FinishReason.STOP
            if request.num_output_tokens >= params.max_tokens:
                return accepted, FinishReason.LENGTH
            if request.num_tokens >= self.max_model_len:
                return accepted, FinishReason.LENGTH
        return accepted, None

    def _release(self, request: Request, reason: FinishReason) -> None:
        self.kv_cache.free(request)
        request.status = RequestStatus.FINISHED
        request.finish_reason = reason
        self._finished_req_ids.add(request.req_id)

    def expired_req_ids(self, now: float) -> list[str]:
        """Live requests whose deadline has passed."""
        return [
            r.req_id for r in self.requests.values() if r.deadline is not None and r.deadline <= now
        ]
