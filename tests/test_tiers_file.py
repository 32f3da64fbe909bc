"""The tiers file: targets in milliseconds, unknown keys and bad values refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest

from sitsd.config import SITS_BRONZE, SITS_GOLD, SITS_SILVER, TiersConfig
from sitsd.tiers_file import load_tiers_file

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_builtin_tiers_are_the_sits_table():
    config = TiersConfig()
    assert (config.gold.ttft_p99_s, config.gold.max_queue_wait_s) == (0.08, 0.12)
    assert (config.silver.ttft_p99_s, config.silver.max_queue_wait_s) == (0.2, 0.25)
    assert config.bronze.max_queue_wait_s == 0.5
    assert config.bronze.ttft_p99_s > 0.2


def test_tiers_file_sets_targets_in_milliseconds_and_keeps_the_rest(tmp_path):
    path = tmp_path / "tiers.yaml"
    path.write_text(
        "default_tier: bronze\n"
        "window_s: 5\n"
        "gold_step_tokens: 256\n"
        "tiers:\n"
        "  gold: {ttft_p99_ms: 500, itl_p99_ms: 250, max_queue_wait_ms: 700}\n"
        "  bronze: {max_batch_share: 0.5, priority_offset_ms: 0}\n"
    )
    config = load_tiers_file(path)
    assert config.default_tier == "bronze"
    assert config.window_s == 5
    assert config.gold_step_tokens == 256
    assert (config.gold.ttft_p99_s, config.gold.itl_p99_s) == (0.5, 0.25)
    assert config.gold.max_queue_wait_s == 0.7
    assert config.gold.priority_offset_s == SITS_GOLD.priority_offset_s
    assert config.silver == SITS_SILVER
    assert config.bronze.max_batch_share == 0.5
    assert config.bronze.priority_offset_s == 0
    assert config.bronze.ttft_p99_s == SITS_BRONZE.ttft_p99_s


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("tiers: {platinum: {}}", "unknown tier 'platinum'"),
        ("tiers: {gold: {ttft_ms: 5}}", "tiers.gold: unknown key 'ttft_ms'"),
        ("tiers: {gold: {ttft_p99_ms: -5}}", "tiers.gold.ttft_p99_ms"),
        ("tiers: {gold: {max_batch_share: 2}}", "max_batch_share"),
        ("default_tier: tin", "default_tier"),
        ("speed: 11", "unknown key 'speed'"),
        ("gold_step_tokens: -1", "gold_step_tokens"),
        ("gold_step_tokens: 1.5", "gold_step_tokens"),
        ("[1, 2]", "mapping"),
    ],
)
def test_bad_tiers_files_are_refused_naming_the_key(tmp_path, text, message):
    path = tmp_path / "tiers.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=message):
        load_tiers_file(path)


def test_the_cpu_benchmark_tiers_file_loads():
    config = load_tiers_file(REPO_ROOT / "bench" / "tiers-cpu.yaml")
    assert config.gold.ttft_p99_s < config.silver.ttft_p99_s < config.bronze.ttft_p99_s
