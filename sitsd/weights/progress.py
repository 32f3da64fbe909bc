"""What a deploy, swap or rollback reports as it goes: one `SwapProgress` per event.

The Admin API streams them (`SwapProgress` in admin.proto) and sitsctl draws its progress bar
from them. Stages, in order: verify (manifest checksums), load, validate, stage (the copy into
the standby slot), canary, commit (with `migrate`: progress while shadows catch up), then a
last event "committed" (with the serving pause), "staged" (deploy) or "rejected"/"failed".
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass

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


class ByteProgress:
    """A thread-safe (done, total) callback that posts `SwapProgress` to the event loop, at most
    every `interval_s` seconds (and always the last one)."""

    def __init__(
        self,
        loop: asyncio.AbstractEventLoop,
        sink: ProgressSink,
        stage: str,
        version: str,
        interval_s: float = 0.1,
    ) -> None:
        self._loop, self._sink = loop, sink
        self._stage, self._version = stage, version
        self._interval_s = interval_s
        self._last = 0.0

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        if done < total and now - self._last < self._interval_s:
            return
        self._last = now
        event = SwapProgress(self._stage, self._version, bytes_done=done, bytes_total=total)
        with contextlib.suppress(RuntimeError):  # the loop closed: the daemon is stopping
            self._loop.call_soon_threadsafe(self._sink, event)
