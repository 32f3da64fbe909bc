"""The scheduler's part for weights versions: what a committed swap does to requests in flight.

`SwapPolicies` is composed into the scheduler (`sitsd.engine.scheduler`), which stays the one
writer of request state: every move below goes through its primitives (`sitsd.engine.batch`).

  - `switch(version, policy)`, called by the swap controller between two steps when a swap
    commits: requests that have not started move to the new version at once; running ones
    follow the policy (`drain`: stay on their version, and requests on the new one wait up
    to `drain_hold_s` for them to finish, `holds`, so that no step reads both versions'
    weights, then start at the pace of the share; `restart`: preempted and recomputed on the
    new one in their batch order, a few a step (`start_step`), each once the step's room
    holds its whole context, so that its stream waits about one step, as for a new
    request's prompt, and the others decode on the old version meanwhile; all at once,
    at most the pacer's recompute tokens a step, where the old weights are gone (a swap in
    place); `migrate`: each gets a shadow, `sitsd.engine.migration`);
  - `flip_if_ready` (first in a step run in turn): once every shadow has caught up, each
    migrating request takes its shadow's blocks and version, and its old blocks are freed;
  - `schedule_shadows` (last in a step, after admission): shadow chunks under the step's
    allowance of swap work (`sitsd.engine.pacing`), raised when the migration must speed up
    to end within its deadline; a starved shadow's request is recomputed instead;
  - `drop_shadow` when a migrating request finishes or is preempted.

Which slot holds which version is the runner's business (`sitsd.runtime.weight_slots`); when a
swap commits is the swap controller's (`sitsd.engine.swap_controller`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sitsd.config import SWAP_POLICIES
from sitsd.engine.batch import Batch
from sitsd.engine.migration import Migration
from sitsd.engine.request import Request, RequestStatus
from sitsd.outputs import MigratedRequest, SchedulerOutput

_RESTART_STEPS_APART = 16  # a restart takes a request back at least once in this many steps


@dataclass(frozen=True, slots=True)
class VersionSwitch:
    """What `switch` did to the requests in flight."""

    from_version: str | None  # the version in-flight requests ran on (None: no such request)
    num_migrating: int  # running requests whose KV is being recomputed (migrate)
    num_restarted: int  # requests preempted to be recomputed on the new weights
    num_draining: int  # requests left to finish on their old weights (drain)


class SwapPolicies:
    """Switches the requests in flight to a new weights version; see the module docstring."""

    def __init__(
        self,
        batch: Batch,
        migration_deadline_steps: int,
        migration_deadline_s: float = 0.0,
        drain_hold_s: float = 0.0,
        restart_steps: int = 2,
        restart_every_gaps: int = 128,
    ) -> None:
        """Args:
        batch: the scheduler whose requests this part switches.
        migration_deadline_steps: a migration ends within this many steady steps of its
            commit (counted at the steady step time first measured while it runs)...
        migration_deadline_s: ...or within this many seconds, where > 0.
        drain_hold_s: after a drain commit, requests on the new version wait up to this long
            for the old version's requests to finish.
        restart_steps: a request a restart takes back a few a step recomputes its context in
            at most this many steps (its stream waits that long).
        restart_every_gaps: a restart takes a request back at most once in this many token
            gaps of the decoding streams (0: as often as the room allows).
        """
        self._batch = batch
        self.migration_deadline_steps = migration_deadline_steps
        self.migration_deadline_s = migration_deadline_s
        self.drain_hold_s = drain_hold_s
        self.restart_steps = restart_steps
        self.restart_every_gaps = restart_every_gaps
        self._drain: tuple[str, float] | None = None  # (new version, when) of a drain holding
        self._holding = False  # this step, requests on the drain's new version wait
        # Those of `_recompute` that a drain held back: released when the hold ends, they
        # compute their prompts at the share's pace, not in one step with all of them.
        self._released: set[str] = set()
        self.migration: Migration | None = None  # the migrate policy at work
        self.last_migration: Migration | None = None  # the one that completed last
        # Requests a restart took back, by req_id: the tokens they had computed, which they
        # recompute at most `_room` a step (the pacer's say, `start_step`).
        self._recompute: dict[str, int] = {}
        self._room = 0  # restart recompute tokens the step being scheduled may still take
        self.num_recomputed = 0  # restart recompute tokens scheduled in that step
        # Running requests a restart has still to take back, in batch order, by req_id: the
        # version each restarts on. They decode on their old version (whose slot stays in
        # use: `num_on_version`) until `start_step` takes them.
        self._rolling: dict[str, str] = {}
        # Those of `_recompute` taken from `_rolling`, by req_id: the tokens a step each needs
        # to recompute its context in `restart_steps` steps (the room is raised to that).
        self._rolled: dict[str, int] = {}
        # Token gaps the decoding streams have had since a restart last took one back, up to
        # `restart_every_gaps`: a stream taken back waits for its context's recompute, a gap
        # several steps long, and one in that many gaps shows in no inter-token P99 (32
        # streams on a CPU, two taken back a step: 2% of the restart phase's gaps, which
        # were its P99, 1.84x the steady one).
        self._gaps = 0

    def switch(self, version: str, policy: str, keeps_old: bool = True) -> VersionSwitch:
        """New requests run on `version` from now on; in-flight ones follow `policy`
        (`keeps_old` False: their version's weights are gone, so a restart takes every one
        back at once).

        Raises:
            ValueError: an unknown policy.
            RuntimeError: a migration is still in progress.
        """
        if policy not in SWAP_POLICIES:
            raise ValueError(f"swap policy must be one of {SWAP_POLICIES}, got {policy!r}")
        if self.migration is not None:
            raise RuntimeError(f"a migration to {self.migration.to_version} is in progress")
        batch = self._batch
        others = {r.weights_version for r in batch.requests.values()} - {version}
        from_version = min(others) if others else None
        for request in batch.waiting:  # no blocks held: they simply start on the new version
            if policy != "drain" or not request.num_output_tokens:
                request.weights_version = version
        migration = Migration(from_version or "", version, batch.now(),
                              self.migration_deadline_steps, self.migration_deadline_s)  # fmt: skip
        num_restarted = 0
        self._rolling.clear()  # this policy decides for those a restart had still to take
        rolling: list[str] = []
        # From the end of the batch: each one taken back goes to the head of the queue, so
        # the restarted keep their order there.
        for request in reversed(list(batch.running)):
            if request.weights_version == version or policy == "drain":
                continue
            if policy == "migrate" and request.num_output_tokens:
                migration.add(request, migration.started)
            elif policy == "restart" and keeps_old and request.num_output_tokens:
                rolling.append(request.req_id)  # taken back in the steps to come
                num_restarted += 1
            else:  # restart, or nothing sampled yet: recompute from scratch on the new weights
                self._recompute[request.req_id] = request.num_computed_tokens
                batch.take_back(request, None)
                request.weights_version = version
                num_restarted += 1
        self._rolling = dict.fromkeys(reversed(rolling), version)  # in batch order
        self._gaps = self.restart_every_gaps  # the first goes at once
        if migration.shadows:
            self.migration = migration
        holds = policy == "drain" and self.drain_hold_s > 0
        self._drain = (version, batch.now()) if holds else None
        others_left = [r for r in batch.requests.values() if r.weights_version != version]
        num_draining = len(others_left) - len(migration.shadows) if policy == "drain" else 0
        return VersionSwitch(from_version, len(migration.shadows), num_restarted, num_draining)

    def num_on_version(self, version: str) -> int:
        """Live requests (shadows included) that run on `version`: its slot is in use."""
        num = sum(1 for r in self._batch.requests.values() if r.weights_version == version)
        if self.migration is not None and self.migration.to_version == version:
            num += len(self.migration.shadows)
        return num

    # ------------------------------------------------------------------------------- phases

    def start_step(self, room: int, out: SchedulerOutput) -> None:
        """Before the step's requests are scheduled: restarted requests, and those a drain
        held back once its hold ends, may compute `room` tokens in it, together, in their
        queue order (the rest wait for the next steps), and a restart takes back the next
        requests it has still to (`_roll`). A step may be scheduled while the one before runs
        (asynchronous scheduling): a request taken back then keeps the token that step
        samples for it, on its old version, and is readmitted once the token is in
        (`Scheduler.kept_out`)."""
        requests = self._batch.requests
        for req_id in [r for r, n in self._recompute.items()
                       if r not in requests or requests[r].num_computed_tokens >= n]:  # fmt: skip
            del self._recompute[req_id]  # caught up, or finished
            self._released.discard(req_id)
            self._rolled.pop(req_id, None)
        self._room = max(room, *self._rolled.values()) if self._rolled else room
        self.num_recomputed = 0
        self._holding = self._drain_holds()
        if self._rolling:
            # The streams decoding (a prompt computed in chunks has no gap yet: counted in, a
            # CPU at 128 streams took back 124 in 104 steps, 0.93% of the phase's gaps, and its
            # P99 was theirs); at least one in `_RESTART_STEPS_APART` steps, however few the
            # streams: the restart ends in bounded time (under 8 streams, its waits may show in
            # the P99).
            decoding = sum(1 for r in self._batch.running
                           if r.num_computed_tokens >= r.num_tokens - 1)  # fmt: skip
            earned = max(decoding, -(-self.restart_every_gaps // _RESTART_STEPS_APART))
            self._gaps = min(self.restart_every_gaps, self._gaps + earned)
            self._roll(out)

    def _roll(self, out: SchedulerOutput) -> None:
        """Take back the next requests a restart has still to, in batch order, while the
        step's room holds each one's whole context beside what others still recompute: its
        stream then waits one step, as a new request waits for its prompt. Where nothing
        recomputes, the next one goes whatever its size, and the room grows to what its
        context needs to be recomputed in `restart_steps` steps: a stream waiting many steps
        would be the longest gap of all, where a step a little longer is one of many. And
        one at most per `restart_every_gaps` gaps of the decoding streams (at 32 streams one
        in four steps, at 128 one a step): those waits stay out of the P99."""
        batch = self._batch
        requests = batch.requests
        left = self._room - sum(max(0, n + 1 - requests[r].num_computed_tokens)
                                for r, n in self._recompute.items())  # fmt: skip
        for req_id, version in list(self._rolling.items()):
            request = requests.get(req_id)
            if request is None or request.status is not RequestStatus.RUNNING:
                del self._rolling[req_id]  # finished
                continue
            if request.num_tokens > left and self._recompute:
                return
            if self._gaps < self.restart_every_gaps:
                return
            self._gaps -= self.restart_every_gaps
            del self._rolling[req_id]
            self._recompute[req_id] = request.num_computed_tokens
            self._rolled[req_id] = -(-request.num_tokens // self.restart_steps)
            self._room = max(self._room, self._rolled[req_id])
            batch.take_back(request, out)
            request.weights_version = version
            left -= request.num_tokens

    def taken_back(self, request: Request) -> None:
        """`request` leaves the batch to be recomputed (blocks ran out, a tier, a swap): one
        a restart had still to take back is recomputed on the version it restarts on."""
        version = self._rolling.pop(request.req_id, None)
        if version is not None:
            request.weights_version = version

    def holds(self, request: Request) -> bool:
        """`request` must not be admitted in this step: a drain is holding new requests back
        (the old version's preempted ones are admitted: they are draining)."""
        return (
            self._holding
            and self._drain is not None
            and (request.weights_version == self._drain[0])
        )

    def paced_out(self, request: Request) -> bool:
        """`request` is one a drain held back, or one a restart took back a few at a time,
        and this step's room for them is spent: it waits for the next step."""
        held = request.req_id in self._released or request.req_id in self._rolled
        return held and self._room <= 0

    def _drain_holds(self) -> bool:
        """A drain still holds: requests run on another version, and it began less than
        `drain_hold_s` ago."""
        drain = self._drain
        if drain is None:
            return False
        version, started = drain
        batch = self._batch
        if batch.now() - started >= self.drain_hold_s or all(
            r.weights_version == version for r in batch.requests.values()
        ):
            self._drain = None
            self._release(version)
            return False
        return True

    def _release(self, version: str) -> None:
        """A hold ended: the requests on `version` it kept back compute their prompts paced."""
        for request in self._batch.waiting:
            if request.weights_version == version and not request.num_computed_tokens:
                self._recompute[request.req_id] = request.num_tokens
                self._released.add(request.req_id)

    @property
    def recomputing(self) -> bool:
        """Requests a restart took back all at once may still be recomputing (their streams
        wait for all of them)."""
        return len(self._recompute) > len(self._released) + len(self._rolled)

    @property
    def restarting(self) -> bool:
        """A restart takes its requests back a few a step: some are left to take, or some
        it took are still recomputing (the other streams must not feel them)."""
        return bool(self._rolling) or bool(self._rolled)

    @property
    def rolling(self) -> bool:
        """A restart has requests still to take back."""
        return bool(self._rolling)

    @property
    def releasing(self) -> bool:
        """A drain may release the requests it held back in the step being scheduled, or
        some of them have not computed their prompts yet (they wait for a first token)."""
        return self._drain is not None or bool(self._released)

    def recompute_room(self, request: Request) -> int | None:
        """The most tokens `request` may compute in this step while it recomputes what a
        restart took back, or computes the prompt a drain held back; None: neither (no limit
        of this part's)."""
        if request.req_id not in self._recompute:
            return None
        return self._room

    def charge(self, request: Request, num_new: int) -> None:
        """`request` was scheduled `num_new` tokens: a recomputing one spends the room."""
        if request.req_id in self._recompute:
            self._room -= num_new
            self.num_recomputed += num_new

    def flip_if_ready(self, out: SchedulerOutput, in_turn: bool) -> None:
        """First phase: every shadow caught up: each request takes its shadow's KV and
        version; only in a step scheduled in turn (`in_turn`: no step is running ahead, so
        every original's tokens are known to the host)."""
        migration = self.migration
        if migration is None or not in_turn or not migration.ready:
            return
        kv = self._batch.kv_cache
        started = time.perf_counter()
        for req_id, entry in migration.shadows.items():
            request, shadow = entry.original, entry.request
            kv.free(request)
            kv.transfer(shadow, request)
            request.weights_version = migration.to_version
            request.num_computed_tokens = shadow.num_computed_tokens
            out.migrated.append(
                MigratedRequest(req_id, kv.block_ids(request),
                                request.num_computed_tokens, migration.to_version)
            )  # fmt: skip
            if entry.known_to_runner:
                out.finished_req_ids.add(shadow.req_id)
        out.committed_version = migration.to_version
        migration.flip_s = time.perf_counter() - started
        self.last_migration, self.migration = migration, None

    def schedule_shadows(
        self, out: SchedulerOutput, allowance: int, step_s: float | None, most: int
    ) -> int:
        """Last phase: shadow chunks within `allowance` tokens, or what the deadline needs
        (`Migration.tokens_to_finish`, steps `step_s` apart; None: no floor) when more, up
        to `most`; a shadow without blocks: its request is recomputed. Returns the shadows'
        tokens."""
        migration = self.migration
        if migration is None:
            return 0
        batch = self._batch
        needed = migration.tokens_to_finish(batch.now(), step_s)
        allowance = max(allowance, min(needed, most))
        starved, used = migration.schedule(out, min(allowance, batch.budget(out)), batch.kv_cache)
        for request in starved:
            batch.unschedule(request.req_id, out)
            batch.take_back(request, out)  # drops the shadow, moves it to the new version
            migration.num_restarted += 1
        return used

    def advance(self, sched_out: SchedulerOutput) -> None:
        """After a step: count what the shadows computed."""
        if self.migration is not None:
            self.migration.advance(sched_out, self._batch.kv_cache)

    def drop_shadow(self, request: Request, out: SchedulerOutput | None) -> str | None:
        """Stop migrating `request` (finished or preempted): its shadow's blocks are freed.
        Returns the version it was migrating to (None: it was not migrating)."""
        migration = self.migration
        if migration is None or request.req_id not in migration.shadows:
            return None
        shadow_id = migration.drop(request.req_id, self._batch.kv_cache)
        if shadow_id is not None:
            if out is not None:
                self._batch.unschedule(shadow_id, out)  # scheduled earlier in this step: undo
            self._batch.forget(shadow_id)  # the runner drops its state next step
        return migration.to_version
