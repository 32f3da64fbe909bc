"""Tier plumbing: the sliding-window P99 and finding controller plugins."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sitsd.config import TiersConfig
from sitsd.engine.latency import SlidingWindowQuantile
from sitsd.engine.tiers import load_batch_controller
from sitsd.plugins.p99_caps import P99BatchController
from sitsd.types import Tier

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_windowed_p99_is_the_exact_nearest_rank_quantile_of_the_window(rng):
    window = SlidingWindowQuantile(window_s=10.0)
    values = [rng.expovariate(10.0) for _ in range(500)]
    for i, value in enumerate(values):
        window.add(i * 0.01, value)
    expected = sorted(values)[math.ceil(0.99 * 500) - 1]
    assert window.quantile(0.99, now=5.0) == expected
    assert window.quantile(0.5, now=5.0) == sorted(values)[249]


def test_windowed_p99_forgets_samples_older_than_the_window():
    window = SlidingWindowQuantile(window_s=2.0)
    window.add(0.0, 9.0)  # a spike, then calm
    for i in range(10):
        window.add(1.0 + i * 0.1, 0.1)
    assert window.quantile(0.99, now=1.9) == 9.0
    assert window.quantile(0.99, now=2.5) == 0.1
    assert window.count(now=2.5) == 10
    assert window.quantile(0.99, now=10.0) is None


def test_windowed_p99_keeps_only_the_newest_max_samples():
    window = SlidingWindowQuantile(window_s=100.0, max_samples=10)
    for i in range(30):
        window.add(float(i), float(i))
    assert window.count(now=30.0) == 10
    assert window.quantile(0.01, now=30.0) == 20.0


def test_default_controller_is_the_builtin_p99_caps():
    assert isinstance(load_batch_controller(TiersConfig(), 32), P99BatchController)


def test_controller_plugin_is_found_in_a_plugin_dir():
    config = TiersConfig(controller="fixed-caps", plugin_dirs=(str(REPO_ROOT / "plugins"),))
    controller = load_batch_controller(config, 16)
    assert controller.update({}, 0.0) == {Tier.GOLD: 16, Tier.SILVER: 8, Tier.BRONZE: 4}


def test_unknown_controller_is_an_error_listing_where_it_was_looked_for():
    with pytest.raises(ValueError, match=r"batch_controller\.<name>"):
        load_batch_controller(TiersConfig(controller="nope"), 8)
