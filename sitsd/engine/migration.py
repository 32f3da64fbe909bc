"""The `migrate` swap policy: shadow requests recompute in-flight KV under the new weights.

When a swap commits with `migrate`, every running request that has produced tokens gets a
shadow: a `Request` that shares its token lists (so it sees every token decoding appends), has
blocks of its own and the new weights version. The scheduler runs shadows as prefill work on
the new slot, under the per-step allowance of a swap's work (`sitsd.engine.pacing`), next to
the decodes that go on on the old slot; a shadow never samples. The migration ends in bounded
time: `tokens_to_finish` says how many tokens a step must give shadows for every one that
will still be needed then to have caught up by a deadline (`deadline_s`, set once the steady
step time is measured: a number of steady steps, so the device's pace, unless configured in
seconds), which the scheduler's allowance never goes below as long as a step at most doubles
(`StepPacer.most_tokens`; past that, the migration takes longer than its deadline rather than
stall the streams). A shadow's target in a step is every known token when its original
computes its last token in the same step or has a token pending (asynchronous scheduling: the
step ahead is sampling it), else all but the last one: a flipped request always has a token
left to compute, and so samples at once.

A shadow counts its tokens as computed when they are scheduled, as a request's step ahead is
counted: with asynchronous scheduling the next chunk is scheduled while the last one is still
computing (stream order puts its KV before any read of it). A shadow only ever computes tokens
the host knows, and an original scheduled ahead is always one token past them, so shadows catch
up only in steps run in turn: once every shadow is within one token of what the host knows
(`nearly_ready`), the engine runs in turn (`SwapController.one_step_at_a_time`), one step
brings the shadows level with their originals, and the next flips.

When, at the start of a step run in turn, every shadow has computed at least as many tokens as
its original, all migrating requests flip in that step: each takes its shadow's blocks,
computed count and version, and its old blocks are freed. Nothing ever mixes versions:
originals run on the old slot over blocks the old weights wrote, shadows on the new slot over
blocks the new weights wrote (prefix-cache hits included: hashes are keyed by version).

A request that finishes or is preempted mid-migration drops its shadow (a preempted one comes
back on the new weights); a shadow that finds no free block is given up and its request is
recomputed on the new weights instead (`restart`, for that request only).

The scheduler owns a `Migration` and is its only caller; this module writes only shadows.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request, RequestStatus
from sitsd.outputs import CachedRequestData, NewRequestData, SchedulerOutput

_SHADOW_SUFFIX = "\x00shadow"  # request ids with a NUL are refused at the API: no collision


@dataclass(slots=True, eq=False)
class Shadow:
    """One migrating request and its shadow."""

    original: Request
    request: Request  # the shadow: same token lists, its own blocks, the new version
    started: float  # time.monotonic() when the migration of this request began
    known_to_runner: bool = False  # sent once as NewRequestData, then as CachedRequestData


class Migration:
    """The requests migrating from one weights version to another; see the module docstring."""

    def __init__(
        self,
        from_version: str,
        to_version: str,
        started: float,
        deadline_steps: int = 2000,
        deadline_s: float = 0.0,
    ) -> None:
        """Args:
        deadline_steps: it ends within this many steady steps of `started` (counted at the
            first steady step time `tokens_to_finish` is given)...
        deadline_s: ...or within this many seconds, where > 0.
        """
        self.from_version = from_version
        self.to_version = to_version
        self.started = started
        self.shadows: dict[str, Shadow] = {}  # by the original's req_id
        self.num_restarted = 0  # requests whose shadow found no blocks (recomputed instead)
        self.flip_s = 0.0  # how long the flip took (set by the scheduler)
        self._deadline_steps = deadline_steps
        # Seconds from `started` it must end within; None until the steady step time that
        # sets it is measured (given in seconds: that, at once).
        self.deadline_s: float | None = deadline_s or None

    @staticmethod
    def shadow_id(req_id: str) -> str:
        return req_id + _SHADOW_SUFFIX

    def add(self, original: Request, now: float) -> None:
        """Start migrating a running request."""
        shadow = Request(
            req_id=self.shadow_id(original.req_id),
            prompt_token_ids=original.prompt_token_ids,  # shared lists, not copies
            params=original.params,
            seed=original.seed,
            tier=original.tier,
            arrival_time=original.arrival_time,
            output_token_ids=original.output_token_ids,
            status=RequestStatus.RUNNING,
            weights_version=self.to_version,
        )
        self.shadows[original.req_id] = Shadow(original, shadow, now)

    def drop(self, req_id: str, kv: KVCacheManager) -> str | None:
        """Stop migrating `req_id`: free its shadow's blocks. The shadow's id if the runner
        holds state for it (to be told it finished), else None."""
        entry = self.shadows.pop(req_id, None)
        if entry is None:
            return None
        kv.free(entry.request)
        return entry.request.req_id if entry.known_to_runner else None

    @property
    def ready(self) -> bool:
        """Every shadow has caught up with its original: flip now (start of a step)."""
        return all(
            s.request.num_computed_tokens >= s.original.num_computed_tokens
            for s in self.shadows.values()
        )

    @property
    def nearly_ready(self) -> bool:
        """Every shadow is within one token of the tokens the host knows: steps run in turn
        from now on catch the shadows up and flip (see the module docstring)."""
        return all(
            s.request.num_computed_tokens >= s.original.num_tokens - 1
            for s in self.shadows.values()
        )

    @property
    def num_caught_up(self) -> int:
        return sum(
            s.request.num_computed_tokens >= s.original.num_computed_tokens
            for s in self.shadows.values()
        )

    def tokens_to_finish(self, now: float, step_s: float | None) -> int:
        """Tokens shadows need in each step from now on for the migration to end within
        `deadline_s` of its start, steps being `step_s` apart (None or 0: not measured yet;
        the first measured one fixes a deadline counted in steps).

        A shadow whose original ends before then (it has fewer tokens left to generate than
        there are steps) needs none: its shadow is dropped when it ends. Every other one
        catches up with its deficit over the steps left (a quarter of them kept for steps
        without swap work) and with the token its original adds in each.
        """
        if step_s is None or step_s <= 0:
            return 0
        if self.deadline_s is None:  # fixed at the first steady step time measured
            self.deadline_s = self._deadline_steps * step_s
        steps_left = max(1.0, 0.75 * (self.started + self.deadline_s - now) / step_s)
        needed = 0.0
        for entry in self.shadows.values():
            original = entry.original
            if original.params.max_tokens - original.num_output_tokens < steps_left:
                continue
            needed += self._deficit(entry) / steps_left + 1
        return math.ceil(needed)

    def schedule(
        self, out: SchedulerOutput, allowance: int, kv: KVCacheManager
    ) -> tuple[list[Request], int]:
        """Schedule shadow chunks into `out`, last in the step, within `allowance` tokens.

        Returns:
            Originals whose shadow found no free block (the caller recomputes them instead),
            and the tokens scheduled.
        """
        left = allowance
        starved = []
        # Nearly caught-up shadows first: keeping them in step is cheap, and then the flip
        # waits only for the ones far behind.
        for entry in sorted(self.shadows.values(), key=self._deficit):
            if left <= 0:
                break
            num_new = min(self._target(entry, out) - entry.request.num_computed_tokens, left)
            if num_new <= 0:
                continue
            scheduled = self._schedule_one(entry, num_new, out, kv)
            if scheduled is None:
                starved.append(entry.original)
            else:
                left -= scheduled
        return starved, allowance - left

    def advance(self, sched_out: SchedulerOutput, kv: KVCacheManager) -> None:
        """After a successful step: cache the shadows' full blocks (their tokens were counted
        when scheduled)."""
        for entry in self.shadows.values():
            shadow = entry.request
            if sched_out.num_scheduled_tokens.get(shadow.req_id):
                kv.cache_full_blocks(shadow)

    # ------------------------------------------------------------------------------ internal

    @staticmethod
    def _deficit(entry: Shadow) -> int:
        return entry.original.num_tokens - entry.request.num_computed_tokens

    @staticmethod
    def _target(entry: Shadow, out: SchedulerOutput) -> int:
        """Tokens the shadow may have computed after this step (see the module docstring).

        (With running requests scheduled before shadows, an original that does not reach its
        end has used up the step's budget; the rule keeps the flip safe whatever the order.)
        """
        original = entry.original
        if original.num_pending_outputs:  # the step ahead samples a token the host lacks
            return original.num_tokens
        num_scheduled = out.num_scheduled_tokens.get(original.req_id, 0)
        reaches_end = original.num_computed_tokens + num_scheduled == original.num_tokens
        return original.num_tokens if reaches_end else original.num_tokens - 1

    def _schedule_one(
        self, entry: Shadow, num_new: int, out: SchedulerOutput, kv: KVCacheManager
    ) -> int | None:
        """Schedule up to `num_new` tokens of a shadow; the tokens scheduled (0: its prefix
        was all in the cache), None when its blocks do not fit."""
        shadow = entry.request
        if entry.known_to_runner:
            computed = shadow.num_computed_tokens
            new_block_ids = kv.allocate_slots(shadow, num_new)
            if new_block_ids is None:
                return None
            out.cached_reqs.append(CachedRequestData(shadow.req_id, new_block_ids, computed))
        else:
            hits = kv.get_computed_blocks(shadow)  # KV the new weights wrote for this prefix
            num_hit = len(hits) * kv.block_size
            num_new = min(num_new, max(0, self._target(entry, out) - num_hit))
            if num_new <= 0 or kv.allocate_slots(shadow, num_new, hits) is None:
                kv.free(shadow)  # hits taken by a failed allocation are given back
                return 0 if num_new <= 0 else None
            shadow.num_computed_tokens = num_hit
            entry.known_to_runner = True
            out.new_reqs.append(
                NewRequestData(
                    req_id=shadow.req_id,
                    token_ids=shadow.all_token_ids,
                    num_prompt_tokens=shadow.num_prompt_tokens,
                    params=shadow.params,
                    seed=shadow.seed,
                    block_ids=kv.block_ids(shadow),
                    num_computed_tokens=num_hit,
                    weights_version=self.to_version,
                    shadow_of=entry.original.req_id,
                )
            )
        shadow.num_computed_tokens += num_new  # counted now: the next chunk follows it
        out.num_scheduled_tokens[shadow.req_id] = num_new
        out.total_num_scheduled_tokens += num_new
        return num_new
