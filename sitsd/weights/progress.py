"""What a deploy, swap or rollback reports as it goes: one `SwapProgress` per event.

The Admin API streams them (`SwapProgress` in admin.proto) and sitsctl draws its progress bar
from them. Stages, in order: verify (manifest checksums), load, validate, stage (the copy into
the standby slot), canary, commit (with `migrate`: progress while shadows catch up), then a
last event "committed" (with the serving pause), "staged" (deploy) or "rejected"/"failed".
Each stage is also timed in the swap's trace (`SwapTraceLike`). Staging threads report bytes
through `ByteProgress`, paced by a `Pacer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

FINAL_STAGES = ("committed", "staged", "rejected", "failed")


@dataclass(frozen=True)
class SwapProgress:
    """One step of a weight-version operation."""

    stage: str  # verify, load, validate, stage, canary, commit, or a final one (FINAL_STAGES)
    version: str
    bytes_done: int = 0  # verify, validate, stage: bytes hashed, checked, copied
    bytes_total: int = 0
    message: str = ""  # what is going on, or why it was rejected / failed
    policy: str = ""  # commit: migrate, drain or restart
    num_migrating: int = 0  # commit: requests whose KV is recomputed under the new weights
    num_caught_up: int = 0  # commit: of those, shadows caught up
    num_restarted: int = 0  # commit: requests recomputed from their tokens
    num_draining: int = 0  # commit: requests left to finish on the old weights
    pause_s: float = 0.0  # committed: the longest gap between two engine steps at the flip
    flip_s: float = 0.0  # committed: the flip itself (the in-place copy with one slot)
    canary_kl: float = -1.0  # canary: mean KL(active || new) in nats; -1 = no canary run
    canary_ppl_ratio: float = 0.0  # canary: perplexity new / active on the prompts


ProgressSink = Callable[[SwapProgress], None]


def ignore_progress(progress: SwapProgress) -> None:
    """A sink for callers that want no progress."""


class SwapTraceLike(Protocol):
    """A swap's telemetry: one timed span per stage, an outcome at the end
    (`sitsd.observability.swap.SwapTrace`)."""

    def stage(self, name: str) -> AbstractContextManager[object]: ...

    def finish(self, outcome: str, error: str = "") -> None: ...


class NoTrace:
    """A `SwapTraceLike` that records nothing (a daemon without telemetry)."""

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        yield

    def finish(self, outcome: str, error: str = "") -> None:
        pass


class Pacer:
    """Spreads background work over time: called after each piece of work, it sleeps so that
    the work takes at most `share` of the wall time (1 = no pause). One per worker thread.

    The work is counted on the clock of what it shares with serving, `clock`: by default the
    calling thread's CPU time, for work that shares the cores (on a CPU device every core runs
    the engine's OpenMP team: a stager busy at the same time stalls the team's parallel
    regions, measured inter-token P99 x1.5 while hashing); for a copy to a GPU, the device
    time of its transfers (`SwapPort.copy_seconds`: the host-to-device link is what it shares
    with the engine's own uploads). Small pieces with pauses between them bound what any one
    engine step can lose.

    On the default clock the first piece counts from the calling thread's start: every pacer
    runs on a thread made for its work (`run_off_engine`, a copier of its own), so what the
    thread did before its first call is work too. Counted from the first call instead, the
    first two pieces ran back to back (a 2-core CPU serving SmolLM2 to 32 streams: one
    engine step 2.4x the median at the start of every validation). Another clock's first
    call takes its mark.
    """

    def __init__(self, share: float = 1.0, clock: Callable[[], float] | None = None) -> None:
        self.share = share
        self._clock = clock or time.thread_time
        # The clock at the last call (the thread's start on the default clock; see above).
        self._mark: float | None = 0.0 if clock is None else None

    def __call__(self) -> None:
        """After a piece of work on the calling thread: sleep in proportion to its work.

        CPU time, not wall time, for work on the cores: time spent waiting for a core is no
        work, and counting it would slow staging down most exactly when the machine is
        busiest.
        """
        if self.share >= 1.0:
            return
        now = self._clock()  # a clock of work: the sleep below does not advance it
        if self._mark is not None:
            time.sleep(max(0.0, now - self._mark) * (1.0 - self.share) / self.share)
        self._mark = now


class ByteProgress:
    """A thread-safe (done, total) callback that posts `SwapProgress` to the event loop, at most
    every `interval_s` seconds (and always the last one); it also paces the worker calling it."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sink: ProgressSink,
        stage: str,
        version: str,
        interval_s: float = 0.1,
        pace: Pacer | None = None,
    ) -> None:
        self._loop, self._sink = loop, sink
        self._stage, self._version = stage, version
        self._interval_s = interval_s
        self._last = 0.0
        self._pace = pace or Pacer()

    def __call__(self, done: int, total: int) -> None:
        self._pace()
        now = time.monotonic()
        if done < total and now - self._last < self._interval_s:
            return
        self._last = now
        event = SwapProgress(self._stage, self._version, bytes_done=done, bytes_total=total)
        with contextlib.suppress(RuntimeError):  # the loop closed: the daemon is stopping
            self._loop.call_soon_threadsafe(self._sink, event)
