"""Scheduler: token budget, chunked prefill, prefix caching, preemption, block accounting.

Every test runs under both policies: with one tier in play, `tiers` must schedule exactly
like `fcfs` (the tier-specific rules are pinned in `test_scheduler_tiers.py`).
"""

from __future__ import annotations

import random

import pytest

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request, RequestStatus
from sitsd.engine.scheduler import Scheduler
from sitsd.types import FinishReason, SamplingParams, Tier
from tests.engine.fakes import FakeRunner

BLOCK = 4


@pytest.fixture(params=["fcfs", "tiers"], autouse=True)
def policy(request):
    return request.param


def make_scheduler(
    policy, num_blocks=64, max_num_seqs=8, budget=64, max_model_len=256, caching=True
):
    kv = KVCacheManager(num_blocks, BLOCK, enable_prefix_caching=caching)
    cfg = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, policy=policy)
    return Scheduler(cfg, kv, max_model_len, clock=lambda: 0.0), FakeRunner(BLOCK)


def make_request(req_id, prompt, max_tokens=8, eos=(), **params):
    return Request(
        req_id=req_id,
        prompt_token_ids=list(prompt),
        params=SamplingParams(max_tokens=max_tokens, **params),
        seed=0,
        tier=Tier.SILVER,
        arrival_time=0.0,
        eos_token_ids=frozenset(eos),
        weights_version="fake@0",
    )


def run_step(sched, runner):
    so = sched.schedule()
    out = runner.execute(so)
    return so, sched.update_from_output(so, out)


def run_to_completion(sched, runner, max_steps=1000):
    finished = {}
    for _ in range(max_steps):
        if not sched.has_work():
            return finished
        _, updates = run_step(sched, runner)
        for u in updates:
            if u.finish_reason is not None:
                finished[u.request.req_id] = u.request
    raise AssertionError("requests did not finish")


def test_request_generates_max_tokens_then_frees_its_blocks(policy):
    sched, runner = make_scheduler(policy)
    sched.add_request(make_request("a", range(10), max_tokens=5))
    done = run_to_completion(sched, runner)
    req = done["a"]
    assert req.finish_reason is FinishReason.LENGTH
    assert req.output_token_ids == [10, 11, 12, 13, 14]
    assert sched.kv_cache.num_used_blocks == 0


def test_long_prompt_is_prefilled_in_chunks_under_the_budget(policy):
    sched, runner = make_scheduler(policy, budget=16)
    sched.add_request(make_request("a", range(40), max_tokens=2))
    so, updates = run_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 16}
    assert updates == []
    so, _ = run_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 16}
    so, updates = run_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 8}
    assert updates[0].new_token_ids == [40]


def test_decodes_and_prefill_chunks_share_one_step(policy):
    sched, runner = make_scheduler(policy, budget=20)
    sched.add_request(make_request("a", range(5), max_tokens=10))
    run_step(sched, runner)
    sched.add_request(make_request("b", range(100, 150), max_tokens=2))
    so, _ = run_step(sched, runner)
    assert so.num_scheduled_tokens == {"a": 1, "b": 19}


def test_eos_and_stop_token_ids_finish_with_stop(policy):
    sched, runner = make_scheduler(policy)
    sched.add_request(make_request("eos", [1, 2, 3], max_tokens=10, eos={6}))
    sched.add_request(make_request("stop", [10, 20], max_tokens=10, stop_token_ids=(23,)))
    sched.add_request(make_request("ignore", [1, 2, 3], max_tokens=5, eos={6}, ignore_eos=True))
    done = run_to_completion(sched, runner)
    assert done["eos"].output_token_ids == [4, 5, 6]
    assert done["eos"].finish_reason is FinishReason.STOP
    assert done["stop"].output_token_ids == [21, 22, 23]
    assert done["ignore"].output_token_ids == [4, 5, 6, 7, 8]
    assert done["ignore"].finish_reason is FinishReason.LENGTH


def test_context_length_limit_finishes_with_length(policy):
    sched, runner = make_scheduler(policy, max_model_len=12)
    sched.add_request(make_request("a", range(10), max_tokens=100))
    done = run_to_completion(sched, runner)
    assert done["a"].num_tokens == 12
    assert done["a"].finish_reason is FinishReason.LENGTH


