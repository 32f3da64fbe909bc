"""SLA tiers: the queue order with aging, the per-tier statistics, and controller plugins.

Rules the tiers policy (`sitsd.engine.tier_policy`) applies with these:

- Order (with aging): waiting requests are served by `arrival_time + tier.priority_offset_s`,
  smallest first: each tier ranks as if its requests had arrived that much later (gold 0,
  silver 100 ms, bronze 250 ms by default). A fresh gold request thus goes before bronze that
  waited less than 250 ms, and a bronze request's rank improves one-for-one with its queue
  time: after 250 ms it outranks fresh gold, and after 250 + 120 ms every gold request still
  queued (none waits longer than gold's 120 ms limit), so it gets the next free slot well
  within its own 500 ms limit: bronze is never starved. (A pure earliest-queue-deadline order,
  `arrival + max_queue_wait`, would not do: under sustained overload bronze would reach the
  head only as it expires.) Preempted requests keep their arrival time, hence their place.
- Caps: a controller (a plugin, `sitsd.plugins.interface.BatchController`) reads each tier's
  TTFT and inter-token P99 over a sliding window (`sitsd.engine.latency`, kept by
  `TierTracker`) and sets how many running requests each tier may hold; a tier at its cap is
  skipped, it does not block the others. Caps are clamped to [1, max_num_seqs] and to the
  tier's `max_batch_share`.
- Gold steps: while a gold request has prompt tokens to compute, lower tiers' prompt chunks
  get only what keeps the step within `gold_step_tokens` once gold's chunks and every running
  request's token are in (`lower_tier_prefill_allowance`): a step that carries gold's prompt
  takes ~1/4 of a full 2048-token step's time, and gold's time to first token with it.

Every request has a tier under either policy, so the scheduler keeps a `TierTracker` for both:
its latency windows and counters are the tiers' statistics (`Admin.Status`); its caps matter
only to the tiers policy.

Plugins: group `sitsd.plugins`, name `batch_controller.<name>`, or a `*.py` file in a
`--plugin-dir` defining `BATCH_CONTROLLERS = {"<name>": factory}`; a factory takes
`(TiersConfig, max_num_seqs)` and returns a `BatchController` (`plugins/README.md`). Reading
the tiers file is `sitsd.tiers_file`'s.
"""

from __future__ import annotations

import importlib.util
import math
from collections.abc import Iterable, Mapping
from importlib.metadata import entry_points
from pathlib import Path

from sitsd.config import ConfigError, TierConfig, TiersConfig
from sitsd.engine.latency import TierLatency
from sitsd.engine.request import Request
from sitsd.outputs import TierStats
from sitsd.plugins.interface import BatchController, ControllerFactory, TierEstimate
from sitsd.plugins.p99_caps import P99BatchController
from sitsd.types import TIER_ORDER, Tier

ENTRY_POINT_GROUP = "sitsd.plugins"
ENTRY_POINT_PREFIX = "batch_controller."


def queue_key(arrival_time: float, tier: TierConfig) -> float:
    """A request's place in the tier-ordered queue, smaller first (aging: see above)."""
    return arrival_time + tier.priority_offset_s


def _builtin_controllers() -> dict[str, ControllerFactory]:
    return {"p99-caps": P99BatchController}


def _plugin_dir_controllers(plugin_dirs: tuple[str, ...]) -> dict[str, ControllerFactory]:
    found: dict[str, ControllerFactory] = {}
    for directory in plugin_dirs:
        for path in sorted(Path(directory).expanduser().glob("*.py")):
            spec = importlib.util.spec_from_file_location(f"sitsd_plugin_{path.stem}", path)
            if spec is None or spec.loader is None:
                continue
            module = importlib.util.module_from_spec(spec)
            try:
                spec.loader.exec_module(module)
            except Exception as exc:  # the plugin's own error, but a start-up error of ours
                raise ConfigError(f"--plugin-dir: {path}: {type(exc).__name__}: {exc}") from exc
            found.update(getattr(module, "BATCH_CONTROLLERS", {}))
    return found


def find_batch_controller(config: TiersConfig) -> ControllerFactory:
    """The factory of the controller named `config.controller`.

    Looked up in the plugin directories first, then the `sitsd.plugins` entry points, then the
    built-in ones. The daemon calls it before it loads the model, so an unknown name is a
    start-up error, not a model-load failure (plugin files run again when the engine is built).

    Raises:
        ConfigError: a plugin directory is missing, or no controller has that name.
    """
    name = config.controller
    missing = [d for d in config.plugin_dirs if not Path(d).expanduser().is_dir()]
    if missing:
        raise ConfigError(f"--plugin-dir {missing[0]}: not a directory")
    candidates = _plugin_dir_controllers(config.plugin_dirs)
    if name not in candidates:
        for ep in entry_points(group=ENTRY_POINT_GROUP):
            if ep.name == ENTRY_POINT_PREFIX + name:
                candidates[name] = ep.load()
    if name not in candidates:
        candidates.update(_builtin_controllers())
    if name not in candidates:
        raise ConfigError(
            f"--batch-controller: no batch controller named {name!r} (built in: "
            f"{', '.join(_builtin_controllers())}; plugins: entry points "
            f"'{ENTRY_POINT_PREFIX}<name>' in group {ENTRY_POINT_GROUP}, or BATCH_CONTROLLERS "
            "in a --plugin-dir file)"
        )
    return candidates[name]


