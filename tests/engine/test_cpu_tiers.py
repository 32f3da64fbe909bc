"""The default tiers fit the device: on a CPU, where one engine step takes a good part of a
second, the GPU figures (gold 120 ms in the queue) refused nearly every request of a light load;
the CPU table admits it, and a refusal says what to change."""

from __future__ import annotations

import random

import pytest

from sitsd.config import TiersConfig, default_tiers
from sitsd.engine.admission import QueueSnapshot, RunningEntry, WaitingEntry, refusal_reason
from sitsd.engine.tiers import queue_key
from sitsd.types import TIER_ORDER, Tier


def light_cpu_load(rng: random.Random, tier: Tier) -> QueueSnapshot:
    """Two clients, one after the other: one request decoding, one whose prompt waits for the
    next step, on a CPU whose steps with a prompt chunk take 0.6-2 s (SmolLM2 on two busy
    cores): longer than every GPU queue wait (bronze's 500 ms), well inside the CPU ones."""
    return QueueSnapshot(
        enabled=True,
        step_time_s=rng.uniform(0.6, 2.0),
        token_budget=1024,
        max_num_seqs=32,
        waiting=(WaitingEntry(key=0.0, tier=tier, num_prefill_tokens=rng.randint(32, 256)),),
        running=(
            RunningEntry(
                tier=tier, num_remaining_steps=rng.randint(16, 128), preemptable_by_gold=False
            ),
        ),
    )


@pytest.mark.parametrize("tier", TIER_ORDER)
def test_a_light_cpu_load_is_admitted_by_the_cpu_defaults_and_was_refused_by_the_gpu_ones(
    rng, tier
):
    snapshot = light_cpu_load(rng, tier)
    for tiers, refused in ((default_tiers("cpu"), False), (TiersConfig(), True)):
        config = tiers.tier(tier.value)
        key = queue_key(1e-3, config)  # arrived just after the one waiting
        reason = refusal_reason(snapshot, tier, key, config.max_queue_wait_s)
        assert (reason is not None) is refused, (tier, tiers)


def test_a_refusal_says_what_to_change(rng):
    snapshot = light_cpu_load(rng, Tier.SILVER)
    refusal = refusal_reason(snapshot, Tier.SILVER, 1.0, TiersConfig().silver.max_queue_wait_s)
    assert refusal is not None
    reason = refusal.message
    assert reason.startswith("overloaded: expected queue wait ")
    assert "exceeds the silver tier's 250 ms" in reason
    assert "tiers.silver.max_queue_wait_ms in the daemon's --tiers file" in reason
    assert "a tier that may wait longer" in reason
