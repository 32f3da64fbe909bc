"""The plugin interface: what a batch controller is given, and what it must return.

A batch controller (the SLA-tier scheduler's plugin, `plugins/README.md`) is asked every
control interval for per-tier batch caps, given one `TierEstimate` per tier. Plugins import
this module (and `sitsd.types`, `sitsd.config`) only: how the scheduler finds, calls and
clamps them is `sitsd.engine.tiers`' and `sitsd.engine.tier_policy`'s business.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from sitsd.config import TiersConfig
from sitsd.types import TIER_ORDER, Tier

__all__ = ["TIER_ORDER", "BatchController", "ControllerFactory", "TierEstimate"]


@dataclass(frozen=True)
class TierEstimate:
    """What a batch controller knows of one tier at one moment."""

    tier: Tier
    ttft_p99_s: float | None  # None: no sample in the window
    itl_p99_s: float | None
    num_samples: int  # first tokens in the window
    ttft_target_s: float
    itl_target_s: float
    num_itl_samples: int = 0  # inter-token gaps in the window

    def ratios(self, min_samples: int = 1) -> tuple[float | None, float | None]:
        """(TTFT P99 / target, ITL P99 / target), each None with fewer than `min_samples`."""
        ttft = (
            self.ttft_p99_s / self.ttft_target_s
            if self.ttft_p99_s is not None and self.num_samples >= min_samples
            else None
        )
        itl = (
            self.itl_p99_s / self.itl_target_s
            if self.itl_p99_s is not None and self.num_itl_samples >= min_samples
            else None
        )
        return ttft, itl

    @property
    def ratio(self) -> float | None:
        """Worst of TTFT P99 / target and ITL P99 / target; None without samples."""
        known = [r for r in self.ratios(min_samples=0) if r is not None]
        return max(known) if known else None


class BatchController(Protocol):
    """Sets per-tier batch caps from live latency estimates (called every control interval)."""

    def update(self, estimates: Mapping[Tier, TierEstimate], now: float) -> Mapping[Tier, int]:
        """The cap of each tier: how many of its requests may run at once. Missing = unchanged."""
        ...


# What a plugin registers: called as `factory(tiers_config, max_num_seqs)`.
ControllerFactory = Callable[[TiersConfig, int], BatchController]