def test_repeated_prompt_prefix_is_served_from_the_cache(policy):
    sched, runner = make_scheduler(policy)
    prompt = [random.randrange(1000) for _ in range(23)]  # 5 full blocks + 3 tokens
    sched.add_request(make_request("first", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("second", [*prompt[:20], 999, 998], max_tokens=1))
    so = sched.schedule()
    (new,) = so.new_reqs
    assert new.num_computed_tokens == 20
    assert so.num_scheduled_tokens["second"] == 2
    assert sched.kv_cache.prefix_cache_hits == 20
    assert sched.kv_cache.prefix_cache_queries == 23 + 22


def test_fully_cached_prompt_still_computes_its_last_token(policy):
    sched, runner = make_scheduler(policy)
    prompt = list(range(16))  # exactly 4 blocks
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    sched.add_request(make_request("b", prompt, max_tokens=1))
    so = sched.schedule()
    assert so.new_reqs[0].num_computed_tokens == 12
    assert so.num_scheduled_tokens["b"] == 4


def test_prefix_cache_is_keyed_by_weights_version(policy):
    sched, runner = make_scheduler(policy)
    prompt = list(range(20))
    sched.add_request(make_request("a", prompt, max_tokens=1))
    run_to_completion(sched, runner)
    other = make_request("b", prompt, max_tokens=1)
    other.weights_version = "fake@1"
    sched.add_request(other)
    assert sched.schedule().new_reqs[0].num_computed_tokens == 0


def test_out_of_blocks_preempts_the_newest_and_recomputes_it(policy):
    # 6 blocks of 4 tokens: two requests of 8-token prompts fit, then they outgrow the pool.
    sched, runner = make_scheduler(policy, num_blocks=6, caching=False)
    sched.add_request(make_request("old", range(8), max_tokens=10))
    sched.add_request(make_request("new", range(100, 108), max_tokens=10))
    preempted = set()
    finished = {}
    for _ in range(200):
        if not sched.has_work():
            break
        so, updates = run_step(sched, runner)
        preempted |= so.preempted_req_ids
        assert sched.kv_cache.num_used_blocks <= 6
        finished |= {u.request.req_id: u.request for u in updates if u.finish_reason}
    assert preempted == {"new"}
    assert finished["old"].output_token_ids == list(range(8, 18))
    # Recomputed after preemption, it continues exactly where it stopped.
    assert finished["new"].output_token_ids == list(range(108, 118))
    assert finished["new"].num_preemptions >= 1
    assert sched.kv_cache.num_used_blocks == 0


def test_request_that_cannot_fit_waits_instead_of_failing(policy):
    sched, runner = make_scheduler(policy, num_blocks=4)
    sched.add_request(make_request("a", range(12), max_tokens=3))
    sched.add_request(make_request("b", range(12), max_tokens=3))
    so = sched.schedule()
    assert [n.req_id for n in so.new_reqs] == ["a"]
    runner.execute(so)
    assert sched.num_waiting == 1


def test_batch_is_capped_at_max_num_seqs(policy):
    sched, _runner = make_scheduler(policy, max_num_seqs=3)
    for i in range(5):
        sched.add_request(make_request(f"r{i}", range(i, i + 4), max_tokens=2))
    so = sched.schedule()
    assert len(so.new_reqs) == 3
    assert sched.num_waiting == 2


def test_finish_request_aborts_waiting_and_running_and_frees_blocks(policy):
    sched, runner = make_scheduler(policy, max_num_seqs=1)
    sched.add_request(make_request("running", range(10), max_tokens=50))
    sched.add_request(make_request("waiting", range(10), max_tokens=50))
    run_step(sched, runner)
    assert sched.kv_cache.num_used_blocks > 0
    assert sched.finish_request("waiting", FinishReason.ABORT).status is RequestStatus.FINISHED
    assert sched.finish_request("running", FinishReason.ABORT).finish_reason is FinishReason.ABORT
    assert sched.finish_request("running", FinishReason.ABORT) is None
    assert sched.kv_cache.num_used_blocks == 0
    assert not sched.has_work()
    assert sched.schedule().finished_req_ids == {"waiting", "running"}


def test_adding_a_live_request_id_twice_is_refused(policy):
    sched, _ = make_scheduler(policy)
    sched.add_request(make_request("a", [1, 2]))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add_request(make_request("a", [1, 2]))


def test_random_mix_of_finish_cancel_preempt_leaves_every_block_free(rng, policy):
    sched, runner = make_scheduler(policy, num_blocks=24, max_num_seqs=6, budget=24)
    live = set()
    for step in range(400):
        if step < 300 and rng.random() < 0.4:
            req_id = f"r{step}"
            prompt = [rng.randrange(50) for _ in range(rng.randrange(1, 30))]
            sched.add_request(make_request(req_id, prompt, max_tokens=rng.randrange(1, 20)))
            live.add(req_id)
        if live and rng.random() < 0.1:
            victim = rng.choice(sorted(live))
            sched.finish_request(victim, FinishReason.ABORT)
        if sched.has_work():
            _, updates = run_step(sched, runner)
            for u in updates:
                assert len(u.request.output_token_ids) <= u.request.params.max_tokens
        live &= set(sched.requests)
        used = sched.kv_cache.num_used_blocks
        assert used <= 24
        held = sum(len(sched.kv_cache.block_ids(r)) for r in sched.running)
        assert held >= used  # every used block belongs to a running request
    assert sched.num_preemptions > 0, "the mix must exercise preemption"
    for req_id in list(sched.requests):
        sched.finish_request(req_id, FinishReason.ABORT)
    assert sched.kv_cache.num_used_blocks == 0
    assert sched.kv_cache.pool.num_free_blocks == 24


def test_a_finish_in_a_step_with_nothing_to_run_reaches_the_runner_with_the_next_step(policy):
    sched, runner = make_scheduler(policy)
    sched.add_request(make_request("a", range(8)))
    run_step(sched, runner)
    sched.finish_request("a", FinishReason.ABORT)
    empty = sched.schedule()  # nothing runs, so the engine launches nothing
    assert empty.is_empty
    sched.add_request(make_request("b", range(100, 104)))
    so = sched.schedule()
    assert "a" in so.finished_req_ids  # the runner drops its state now
    runner.execute(so)
    assert "a" not in runner.tokens