def load_batch_controller(config: TiersConfig, max_num_seqs: int) -> BatchController:
    """Build the controller named `config.controller` (`find_batch_controller`).

    Raises:
        ConfigError: no controller has that name.
    """
    return find_batch_controller(config)(config, max_num_seqs)


def lower_tier_prefill_allowance(
    running: Iterable[Request], waiting: Iterable[Request], gold_step_tokens: int
) -> int | None:
    """Prompt tokens silver and bronze may compute in the next step, or None for no limit.

    A limit applies while some gold request (running or waiting) has more than one token to
    compute: the step then holds gold's tokens, one token per running request and, up to
    `gold_step_tokens` in all, lower tiers' prompt chunks. `gold_step_tokens` 0: no limit.
    """
    if gold_step_tokens <= 0:
        return None
    running = list(running)
    gold = 0
    for request in (*running, *waiting):
        left = request.num_tokens - request.num_computed_tokens
        if request.tier is Tier.GOLD and left > 1:
            gold += left
    return None if gold == 0 else max(0, gold_step_tokens - gold - len(running))


# ------------------------------------------------------------------------- live tier state


class TierTracker:
    """Per-tier latency windows, batch caps and counters, owned by the scheduler."""

    def __init__(self, config: TiersConfig, max_num_seqs: int) -> None:
        """Args:
        config: the tiers' targets and the controller's settings.
        max_num_seqs: the batch size limit every cap stays under.
        """
        self.config = config
        self.max_num_seqs = max_num_seqs
        self.latency = {tier: TierLatency(config.window_s) for tier in TIER_ORDER}
        # Until the controller's first update: the top tier the whole batch, the others the
        # controller's largest cap.
        self.caps = {tier: self._clamp(tier, max_num_seqs if rank == 0 else config.max_batch_cap)
                     for rank, tier in enumerate(TIER_ORDER)}  # fmt: skip
        self.num_refused = dict.fromkeys(TIER_ORDER, 0)
        self.num_shed = dict.fromkeys(TIER_ORDER, 0)
        self.num_preempted = dict.fromkeys(TIER_ORDER, 0)
        self._next_update = -math.inf
        self.last_estimates = self.estimates(0.0)  # as of the last `refresh`

    def target(self, tier: Tier) -> TierConfig:
        return self.config.tier(tier.value)

    def record_ttft(self, tier: Tier, now: float, seconds: float) -> None:
        self.latency[tier].ttft.add(now, seconds)

    def record_itl(self, tier: Tier, now: float, seconds: float) -> None:
        self.latency[tier].itl.add(now, seconds)

    def estimates(self, now: float) -> dict[Tier, TierEstimate]:
        """Each tier's live P99s beside its targets."""
        out = {}
        for tier in TIER_ORDER:
            ttft, itl, count, itl_count = self.latency[tier].p99(now)
            target = self.target(tier)
            out[tier] = TierEstimate(
                tier, ttft, itl, count, target.ttft_p99_s, target.itl_p99_s, itl_count
            )
        return out

    def refresh(self, now: float) -> dict[Tier, TierEstimate] | None:
        """Once per control interval: recompute the P99s and return them (None in between)."""
        if now < self._next_update:
            return None
        self._next_update = now + self.config.control_interval_s
        self.last_estimates = self.estimates(now)
        return self.last_estimates

    def set_caps(self, caps: Mapping[Tier, int]) -> None:
        """A controller's caps, clamped to [1, max_num_seqs] and each tier's batch share."""
        for tier, cap in caps.items():
            self.caps[Tier(tier)] = self._clamp(Tier(tier), int(cap))

    def _clamp(self, tier: Tier, cap: int) -> int:
        share = self.target(tier).max_batch_share
        return max(1, min(cap, self.max_num_seqs, math.floor(share * self.max_num_seqs)))

    def stats(
        self, running: dict[Tier, int], waiting: dict[Tier, int], fixed_cap: int | None = None
    ) -> tuple[TierStats, ...]:
        """Each tier's targets, cap (`fixed_cap` when no caps apply), P99s and counts."""
        out = []
        for tier in TIER_ORDER:
            target, est = self.target(tier), self.last_estimates[tier]
            out.append(
                TierStats(
                    tier=tier.value,
                    ttft_p99_target_s=target.ttft_p99_s,
                    itl_p99_target_s=target.itl_p99_s,
                    max_queue_wait_s=target.max_queue_wait_s,
                    batch_cap=self.caps[tier] if fixed_cap is None else fixed_cap,
                    num_running=running[tier],
                    num_waiting=waiting[tier],
                    ttft_p99_s=est.ttft_p99_s,
                    itl_p99_s=est.itl_p99_s,
                    num_samples=est.num_samples,
                    num_refused=self.num_refused[tier],
                    num_shed=self.num_shed[tier],
                    num_preempted=self.num_preempted[tier],
                )
            )
        return tuple(out)
