"""The scheduler's weights-version phases: what a committed swap does to requests in flight.

`SwapPhases` is part of `Scheduler` (a mixin, in its own file to keep `scheduler.py` readable):
the scheduler stays the single writer of request state. It adds

  - `switch_weights(version, policy)`, called by the engine core between two steps when a swap
    commits: requests that have not started move to the new version at once; running ones
    follow the policy (`drain`: stay on their version; `restart`: preempted and recomputed on
    the new one; `migrate`: each gets a shadow, `sitsd.engine.migration`);
  - the `flip` phase (first in a step): once every shadow has caught up, each migrating request
    takes its shadow's blocks and version, and its old blocks are freed;
  - the `shadows` phase (last in a step, after admission): shadow chunks under the
    migration's per-step allowance less the step's prefill; a starved shadow's request is
    recomputed instead.

Which slot holds which version is the runner's business (`sitsd.runtime.weight_slots`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sitsd.engine.migration import Migration
from sitsd.engine.request import Request
from sitsd.outputs import MigratedRequest, SchedulerOutput

if TYPE_CHECKING:
    from sitsd.engine.kv_cache_manager import KVCacheManager
    from sitsd.engine.waiting_queue import FcfsQueue, TierQueue

SWAP_POLICIES = ("migrate", "drain", "restart")


@dataclass(frozen=True, slots=True)
class VersionSwitch:
    """What `switch_weights` did to the requests in flight."""

    from_version: str | None  # the version in-flight requests ran on (None: no such request)
    num_migrating: int  # running requests whose KV is being recomputed (migrate)
    num_restarted: int  # requests preempted to be recomputed on the new weights
    num_draining: int  # requests left to finish on their old weights (drain)


class SwapPhases:
    """Scheduler methods for weights versions (see the module docstring)."""

    if TYPE_CHECKING:  # the Scheduler state these methods work on
        requests: dict[str, Request]
        running: list[Request]
        waiting: FcfsQueue | TierQueue
        kv_cache: KVCacheManager
        migration: Migration | None
        last_migration: Migration | None
        migration_tokens_per_step: int
        _finished_req_ids: set[str]
        _now: Callable[[], float]

        def _budget(self, out: SchedulerOutput) -> int: ...
        def _take_back(self, request: Request, out: SchedulerOutput | None) -> None: ...
        def _unschedule(self, request: Request, out: SchedulerOutput) -> None: ...
        def _unschedule_id(self, req_id: str, out: SchedulerOutput) -> None: ...

    def switch_weights(self, version: str, policy: str) -> VersionSwitch:
        """New requests run on `version` from now on; in-flight ones follow `policy`.

        Raises:
            ValueError: an unknown policy.
            RuntimeError: a migration is still in progress.
        """
        if policy not in SWAP_POLICIES:
            raise ValueError(f"swap policy must be one of {SWAP_POLICIES}, got {policy!r}")
        if self.migration is not None:
            raise RuntimeError(f"a migration to {self.migration.to_version} is in progress")
        others = {r.weights_version for r in self.requests.values()} - {version}
        from_version = min(others) if others else None
        for request in self.waiting:  # no blocks held: they simply start on the new version
            if policy != "drain" or not request.num_output_tokens:
                request.weights_version = version
        migration = Migration(
            from_version or "", version, self._now(), self.migration_tokens_per_step
        )
        num_restarted = 0
        for request in list(self.running):
            if request.weights_version == version or policy == "drain":
                continue
            if policy == "migrate" and request.num_output_tokens:
                migration.add(request, migration.started)
            else:  # restart, or nothing sampled yet: recompute from scratch on the new weights
                self._take_back(request, None)
                request.weights_version = version
                num_restarted += 1
        if migration.shadows:
            self.migration = migration
        others = [r for r in self.requests.values() if r.weights_version != version]
        num_draining = len(others) - len(migration.shadows) if policy == "drain" else 0
        return VersionSwitch(from_version, len(migration.shadows), num_restarted, num_draining)

    def num_on_version(self, version: str) -> int:
        """Live requests (shadows included) that run on `version`: its slot is in use."""
        num = sum(1 for r in self.requests.values() if r.weights_version == version)
        if self.migration is not None and self.migration.to_version == version:
            num += len(self.migration.shadows)
        return num

    def _flip_migration(self, out: SchedulerOutput) -> None:
        """Phase 0: every shadow caught up: its request takes the shadow's KV and version."""
        migration = self.migration
        assert migration is not None
        started = time.perf_counter()
        for req_id, entry in migration.shadows.items():
            request, shadow = entry.original, entry.request
            self.kv_cache.free(request)
            self.kv_cache.transfer(shadow, request)
            request.weights_version = migration.to_version
            request.num_computed_tokens = shadow.num_computed_tokens
            out.migrated.append(
                MigratedRequest(req_id, self.kv_cache.block_ids(request),
                                request.num_computed_tokens, migration.to_version)
            )  # fmt: skip
            if entry.known_to_runner:
                out.finished_req_ids.add(shadow.req_id)
        out.committed_version = migration.to_version
        migration.flip_s = time.perf_counter() - started
        self.last_migration, self.migration = migration, None

    def _schedule_shadows(self, out: SchedulerOutput) -> None:
        """Phase 4: shadow chunks; a shadow without blocks: its request is recomputed."""
        migration = self.migration
        assert migration is not None
        for request in migration.schedule(out, self._budget(out), self.kv_cache):
            self._unschedule(request, out)
            self._take_back(request, out)  # drops the shadow, moves it to the new version
            migration.num_restarted += 1

    def _drop_shadow(self, request: Request, out: SchedulerOutput | None) -> None:
        """Stop migrating `request` (finished or preempted); its shadow's blocks are freed."""
        migration = self.migration
        if migration is None:
            return
        shadow_id = migration.drop(request.req_id, self.kv_cache)
        if shadow_id is None:
            return
        if out is not None:
            self._unschedule_id(shadow_id, out)  # scheduled earlier in this step: undo
        self._finished_req_ids.add(shadow_id)  # the runner drops its state next step
