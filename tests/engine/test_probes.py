"""Canary probes: prompts that ride in normal engine steps as low-priority work (the canary of
a swap), through the swap port on the real engine thread, and in the scheduler by hand: they
never pause the batch, never touch the prefix cache, fail cleanly, and stay right under
asynchronous scheduling.

The fake model under version `fake@N` predicts `last + 1 + N`, so a probe's log-probabilities
tell which version computed them.
"""

from __future__ import annotations

import asyncio

import pytest

from sitsd.config import SchedulerConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.pacing import PacingSettings
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.engine.swap_port import SwapPort
from sitsd.types import FinishReason, SamplingParams, Tier
from tests.engine.fakes import FakeRunner, next_token
from tests.engine.stepping import drive
from tests.engine.test_core_swap import V0, V1, add, make_core, overlaps

__all__ = ["overlaps"]  # the fixture: sync runner, overlapping runner, asynchronous scheduling

BLOCK = 4


def predicted(prompt, version, vocab):
    return [next_token(t, version, vocab) for t in prompt]


def test_a_canary_through_the_port_runs_in_the_steps_that_serve_and_never_stalls_them(
    rng, overlaps
):
    core, runner, sink = make_core(overlaps, slow_s=0.002)
    port = SwapPort(core)
    try:
        runner.slots.load(V1)
        for i in range(3):
            add(core, f"r{i}", bytes(rng.randrange(256) for _ in range(12)), 60)
        prompts = [[rng.randrange(256) for _ in range(rng.randrange(9, 30))] for _ in range(4)]

        async def canary():
            pairs = [
                asyncio.gather(port.prompt_logprobs(p, V0), port.prompt_logprobs(p, V1))
                for p in prompts
            ]
            return await asyncio.gather(*pairs)

        results = asyncio.run(canary())
        for prompt, (active, new) in zip(prompts, results):
            assert active.argmax(-1).tolist() == predicted(prompt, V0, 256)
            assert new.argmax(-1).tolist() == predicted(prompt, V1, 256)
        deltas = sink.until_finished({"r0", "r1", "r2"})
        assert all(sum(len(d.new_token_ids) for d in ds) == 60 for ds in deltas.values())
    finally:
        core.stop()
    log = runner.step_log
    probe_steps = [i for i, s in enumerate(log) if any(r.startswith("\x00probe") for r in s)]
    assert len(probe_steps) > len(prompts), "the prompts went in chunks, over several steps"
    for req_id in ("r0", "r1", "r2"):
        ran = [i for i, s in enumerate(log) if req_id in s]
        # Every step from a request's first to its last computed a token of it: no step ran
        # the canary without it.
        assert ran == list(range(ran[0], ran[-1] + 1)), f"{req_id} missed a step"
    assert any({"r0", "r1", "r2"} & set(log[i]) for i in probe_steps), (
        "the canary rode with requests"
    )


def make_scheduler(num_blocks=64, chunk=5, async_scheduling=False):
    kv = KVCacheManager(num_blocks, BLOCK)
    cfg = SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=64, policy="fcfs",
                          async_scheduling=async_scheduling)  # fmt: skip
    return Scheduler(cfg, kv, 512, pacing=PacingSettings(fixed_tokens=chunk)), kv


def request(req_id, prompt, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    return Request(req_id, list(prompt), params, seed=0, tier=Tier.SILVER, arrival_time=0.0,
                   weights_version=V0)  # fmt: skip


@pytest.mark.parametrize("ahead", [False, True], ids=["in-turn", "asynchronous-scheduling"])
def test_probe_chunks_are_each_computed_once_in_order_in_turn_and_ahead(rng, ahead):
    sched, kv = make_scheduler(chunk=3, async_scheduling=ahead)
    runner = FakeRunner(BLOCK)
    prompt = [rng.randrange(1000) for _ in range(rng.randrange(10, 40))]
    got = {}

    def done(probe_id, error):
        assert error is None
        got["logprobs"] = runner.take_prompt_logprobs(probe_id)

    sched.probes.add(prompt, V0, done)
    arrivals = [(0, request("r", [rng.randrange(1000) for _ in range(7)], max_tokens=30))]
    drive(sched, runner, arrivals, ahead=ahead, on_update=lambda u: None)
    # The fake runner asserts each chunk starts where the last ended (no chunk twice).
    assert got["logprobs"].argmax(-1).tolist() == predicted(prompt, V0, 1000)
    assert kv.num_used_blocks == 0


def test_a_probe_reads_no_cached_block_and_leaves_none_behind():
    sched, kv = make_scheduler(chunk=64)
    runner = FakeRunner(BLOCK)
    prompt = list(range(5, 5 + 6 * BLOCK + 1))
    done = []

    def run(*requests):
        for r in requests:
            sched.add_request(r)
        while sched.has_work():
            so = sched.schedule()
            sched.update_from_output(so, runner.execute(so))

    run(request("before", prompt))  # its blocks enter the prefix cache
    sched.probes.add(prompt, V0, lambda p, e: done.append(runner.take_prompt_logprobs(p)))
    run()
    (logprobs,) = done
    assert logprobs.shape[0] == len(prompt)  # every position computed
    sched.probes.add(prompt[::-1], V0, lambda p, e: done.append(runner.take_prompt_logprobs(p)))
    run()
    hits = kv.prefix_cache_hits
    run(request("after", [*prompt[::-1], 999, 998]))
    assert kv.prefix_cache_hits == hits, "a request reused KV a probe computed"
    run(request("again", [*prompt, 999, 998]))
    assert kv.prefix_cache_hits - hits == 6 * BLOCK, "requests' blocks are cached as before"
    assert kv.num_used_blocks == 0


def test_a_probe_whose_version_leaves_its_slot_or_whose_step_fails_reports_why_and_frees_blocks():
    sched, kv = make_scheduler(chunk=2)
    runner = FakeRunner(BLOCK)
    runner.slots.load(V1)
    errors = {}
    for version in (V0, V1):
        sched.probes.add(list(range(20)), version, lambda p, e, v=version: errors.update({v: e}))
    sched.add_request(request("r", list(range(30, 40)), max_tokens=20))
    so = sched.schedule()
    sched.update_from_output(so, runner.execute(so))
    assert kv.num_used_blocks > kv.blocks_needed(11)  # the probes hold blocks
    sched.probes.fail_versions([V1], "version fake@1 left its weight slot")
    assert errors == {V1: "version fake@1 left its weight slot"}
    so = sched.schedule()
    (probe_id,) = [r for r in so.num_scheduled_tokens if r.startswith("\x00probe")]
    sched.finish_request(probe_id, FinishReason.ERROR)  # what a failed step does to its ids
    assert "step failed" in errors[V0]
    sched.finish_request("r", FinishReason.ABORT)
    assert kv.num_used_blocks == 0
    assert not sched.has_work()
