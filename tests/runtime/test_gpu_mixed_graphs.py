"""Mixed-step CUDA graphs on the GPU: replays equal the eager path, per weight slot (marker
`gpu`). The CPU tests (`test_mixed_graphs.py`) check the same fixed-shape forward eagerly."""

from __future__ import annotations

import gc
import random

import pytest
import torch

from sitsd.builder import build_runner
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig, WeightsConfig
from sitsd.model.arch import arch_from_hf_config
from sitsd.model.llama import LlamaModel, build_weights
from sitsd.model.ops import triton_kernels
from sitsd.runtime.input_batch import StepInputBuilder
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.runtime.mixed_graphs import MixedGraphs, token_buckets
from tests.runtime.test_mixed_graphs import (
    BLOCK,
    MAX_SEQS,
    MAX_TOKENS,
    NUM_BLOCKS,
    make_batch,
    staggered,
)
from tests.runtime.test_weight_slots import tiny
from tests.weights.tiny_models import state_dict_of, tiny_llama_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize(("dtype", "atol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.05)])
@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_replays_of_one_capture_give_the_eager_logits_and_kv_for_many_batches(
    rng, dtype, atol, num_kv_heads
):
    hf = tiny_llama_model(seed=rng.randrange(1000), num_kv_heads=num_kv_heads)
    arch = arch_from_hf_config(hf.config.to_dict())
    weights = build_weights(arch, state_dict_of(hf), "cuda", dtype)
    model = LlamaModel(arch, triton_kernels(), 256, "cuda")
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, dtype, "cuda")
    kv_graph = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, dtype, "cuda")
    cuda = torch.device("cuda")
    eager_builder = StepInputBuilder(MAX_TOKENS, MAX_SEQS, 256 // BLOCK, BLOCK, cuda)
    builder = StepInputBuilder(MAX_TOKENS, MAX_SEQS, 256 // BLOCK, BLOCK, cuda)
    mixed = MixedGraphs(model, builder, kv_graph, weights, token_buckets(MAX_TOKENS))
    mixed.capture()
    assert mixed.captured
    cases = ["decodes_and_chunks", "at_bucket_edge", "below_bucket_edge", "single_sequence",
             "max_num_seqs"] * 3  # fmt: skip
    rng.shuffle(cases)
    for case in cases:  # one capture, replayed over batches of every size
        for (k, v), (kg, vg) in zip(kv, kv_graph, strict=True):
            k.copy_(torch.randn_like(k))
            v.copy_(torch.randn_like(v))
            kg.copy_(k)
            vg.copy_(v)
        states, sched = make_batch(rng, case, arch.vocab_size)
        with torch.inference_mode():
            inputs = eager_builder.build(states, sched)
            hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
            want = model.compute_logits(weights, hidden[inputs.logits_indices])
            bucket = mixed.bucket_for(sum(sched.values()))
            static = builder.build(states, sched, pad_tokens_to=bucket)
            got = mixed.run(bucket)[: len(static.sampled_req_ids)]
        assert static.sampled_req_ids == inputs.sampled_req_ids
        torch.testing.assert_close(got, want, atol=atol, rtol=0, msg=case)
        for (k, v), (kg, vg) in zip(kv, kv_graph, strict=True):
            torch.testing.assert_close(kg, k, atol=atol, rtol=0, msg=case)
            torch.testing.assert_close(vg, v, atol=atol, rtol=0, msg=case)


def gpu_runner(tensors, arch, *, eager: bool, mixed: bool, version: str = "v1", slots="1"):
    cfg = SitsdConfig(
        model=ModelConfig(
            device="cuda",
            dtype="float32",
            enforce_eager=eager,
            mixed_graphs=mixed,
            max_model_len=256,
        ),
        cache=CacheConfig(num_blocks=96, block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=96),
        weights=WeightsConfig(weight_slots=slots),
    )
    return build_runner(cfg, arch, tensors, version)


def count_replays(runner) -> list[int]:
    """Wrap every slot's mixed-graph `run`; returns the list the buckets are appended to."""
    calls: list[int] = []
    for mixed in runner.slot_mixed.values():
        assert mixed.captured
        run = mixed.run
        mixed.run = lambda bucket, run=run: calls.append(bucket) or run(bucket)
    return calls


def random_prompts(rng: random.Random, vocab_size: int) -> dict[str, tuple[list[int], str]]:
    """Six prompts of 3-69 tokens on version v1, for `staggered`."""
    return {f"r{i}": ([rng.randrange(vocab_size) for _ in range(rng.randrange(3, 70))], "v1")
            for i in range(6)}  # fmt: skip


def test_greedy_outputs_with_mixed_graphs_equal_eager_for_prefills_mixed_with_decodes(rng):
    arch, tensors = tiny(random.randrange(1000))
    prompts = random_prompts(rng, arch.vocab_size)
    eager, _ = gpu_runner(tensors, arch, eager=True, mixed=False)
    want = staggered(eager, prompts, 8, chunk=24)
    del eager
    runner, info = gpu_runner(tensors, arch, eager=False, mixed=True)
    assert info.mixed_graph_buckets == (16, 32, 64, 96)
    calls = count_replays(runner)
    assert staggered(runner, prompts, 8, chunk=24) == want
    assert len(set(calls)) >= 2, f"replayed buckets {sorted(set(calls))}"
    off, off_info = gpu_runner(tensors, arch, eager=False, mixed=False)
    assert not off.slot_mixed
    assert off_info.mixed_graph_buckets == ()


def test_a_runner_built_after_a_graph_runner_is_destroyed_computes_the_same_outputs(rng):
    # Destroying a runner resets its graphs, which drops the cuBLAS workspace of the stream
    # they were captured on (pytorch/pytorch#193402): later GEMMs, eager or captured by the
    # next runner, must not use it.
    arch, tensors = tiny(random.randrange(1000))
    prompts = random_prompts(rng, arch.vocab_size)
    first, _ = gpu_runner(tensors, arch, eager=False, mixed=True)
    want = staggered(first, prompts, 8, chunk=24)
    del first
    gc.collect()
    torch.cuda.empty_cache()
    a = torch.randn(64, 4096, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    torch.testing.assert_close((a @ b).float(), a.float() @ b.float(), atol=0.5, rtol=0.02)
    second, _ = gpu_runner(tensors, arch, eager=False, mixed=True)
    assert staggered(second, prompts, 8, chunk=24) == want
    torch.cuda.synchronize()


def test_each_weight_slot_replays_its_own_mixed_graphs(rng):
    arch, first = tiny(random.randrange(1000))
    _, second = tiny(random.randrange(1000, 2000))
    runner, info = gpu_runner(first, arch, eager=False, mixed=True, slots="2")
    assert info.num_weight_slots == 2
    assert sorted(runner.slot_mixed) == [0, 1]
    slots = runner.slots
    standby = slots.standby
    slots.release(standby)
    slots.copy_into(standby, second)
    slots.fill(standby, "v2")
    before = torch.cuda.memory_allocated()
    slots.activate("v2")
    assert torch.cuda.memory_allocated() == before
    calls = count_replays(runner)
    prompts = {f"r{i}": [rng.randrange(arch.vocab_size) for _ in range(rng.randrange(4, 40))]
               for i in range(3)}  # fmt: skip
    # Both versions in every step: one sub-batch (and one mixed graph) per slot.
    both = staggered(runner, {f"{r}-{v}": (p, v) for r, p in prompts.items()
                              for v in ("v1", "v2")}, 6, chunk=16)  # fmt: skip
    assert calls
    for version, tensors in (("v1", first), ("v2", second)):
        eager, _ = gpu_runner(tensors, arch, eager=True, mixed=False, version=version)
        want = staggered(eager, {r: (p, version) for r, p in prompts.items()}, 6, chunk=16)
        assert {r: both[f"{r}-{version}"] for r in prompts} == want
        del eager
        torch.cuda.empty_cache()
