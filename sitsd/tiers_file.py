"""The tiers file: YAML -> `TiersConfig` (targets, queue limits, batch shares, controller).

    tiers:
      gold:   {ttft_p99_ms: 80, itl_p99_ms: 80, max_queue_wait_ms: 120, max_batch_share: 1.0}
      bronze: {priority_offset_ms: 250}
    gold_step_tokens: 512
    controller: p99-caps

Keys under `tiers.<name>` are in milliseconds (`*_ms`) or fractions; top-level keys are
`TiersConfig` fields. What the values do is the scheduler's business (`sitsd.engine.tiers`,
`sitsd.engine.tier_policy`); this module only reads and range-checks them.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from sitsd.config import TierConfig, TiersConfig
from sitsd.types import Tier

_TIER_KEYS = {
    "ttft_p99_ms": "ttft_p99_s",
    "itl_p99_ms": "itl_p99_s",
    "max_queue_wait_ms": "max_queue_wait_s",
    "max_batch_share": "max_batch_share",
    "priority_offset_ms": "priority_offset_s",
}
_TOP_KEYS = {f.name for f in fields(TiersConfig)} - {"gold", "silver", "bronze", "plugin_dirs"}


def tiers_config_from_mapping(
    data: Mapping[str, Any], base: TiersConfig | None = None
) -> TiersConfig:
    """A `TiersConfig` from a parsed tiers file; unset values keep `base`'s.

    Raises:
        ValueError: an unknown key or a value out of range (the message names it).
    """
    base = base or TiersConfig()
    changes: dict[str, Any] = {}
    for key, value in data.items():
        if key == "tiers":
            for name, tier_data in (value or {}).items():
                if name not in Tier.__members__.values():
                    raise ValueError(f"tiers: unknown tier {name!r} (gold, silver, bronze)")
                changes[name] = _tier_from_mapping(name, tier_data or {}, base.tier(name))
        elif key in _TOP_KEYS:
            changes[key] = value
        else:
            raise ValueError(f"unknown key {key!r} (known: tiers, {', '.join(sorted(_TOP_KEYS))})")
    config = TiersConfig(**{**{f.name: getattr(base, f.name) for f in fields(base)}, **changes})
    if config.default_tier not in Tier.__members__.values():
        raise ValueError(f"default_tier: {config.default_tier!r} is not gold, silver or bronze")
    if not 1 <= config.min_batch_cap <= config.max_batch_cap:
        raise ValueError("min_batch_cap and max_batch_cap: need 1 <= min <= max")
    if not config.window_s > 0 or not config.control_interval_s > 0:
        raise ValueError("window_s and control_interval_s must be > 0")
    if type(config.gold_step_tokens) is not int or config.gold_step_tokens < 0:
        raise ValueError(f"gold_step_tokens: a whole number >= 0, got {config.gold_step_tokens!r}")
    return config


def _tier_from_mapping(name: str, data: Mapping[str, Any], base: TierConfig) -> TierConfig:
    values = {f.name: getattr(base, f.name) for f in fields(base)}
    for key, value in data.items():
        if key not in _TIER_KEYS:
            raise ValueError(f"tiers.{name}: unknown key {key!r} (known: {', '.join(_TIER_KEYS)})")
        number = float(value)
        minimum_ok = number >= 0 if key == "priority_offset_ms" else number > 0
        if not math.isfinite(number) or not minimum_ok:
            raise ValueError(f"tiers.{name}.{key}: out of range, got {value!r}")
        values[_TIER_KEYS[key]] = number / 1000 if key.endswith("_ms") else number
    if values["max_batch_share"] > 1:
        raise ValueError(f"tiers.{name}.max_batch_share: must be in (0, 1]")
    return TierConfig(**values)


def load_tiers_file(path: str | Path, base: TiersConfig | None = None) -> TiersConfig:
    """Read a tiers YAML file (format in `bench/tiers-cpu.yaml` and the README).

    Raises:
        OSError: the file cannot be read.
        ValueError: it is not valid YAML or holds an unknown key or a bad value.
    """
    text = Path(path).read_text()
    try:
        data = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: not valid YAML: {exc}") from None
    if not isinstance(data, Mapping):
        raise ValueError(f"{path}: expected a mapping at the top level")
    try:
        return tiers_config_from_mapping(data, base)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{path}: {exc}") from None
