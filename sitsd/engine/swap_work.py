"""The scheduler's last phase: a swap's work in what the step has left, under the pacer's say.

A swap adds two kinds of work to the steps that serve, both scheduled last, after the requests
being served: migration shadows (`sitsd.engine.swap_policies`, `sitsd.engine.migration`) and
canary probes (`sitsd.engine.probes`). The pacer (`sitsd.engine.pacing`) says how many of their
tokens a step may take; `SwapWorkPhase` fits shadows first (a migration has a deadline), then
probes, into that allowance.

A step carries one kind of swap work: work on a weights version that serves in the step (it
joins that sub-batch: it costs its tokens), or, when there is none, work on a version that
serves nothing in it (a sub-batch of its own: a whole pass over another slot's weights). A
step whose serving work computes prompt tokens too is longer than steady already: the
allowance of work that joins shrinks by them (to an eighth at least; a piece of its own keeps
its size, it pays for its pass either way). A spaced canary piece (one the pacer lets grow its
step past the share, once in many steps) and the first one alone (whose cost prices the rest)
wait for a step whose prompt tokens are no more than its decodes, up to `SPACED_WAIT_STEPS`
steps (a migration's pieces have a deadline to keep): beside arriving prompts, such a piece
makes the slowest step of the swap (a CPU at 32 streams: 2.4x the steady P99, a piece priced
at 28 ms beside 284 prompt tokens), and its cost is measured with theirs. With
nothing to serve, a swap's work takes the whole budget. Every step's shape goes to the pacer
in `SchedulerOutput.swap_work`.

The scheduler (`sitsd.engine.scheduler`) owns this phase and calls it once a step.
"""

from __future__ import annotations

from sitsd.engine.batch import Batch
from sitsd.engine.pacing import Allowance, StepPacer
from sitsd.engine.probes import Probes
from sitsd.engine.swap_policies import SwapPolicies
from sitsd.outputs import SchedulerOutput, SwapWork

# Steps a spaced piece (or the first alone) waits at most for one whose prompt tokens are no
# more than its decodes.
SPACED_WAIT_STEPS = 16


class SwapWorkPhase:
    """Schedules a swap's work into a step; see the module docstring."""

    def __init__(self, batch: Batch, swaps: SwapPolicies, probes: Probes, pacer: StepPacer) -> None:
        self._batch = batch
        self._swaps = swaps
        self._probes = probes
        self._pacer = pacer
        self._waited = 0  # steps the spaced piece offered now has waited for a lighter one

    def schedule(self, out: SchedulerOutput) -> None:
        """Shadows, then probes, of one kind, within the allowance; the step's shape in
        `out.swap_work`."""
        requests = self._batch.requests
        serving = {requests[r].weights_version for r in out.num_scheduled_tokens}
        migration = self._swaps.migration
        pending = self._probes.versions()
        if migration is not None:
            pending.add(migration.to_version)
        joining = pending & serving
        versions, alone = (joining, False) if joining else (pending, True)
        used, paced = (
            self._schedule(out, versions, alone, len(serving))
            if versions
            else (0, Allowance(0, ""))
        )
        # A restart's recompute (phases 2 and 3) is a swap's work too, joining its version's.
        recomputed = self._swaps.num_recomputed
        limit = paced.limit if used else ("recompute" if recomputed else "")
        out.swap_work = SwapWork(used + recomputed, alone and used > 0, len(serving), limit,
                                 paced.per_token_s if used else 0.0,
                                 paced.smallest_s if used else 0.0)  # fmt: skip
        out.weights_versions = frozenset(serving | versions) if used else frozenset(serving)

    def _schedule(
        self, out: SchedulerOutput, versions: set[str], alone: bool, num_serving: int
    ) -> tuple[int, Allowance]:
        """A swap's work on `versions`: the tokens scheduled, and what set how many."""
        pacer = self._pacer
        migration = self._swaps.migration
        migrating = migration is not None and migration.to_version in versions
        if num_serving:
            paced = pacer.pace(num_serving, alone)
            allowance = paced.tokens
            prefill = out.total_num_scheduled_tokens - len(out.num_scheduled_tokens)
            if allowance > 0 and not alone:  # a spaced piece keeps its size: it pays its pass
                allowance = max(-(-allowance // 8), allowance - prefill)
            # A spaced piece, or the first alone (it prices every later one): not beside
            # arriving prompts, whose cost would be taken for its own.
            heavy = paced.limit == "spaced" or (alone and paced.limit == "first")
            if allowance > 0 and heavy and not migrating:  # (a migration has its deadline)
                if prefill > len(out.num_scheduled_tokens) and self._waited < SPACED_WAIT_STEPS:
                    self._waited += 1
                    return 0, Allowance(0, "spaced", paced.per_token_s, paced.smallest_s)
                self._waited = 0
        else:  # nothing served in this step: nothing to protect
            allowance = self._batch.budget(out)
            paced = Allowance(allowance, "idle")
        used = 0
        if migrating:
            assert migration is not None
            # The deadline's floor everywhere but in the steps that keep the pacing measured.
            step_s = None if pacer.measuring(num_serving) else pacer.steady_s(num_serving)
            most = pacer.most_tokens(num_serving, alone) if num_serving else allowance
            used = self._swaps.schedule_shadows(out, allowance, step_s, most)
            if used > allowance:  # the deadline's floor
                paced = Allowance(used, "deadline", paced.per_token_s, paced.smallest_s)
        return used + self._probes.schedule(out, allowance - used, versions), paced
