"""The model runner with steps launched ahead of the last one's result (asynchronous
scheduling), on the CPU: a decode whose input token the last step is still sampling reads it
from that step's output tensor. Tokens must equal one-step-at-a-time runs, greedy and sampled."""

from __future__ import annotations

import random

import pytest

from sitsd.builder import build_runner
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig
from sitsd.engine.kv_cache_manager import KVCacheManager
from sitsd.engine.request import Request
from sitsd.engine.scheduler import Scheduler
from sitsd.model.arch import arch_from_hf_config
from sitsd.types import SamplingParams, Tier
from tests.engine.stepping import drive
from tests.weights.tiny_models import state_dict_of, tiny_llama_model

BLOCK = 16


def generate(
    ahead: bool, temperature: float, seed: int, device: str = "cpu", mixed: bool = False
) -> dict[str, list[int]]:
    """Tokens of 7 requests. On the CPU they arrive over 10 steps with different lengths; on
    the GPU (bf16, where a batch's composition may change the last bits) all at once with one
    length, so that both modes batch the same rows."""
    model = tiny_llama_model(seed=3)
    arch, tensors = arch_from_hf_config(model.config.to_dict()), state_dict_of(model)
    on_gpu = device != "cpu"
    scheduler_config = SchedulerConfig(max_num_seqs=8 if on_gpu else 4,
                                       max_num_batched_tokens=48, policy="fcfs",
                                       async_scheduling=ahead)  # fmt: skip
    model_config = ModelConfig(max_model_len=256, device=device, mixed_graphs=mixed,
                               dtype="bfloat16" if on_gpu else "float32")  # fmt: skip
    config = SitsdConfig(model=model_config, cache=CacheConfig(num_blocks=64, block_size=BLOCK),
                         scheduler=scheduler_config)  # fmt: skip
    runner, _ = build_runner(config, arch, tensors, "v1")
    sched = Scheduler(scheduler_config, KVCacheManager(64, BLOCK), 256)
    rng = random.Random(seed)
    arrivals = []
    for i in range(7):  # prompts over several chunks
        prompt = [rng.randrange(arch.vocab_size) for _ in range(rng.randrange(1, 70))]
        max_tokens = 20 if on_gpu else rng.randrange(1, 24)
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, ignore_eos=True)
        arrives = 0 if on_gpu else rng.randrange(0, 10)
        arrivals.append((arrives, Request(f"r{i}", prompt, params, seed=i, tier=Tier.SILVER,
                                          arrival_time=0.0, weights_version="v1")))  # fmt: skip
    arrivals.sort(key=lambda x: x[0])
    tokens: dict[str, list[int]] = {}

    def record(update) -> None:
        tokens.setdefault(update.request.req_id, []).extend(update.new_token_ids)

    drive(sched, runner, arrivals, ahead, record)
    return tokens


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_steps_launched_ahead_sample_the_tokens_steps_in_turn_do(temperature):
    seed = random.randrange(10**6)
    in_turn = generate(False, temperature, seed)
    ahead = generate(True, temperature, seed)
    assert ahead == in_turn, f"seed {seed}"
    assert len(in_turn) == 7


@pytest.mark.gpu
@pytest.mark.parametrize("mixed", [False, True], ids=["decode-graphs", "mixed-graphs"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_on_the_gpu_steps_launched_ahead_sample_what_steps_in_turn_do(temperature, mixed):
    seed = random.randrange(10**6)
    in_turn = generate(False, temperature, seed, "cuda", mixed)
    ahead = generate(True, temperature, seed, "cuda", mixed)
    assert ahead == in_turn, f"seed {seed}"
    assert all(len(t) == 20 for t in in_turn.values())


@pytest.mark.parametrize("policy", ["migrate", "restart"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_swap_scheduled_ahead_computes_each_token_on_the_version_it_reports(device, policy):
    # The real runner with steps launched ahead: shadows share their request's token list,
    # which holds a placeholder for the token the step ahead samples; a shadow must never read
    # it. A restart takes requests back a few a step, in steps scheduled ahead too. Each
    # request's tokens before the switch are v1's greedy ones, after it v2's greedy
    # continuation of the same prefix.
    from sitsd.config import WeightsConfig
    from sitsd.engine.core import EngineCore
    from sitsd.engine.messages import AddRequest, SwapCommand
    from sitsd.engine.pacing import PacingSettings
    from tests.engine.test_core import Collector, wait_for
    from tests.engine.test_core_swap import Events, Steps
    from tests.engine.test_detokenizer import ByteTokenizer
    from tests.runtime.test_weight_slots import greedy, tiny

    seed = random.randrange(10**6)
    arch, first = tiny(seed, vocab_size=256)
    _, second = tiny(seed + 1, vocab_size=256)
    scheduler_config = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=64, policy="fcfs",
                                       async_scheduling=True)  # fmt: skip
    config = SitsdConfig(
        model=ModelConfig(max_model_len=256, device=device, dtype="float32"),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        scheduler=scheduler_config,
        weights=WeightsConfig(weight_slots="2"),
    )
    runner, _ = build_runner(config, arch, first, "v1")
    standby = runner.slots.standby
    runner.slots.release(standby)
    runner.slots.copy_into(standby, second)
    runner.slots.fill(standby, "v2")
    sched = Scheduler(scheduler_config, KVCacheManager(64, BLOCK), 256,
                      pacing=PacingSettings(fixed_tokens=10))  # fmt: skip
    steps = Steps()
    core = EngineCore(sched, runner, ByteTokenizer(), "tiny", observer=steps)
    sink = Collector()
    core.start(sink)
    rng = random.Random(seed)
    prompts = {f"r{i}": [rng.randrange(3, 256) for _ in range(rng.randrange(8, 20))]
               for i in range(3)}  # fmt: skip
    params = SamplingParams(max_tokens=90, temperature=0.0, ignore_eos=True)
    try:
        for r, p in prompts.items():
            core.submit(AddRequest(r, list(p), params, None, None, 0.0))
        assert wait_for(lambda: sched.num_running == 3 and all(
            sched.requests[r].num_output_tokens > 12 for r in prompts))  # fmt: skip
        events = Events()
        core.submit(SwapCommand("v2", policy, events))
        assert events.until_done()[-1].kind == "committed"
        deltas = sink.until_finished(set(prompts))
    finally:
        core.stop()
    if policy == "migrate":
        shadows = [s for s in steps.records
                   if any("shadow" in r for r in s.sched_out.num_scheduled_tokens)]  # fmt: skip
        assert sum(s.sched_out.applied_ahead for s in shadows) > 2, "shadow steps ran ahead"
    else:
        taken = [set(s.sched_out.preempted_req_ids) for s in steps.records]
        assert set().union(*taken) == set(prompts)
        assert sum(1 for t in taken if t) > 1, "a few a step, not all at once"
    for r, p in prompts.items():
        tokens = [(t, d.weights_version) for d in deltas[r] for t in d.new_token_ids]
        old = [t for t, v in tokens if v == "v1"]
        new = [t for t, v in tokens if v == "v2"]
        assert [v for _, v in tokens] == ["v1"] * len(old) + ["v2"] * len(new), f"seed {seed}"
        assert old, new
        assert greedy(runner, {r: (p, "v1")}, len(old))[r] == old, f"seed {seed}"
        assert greedy(runner, {r: (p + old, "v2")}, len(new))[r] == new, f"seed {seed}"
