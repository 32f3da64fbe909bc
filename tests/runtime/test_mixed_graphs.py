"""Mixed steps in fixed shapes (what the mixed-step CUDA graphs capture) against the eager
dynamic path, on the CPU: the Triton kernels in the interpreter (`conftest.py` switches it on),
and the CPU runner."""

from __future__ import annotations

import random
from dataclasses import replace

import numpy as np
import pytest
import torch

from sitsd.builder import RuntimeInfo, build_runner, graphs_summary
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig
from sitsd.model.arch import arch_from_hf_config
from sitsd.model.llama import LlamaModel, build_weights
from sitsd.model.ops import cpu_kernels, triton_kernels
from sitsd.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sitsd.runtime.input_batch import CachedRequestState, StepInputBuilder
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.runtime.mixed_graphs import MixedGraphs, token_buckets
from sitsd.types import SamplingParams
from tests.runtime.test_weight_slots import greedy, runner_with_two_versions, tiny
from tests.weights.tiny_models import state_dict_of, tiny_llama_model

BLOCK = 16
NUM_BLOCKS = 40
MAX_SEQS = 6
MAX_TOKENS = 64  # buckets 16, 32, 64


def test_token_buckets_double_from_16_and_end_at_the_budget():
    assert token_buckets(1024) == [16, 32, 64, 128, 256, 512, 1024]
    assert token_buckets(1000) == [16, 32, 64, 128, 256, 512, 1000]
    assert token_buckets(16) == [16]
    assert token_buckets(5) == [5]
    with pytest.raises(ValueError, match="positive"):
        token_buckets(0)
    budget = random.randrange(1, 5000)
    buckets = token_buckets(budget)
    assert buckets == sorted(set(buckets))
    assert buckets[-1] == budget
    num_tokens = random.randrange(1, budget + 1)
    bucket = next(b for b in buckets if b >= num_tokens)
    assert bucket < 2 * num_tokens or bucket == 16  # padding at most doubles a step


