"""The default batch controller: each tier's P99 latency sets the caps of the tiers below it.

For tier T, the *pressure* is the worst latency ratio (P99 / target, TTFT or inter-token,
whichever is worse) among the tiers ranked above T. Gold has none above it: its cap is the
whole batch (`--max-num-seqs`; its `max_batch_share` still applies), since caps exist to protect
the tiers above a tier and none is above gold. (Capping gold at `max_batch_cap` made a burst of
gold wait for gold to finish while batch slots stood free: the GPU overload benchmark's slow
gold requests.) The pressure maps a lower tier's cap between `min_batch_cap` (4) and
`max_batch_cap` (32):

    pressure <= 0.5      -> max cap (the tail has room: batch for throughput)
    pressure >= 1.0      -> min cap (a higher tier misses its target: protect its tail)
    in between           -> geometric interpolation, max * (min / max) ** ((p - 0.5) / 0.5)

A cap falls to its mapped value at once (protect the tail fast) and grows by at most a
quarter per update (a larger batch slows every step, so throughput is taken back gradually).
A P99 (TTFT or inter-token) counts only once the window holds `MIN_SAMPLES` samples of it: a
P99 of a handful of samples is their maximum, and one slow step must not halve the batch.
"""

from __future__ import annotations

from collections.abc import Mapping

from sitsd.config import TiersConfig
from sitsd.plugins.interface import TIER_ORDER, TierEstimate
from sitsd.types import Tier

LOW_PRESSURE = 0.5  # at or below: the largest cap
HIGH_PRESSURE = 1.0  # at or above: the smallest cap
MIN_SAMPLES = 10  # samples a P99 needs in the window before it counts


class P99BatchController:
    """Maps the P99 pressure from higher tiers to each tier's batch cap (see module docstring)."""

    def __init__(self, config: TiersConfig, max_num_seqs: int) -> None:
        self.batch = max(1, max_num_seqs)
        self.max_cap = max(1, min(config.max_batch_cap, max_num_seqs))
        self.min_cap = max(1, min(config.min_batch_cap, self.max_cap))
        self.caps: dict[Tier, int] = {tier: self.max_cap for tier in TIER_ORDER}
        self.caps[TIER_ORDER[0]] = self.batch

    def cap_for(self, pressure: float | None) -> int:
        """The cap a tier gets when the tiers above it are under `pressure`."""
        if pressure is None or pressure <= LOW_PRESSURE:
            return self.max_cap
        if pressure >= HIGH_PRESSURE:
            return self.min_cap
        fraction = (pressure - LOW_PRESSURE) / (HIGH_PRESSURE - LOW_PRESSURE)
        return max(self.min_cap, round(self.max_cap * (self.min_cap / self.max_cap) ** fraction))

    def update(self, estimates: Mapping[Tier, TierEstimate], now: float) -> Mapping[Tier, int]:
        pressure: float | None = None
        for rank, tier in enumerate(TIER_ORDER):
            target = self.batch if rank == 0 else self.cap_for(pressure)
            current = self.caps[tier]
            if target < current:
                self.caps[tier] = target
            else:
                self.caps[tier] = min(target, current + max(1, current // 4))
            estimate = estimates.get(tier)
            ratios = [] if estimate is None else estimate.ratios(MIN_SAMPLES)
            known = [r for r in ratios if r is not None]
            ratio = max(known) if known else None
            if ratio is not None:
                pressure = ratio if pressure is None else max(pressure, ratio)
        return dict(self.caps)
