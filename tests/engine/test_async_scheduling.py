"""Asynchronous scheduling on simulated steps: step N+1 is scheduled and launched before step
N's output is applied, as `EngineCore` does with `async_scheduling`. The fake runner checks every
KV read and write; outputs must equal one-step-at-a-time scheduling, and no block may leak."""

from __future__ import annotations

import random

import pytest

from sitsd.config import SchedulerConfig, TierConfig, TiersConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.types import FinishReason, SamplingParams, Tier
from tests.engine.fakes import FakeRunner
from tests.engine.stepping import drive

BLOCK = 4
EOS = 700  # the fake model counts up: requests passing this id stop there


def make(policy: str, ahead: bool, num_blocks: int) -> tuple[Scheduler, FakeRunner]:
    slow = TierConfig(ttft_p99_s=100, itl_p99_s=100, max_queue_wait_s=1000)
    config = SchedulerConfig(max_num_seqs=6, max_num_batched_tokens=40, policy=policy,
                             async_scheduling=ahead)  # fmt: skip
    tiers = TiersConfig(gold=slow, silver=slow, bronze=slow, gold_step_tokens=16)
    sched = Scheduler(config, KVCacheManager(num_blocks, BLOCK), 128, tiers=tiers)
    return sched, FakeRunner(BLOCK, vocab_size=1000)


def workload(seed: int) -> list[tuple[int, Request]]:
    """(step to arrive at, request): prompts of 1-30 tokens, 1-40 outputs, some past EOS."""
    rng = random.Random(seed)
    out = []
    for i in range(40):
        start = rng.randrange(600, 720)
        request = Request(
            req_id=f"r{i}", prompt_token_ids=[start + k % 3 for k in range(rng.randrange(1, 31))],
            params=SamplingParams(max_tokens=rng.randrange(1, 41), ignore_eos=rng.random() < 0.3),
            seed=0, tier=rng.choice(list(Tier)), arrival_time=0.0, weights_version="fake@0",
            eos_token_ids=frozenset({EOS}),
        )  # fmt: skip
        out.append((rng.randrange(0, 60), request))
    return sorted(out, key=lambda x: x[0])


def run(sched: Scheduler, runner: FakeRunner, arrivals, ahead: bool, aborts: float = 0.0):
    """Drive the scheduler like the engine core; {req_id: (tokens, finish reason)}."""
    rng = random.Random(7)
    results: dict[str, tuple[list[int], FinishReason | None]] = {}

    def record(update) -> None:
        tokens, _ = results.get(update.request.req_id, ([], None))
        results[update.request.req_id] = (tokens + update.new_token_ids, update.finish_reason)

    def abort_some() -> None:
        if aborts and sched.requests and rng.random() < aborts:
            victim = rng.choice(sorted(sched.requests))
            sched.finish_request(victim, FinishReason.ABORT)
            results[victim] = (results.get(victim, ([], None))[0], FinishReason.ABORT)

    drive(sched, runner, arrivals, ahead, record, abort_some)
    return results


@pytest.mark.parametrize("policy", ["fcfs", "tiers"])
@pytest.mark.parametrize("num_blocks", [200, 24])  # 24: blocks run out, requests are preempted
def test_steps_scheduled_ahead_produce_what_steps_in_turn_do(policy, num_blocks):
    seed = random.randrange(10**6)
    sync = run(*make(policy, False, num_blocks), workload(seed), ahead=False)
    sched, runner = make(policy, True, num_blocks)
    ahead = run(sched, runner, workload(seed), ahead=True)
    assert ahead == sync, f"seed {seed}"
    assert all(reason is not None for _, reason in ahead.values())
    assert sched.kv_cache.num_used_blocks == 0
    assert sched.kv_cache.pool.num_free_blocks == num_blocks
    if num_blocks == 24:
        assert sched.num_preemptions > 0


def test_a_request_that_stops_is_finished_one_step_late_and_its_extra_token_dropped():
    sched, runner = make("fcfs", True, 64)
    request = workload(1)[0][1]
    request.params = SamplingParams(max_tokens=50)
    request.prompt_token_ids = [EOS - 3]
    sched.add_request(request)
    results = run(sched, runner, [], ahead=True)
    assert results[request.req_id] == ([EOS - 2, EOS - 1, EOS], FinishReason.STOP)
    # The runner computed one step past the stop: its token went nowhere.
    assert runner.num_steps == 3 + 1  # three tokens, then the step that computed past EOS


def test_no_block_leaks_with_aborts_between_steps_scheduled_ahead():
    for seed in range(5):
        sched, runner = make("tiers", True, 24)
        results = run(sched, runner, workload(seed), ahead=True, aborts=0.05)
        assert any(reason is FinishReason.ABORT for _, reason in results.values())
        assert sched.kv_cache.num_used_blocks == 0
        assert sched.kv_cache.pool.num_free_blocks == 24