def make_batch(rng: random.Random, case: str, vocab: int):
    """(states, num_scheduled) of one mixed step: decodes over cached contexts, prompt chunks
    after cached prefixes (some reaching their prompt's end, some not), in shuffled blocks."""
    if case == "decodes_and_chunks":
        decodes = [rng.randrange(1, 60) for _ in range(rng.randrange(1, 4))]
        chunks = [(rng.randrange(1, 14), rng.randrange(0, 40)) for _ in range(rng.randrange(1, 3))]
    elif case == "at_bucket_edge":  # 32 tokens: exactly a bucket
        decodes = [rng.randrange(1, 60) for _ in range(3)]
        chunks = [(20, rng.randrange(0, 40)), (9, 0)]
    elif case == "below_bucket_edge":  # 31 tokens
        decodes = [rng.randrange(1, 60)]
        chunks = [(30, rng.randrange(1, 40))]
    elif case == "single_sequence":
        decodes, chunks = [], [(rng.randrange(1, 40), rng.choice([0, rng.randrange(1, 50)]))]
    else:  # "max_num_seqs": as many sequences as the step may hold
        decodes = [rng.randrange(1, 60) for _ in range(MAX_SEQS - 2)]
        chunks = [(rng.randrange(2, 9), rng.randrange(0, 30)) for _ in range(2)]
    blocks = iter(rng.sample(range(NUM_BLOCKS), NUM_BLOCKS))  # holes: no block follows its own
    params = SamplingParams()
    states, sched = [], {}

    def add(req_id: str, num_tokens: int, num_computed: int, num_scheduled: int) -> None:
        ids = [rng.randrange(vocab) for _ in range(num_tokens)]
        table = [next(blocks) for _ in range(-(-num_tokens // BLOCK))]
        states.append(CachedRequestState(req_id, ids, num_tokens, params, 0, table, num_computed))
        sched[req_id] = num_scheduled

    for i, context in enumerate(decodes):
        add(f"d{i}", context + 1, context, 1)
    for i, (chunk, prefix) in enumerate(chunks):
        tail = rng.choice([0, 0, rng.randrange(1, 5)])  # > 0: the chunk ends mid-prompt
        add(f"p{i}", prefix + chunk + tail, prefix, chunk)
    rng.shuffle(states)
    return states, sched


def dirty(builder: StepInputBuilder, rng: np.random.Generator) -> None:
    """Leftovers of an earlier, larger step in every buffer: padding must overwrite them."""
    for name, t in vars(builder.host).items():
        high = NUM_BLOCKS if name == "block_tables" else MAX_TOKENS
        if name == "slot_mapping":
            high = NUM_BLOCKS * BLOCK
        t.copy_(torch.from_numpy(rng.integers(0, high, size=tuple(t.shape))))


# Padding tokens' rows hold whatever memory held (no sequence owns them; nothing reads them
# into a real row): the interpreter warns when their garbage overflows.
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.parametrize("num_kv_heads", [4, 1])  # GQA ratios 1 and 4
@pytest.mark.parametrize(
    "case",
    ["decodes_and_chunks", "at_bucket_edge", "below_bucket_edge", "single_sequence",
     "max_num_seqs"],
)  # fmt: skip
def test_a_fixed_shape_mixed_step_gives_the_eager_steps_logits_and_kv(case, num_kv_heads):
    seed = random.randrange(2**31)
    print(f"seed {seed}")
    rng = random.Random(seed)
    hf = tiny_llama_model(seed=rng.randrange(1000), num_kv_heads=num_kv_heads)
    arch = arch_from_hf_config(hf.config.to_dict())
    weights = build_weights(arch, state_dict_of(hf), "cpu", torch.float32)
    model = LlamaModel(arch, triton_kernels(), 256, "cpu")
    states, sched = make_batch(rng, case, arch.vocab_size)
    num_tokens = sum(sched.values())
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    for cache in kv:  # the cached contexts: any values, the same for both paths
        for t in cache:
            t.copy_(torch.randn_like(t))
    kv_static = [(k.clone(), v.clone()) for k, v in kv]
    max_blocks = 256 // BLOCK

    def new_builder() -> StepInputBuilder:
        return StepInputBuilder(MAX_TOKENS, MAX_SEQS, max_blocks, BLOCK, torch.device("cpu"))

    with torch.inference_mode():
        inputs = new_builder().build(states, sched)
        hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
        want = model.compute_logits(weights, hidden[inputs.logits_indices])

        builder = new_builder()
        dirty(builder, np.random.default_rng(seed))
        mixed = MixedGraphs(model, builder, kv_static, weights, token_buckets(MAX_TOKENS))
        assert mixed.fits(num_tokens, len(states))
        bucket = mixed.bucket_for(num_tokens)
        static = builder.build(states, sched, pad_tokens_to=bucket)
        logits = mixed.run(bucket)

    assert bucket == next(b for b in (16, 32, 64) if b >= num_tokens)
    assert static.input_ids.shape == (bucket,)
    assert logits.shape == (min(bucket, MAX_SEQS), arch.vocab_size)
    assert static.sampled_req_ids == inputs.sampled_req_ids
    assert static.num_tokens == num_tokens
    torch.testing.assert_close(logits[: len(inputs.sampled_req_ids)], want, atol=2e-5, rtol=1e-4)
    for (k, v), (ks, vs) in zip(kv, kv_static, strict=True):  # padding wrote no KV
        torch.testing.assert_close(ks, k, atol=2e-5, rtol=1e-4)
        torch.testing.assert_close(vs, v, atol=2e-5, rtol=1e-4)


def test_mixed_graphs_is_a_cuda_flag_the_cpu_runner_ignores():
    arch, tensors = tiny(1)
    cfg = SitsdConfig(
        model=ModelConfig(max_model_len=256, mixed_graphs=True),
        cache=CacheConfig(num_blocks=16, block_size=BLOCK),
    )
    runner, info = build_runner(cfg, arch, tensors, "v1")
    assert not runner.slot_mixed
    assert info.mixed_graph_buckets == ()
    assert ModelConfig().mixed_graphs is None  # on with CUDA graphs, unless turned off


def test_a_step_past_the_largest_bucket_or_of_no_tokens_does_not_fit():
    arch, tensors = tiny(1)
    weights = build_weights(arch, tensors, "cpu", torch.float32)
    model = LlamaModel(arch, cpu_kernels(), 256, "cpu")
    builder = StepInputBuilder(MAX_TOKENS, MAX_SEQS, 16, BLOCK, torch.device("cpu"))
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    mixed = MixedGraphs(model, builder, kv, weights, [16, 32])
    assert mixed.fits(32, MAX_SEQS)
    assert not mixed.fits(33, 1)
    assert not mixed.fits(0, 0)
    assert not mixed.fits(16, MAX_SEQS + 1)
    with pytest.raises(ValueError, match="exceeds"):
        MixedGraphs(model, builder, kv, weights, [16, MAX_TOKENS * 2])


def cpu_runner(tensors, arch, max_num_batched_tokens: int = 96):
    cfg = SitsdConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(num_blocks=96, block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=max_num_batched_tokens),
    )
    runner, _ = build_runner(cfg, arch, tensors, "v1")
    return runner


def staggered(
    runner, prompts: dict[str, tuple[list[int], str]], num_new: int, chunk: int
) -> dict[str, list]:
    """Greedy generation of requests (prompt, weights version) where the i-th arrives at step
    i and its prompt is computed in chunks of `chunk` tokens: most steps carry decodes and
    prompt chunks together."""
    params = SamplingParams(max_tokens=num_new, temperature=0.0)
    ids = iter(range(runner.kv_caches[0][0].shape[0]))
    done = dict.fromkeys(prompts, 0)  # computed tokens
    tokens: dict[str, list[int]] = {r: [] for r in prompts}
    started: set[str] = set()
    for step in range(200):
        new, cached, sched = [], [], {}
        for i, (r, (p, version)) in enumerate(prompts.items()):
            if i > step or len(tokens[r]) >= num_new:
                continue
            known = len(p) + len(tokens[r])
            n = min(chunk, known - done[r])
            if r not in started:
                table = [next(ids) for _ in range(-(-(len(p) + num_new) // BLOCK))]
                new.append(NewRequestData(r, list(p), len(p), params, 0, table, 0, version))
                started.add(r)
            else:
                cached.append(CachedRequestData(r, [], done[r]))
            sched[r] = n
        if not sched:
            break
        total = sum(sched.values())
        out = runner.execute(
            SchedulerOutput(new_reqs=new, cached_reqs=cached, num_scheduled_tokens=sched,
                            total_num_scheduled_tokens=total)
        )  # fmt: skip
        for r, t in zip(out.req_ids, out.sampled_token_ids):
            done[r] += sched[r]
            tokens[r] += t
    return tokens


def test_cpu_runner_with_fixed_shape_mixed_steps_generates_what_the_eager_runner_does(rng):
    arch, tensors = tiny(random.randrange(1000))
    prompts = {f"r{i}": ([rng.randrange(arch.vocab_size) for _ in range(rng.randrange(3, 70))],
                         "v1") for i in range(5)}  # fmt: skip
    eager = staggered(cpu_runner(tensors, arch), prompts, 6, chunk=24)
    runner = cpu_runner(tensors, arch)
    runner.prepare_mixed_steps(token_buckets(runner.builder.max_num_tokens), capture=False)
    calls = []
    mixed = runner.slot_mixed[runner.slots.active]
    run = mixed.run
    mixed.run = lambda bucket: calls.append(bucket) or run(bucket)  # type: ignore[method-assign]
    assert staggered(runner, prompts, 6, chunk=24) == eager
    assert calls, "no step ran in fixed shapes"
    assert set(calls) <= set(mixed.buckets)


def test_the_start_up_log_names_decode_and_token_buckets():
    info = RuntimeInfo(64, 256, (1, 2, 4), 1.25, 2, "", (16, 32, 48), 2.5)
    summary = graphs_summary(info)
    assert "buckets [1, 2, 4] captured in 1.2s" in summary
    assert "token buckets [16, 32, 48] captured in 2.5s" in summary
    assert "--no-mixed-graphs" in graphs_summary(replace(info, mixed_graph_buckets=()))
    assert graphs_summary(replace(info, graph_buckets=())) == "off (eager)"


def test_each_version_runs_its_own_slot_in_fixed_shape_mixed_steps(rng):
    runner, arch = runner_with_two_versions()
    prompts = {f"r{i}": [rng.randrange(arch.vocab_size) for _ in range(rng.randrange(5, 40))]
               for i in range(3)}  # fmt: skip
    both = {f"{r}-{v}": (p, v) for r, p in prompts.items() for v in ("v1", "v2")}
    want = greedy(runner, both, 5)
    runner.prepare_mixed_steps(token_buckets(runner.builder.max_num_tokens), capture=False)
    assert sorted(runner.slot_mixed) == [0, 1]
    assert greedy(runner, both, 5) == want
    assert any(want[f"{r}-v1"] != want[f"{r}-v2"] for r in prompts), "versions must differ"
