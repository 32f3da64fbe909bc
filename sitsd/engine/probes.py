"""Canary prompts as low-priority work in the engine's steps.

The swap controller (`sitsd.engine.swap_controller`) hands the scheduler a probe: a prompt to
run on one weights version, never sampling, keeping the log-probabilities of every position
(the canary gate compares two versions on them, `sitsd.weights.canary`). `Probes` is composed
into the scheduler (`sitsd.engine.scheduler`), whose last phase fits probe chunks into what
the step's swap allowance leaves (`sitsd.engine.pacing`), next to the requests it serves: a
probe never pauses the batch.

A probe holds blocks of the shared pool like a request, but the prefix cache never sees them:
it reads no cached block (every position's logits are wanted) and registers none (a version
that is then rejected must leave nothing behind). When its last chunk has been computed, its
blocks are freed, the runner is told to forget it (it keeps the log-probabilities until the
controller takes them) and its `on_done` is called. A probe that cannot finish (its version
left its slot, its step failed, the engine stops) is failed with the reason.

The scheduler owns `Probes` and is its only caller; this module writes only probes.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from sitsd.engine.batch import Batch
from sitsd.engine.request import Request, RequestStatus
from sitsd.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sitsd.types import SamplingParams, Tier

_PROBE_PREFIX = "\x00probe-"  # request ids with a NUL are refused at the API: no collision

ProbeDone = Callable[[str, str | None], None]  # (probe id, why it failed; None: computed)


@dataclass(slots=True, eq=False)
class Probe:
    """One canary prompt on one weights version."""

    # Its tokens, version and blocks; `num_computed_tokens` counts the tokens scheduled (with
    # asynchronous scheduling a chunk may be scheduled before the last one's step ended).
    request: Request
    on_done: ProbeDone
    num_done: int = 0  # tokens whose step has ended
    known_to_runner: bool = False  # sent once as NewRequestData, then as CachedRequestData


class Probes:
    """Canary probes waiting for, or riding in, engine steps; see the module docstring."""

    def __init__(self, batch: Batch) -> None:
        self._batch = batch
        self._probes: dict[str, Probe] = {}  # by probe id, in the order they came
        self._ids = itertools.count()

    @property
    def pending(self) -> bool:
        return bool(self._probes)

    def owns(self, req_id: str) -> bool:
        return req_id in self._probes

    def versions(self) -> set[str]:
        """The versions of probes with tokens left to schedule."""
        return {
            p.request.weights_version
            for p in self._probes.values()
            if p.request.num_computed_tokens < p.request.num_tokens
        }

    def add(self, token_ids: list[int], version: str, on_done: ProbeDone) -> str:
        """Queue a prompt (at least one token) on `version`; its probe id."""
        if not token_ids:
            raise ValueError("a canary prompt needs at least one token")
        req_id = f"{_PROBE_PREFIX}{next(self._ids)}"
        request = Request(
            req_id=req_id,
            prompt_token_ids=list(token_ids),
            params=SamplingParams(max_tokens=1),
            seed=0,
            tier=Tier.BRONZE,
            arrival_time=self._batch.now(),
            status=RequestStatus.RUNNING,
            weights_version=version,
        )
        self._probes[req_id] = Probe(request, on_done)
        return req_id

    # ------------------------------------------------------------------------------- phases

    def schedule(self, out: SchedulerOutput, allowance: int, versions: set[str]) -> int:
        """Schedule chunks of probes on `versions`, oldest first, within `allowance` tokens;
        the tokens scheduled. A probe whose blocks do not fit waits (it preempts nobody)."""
        kv = self._batch.kv_cache
        used = 0
        for req_id, probe in self._probes.items():
            request = probe.request
            left = request.num_tokens - request.num_computed_tokens
            if left <= 0 or request.weights_version not in versions:
                continue
            num_new = min(left, allowance - used, self._batch.budget(out))
            if num_new <= 0:
                break
            computed = request.num_computed_tokens
            new_block_ids = kv.allocate_slots(request, num_new)
            if new_block_ids is None:
                continue
            if probe.known_to_runner:
                out.cached_reqs.append(CachedRequestData(req_id, new_block_ids, computed))
            else:
                probe.known_to_runner = True
                out.new_reqs.append(
                    NewRequestData(
                        req_id=req_id,
                        token_ids=request.all_token_ids,
                        num_prompt_tokens=request.num_prompt_tokens,
                        params=request.params,
                        seed=request.seed,
                        block_ids=kv.block_ids(request),
                        num_computed_tokens=0,
                        weights_version=request.weights_version,
                        probe=True,
                    )
                )
            request.num_computed_tokens += num_new
            out.num_scheduled_tokens[req_id] = num_new
            out.total_num_scheduled_tokens += num_new
            used += num_new
        return used

    def advance(self, sched_out: SchedulerOutput) -> None:
        """After a step: count what the probes computed; report the ones that are done."""
        for req_id, num in sched_out.num_scheduled_tokens.items():
            probe = self._probes.get(req_id)
            if probe is None:
                continue
            probe.num_done += num
            if probe.num_done == probe.request.num_tokens:
                self._end(req_id, None)

    def fail(self, req_id: str, reason: str) -> bool:
        """Fail one probe (its step failed); False if `req_id` is no probe."""
        if req_id not in self._probes:
            return False
        self._end(req_id, reason)
        return True

    def fail_versions(self, versions: Iterable[str], reason: str) -> None:
        """Fail the probes on `versions` (they are leaving their slot)."""
        wanted = set(versions)
        for req_id in [r for r, p in self._probes.items() if p.request.weights_version in wanted]:
            self._end(req_id, reason)

    def fail_all(self, reason: str) -> None:
        """Fail every probe (the engine failed or stops)."""
        for req_id in list(self._probes):
            self._end(req_id, reason)

    def _end(self, req_id: str, error: str | None) -> None:
        probe = self._probes.pop(req_id)
        self._batch.kv_cache.free(probe.request)
        if probe.known_to_runner:
            self._batch.forget(req_id)  # the runner drops it (and, failed, its log-probs)
        probe.on_done(req_id, error)
