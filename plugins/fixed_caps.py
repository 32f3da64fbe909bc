"""Example batch-controller plugin: fixed caps (gold unlimited, silver 8, bronze 4).

Load it with `sitsd serve --plugin-dir plugins --batch-controller fixed-caps`; the contract is
in `plugins/README.md`. Useful as a baseline against the adaptive default (`p99-caps`).
"""

from __future__ import annotations

from collections.abc import Mapping

from sitsd.config import TiersConfig
from sitsd.plugins.interface import TierEstimate
from sitsd.types import Tier


class FixedCaps:
    """Returns the same caps whatever the latency."""

    def __init__(self, config: TiersConfig, max_num_seqs: int) -> None:
        self.caps = {Tier.GOLD: max_num_seqs, Tier.SILVER: 8, Tier.BRONZE: 4}

    def update(self, estimates: Mapping[Tier, TierEstimate], now: float) -> Mapping[Tier, int]:
        return self.caps


BATCH_CONTROLLERS = {"fixed-caps": FixedCaps}
