"""Weight slots: in-place staging copies, and the runner's one sub-batch per weights version."""

from __future__ import annotations

import random

import pytest
import torch

from sitsd.builder import build_runner
from sitsd.config import CacheConfig, ModelConfig, SchedulerConfig, SitsdConfig, WeightsConfig
from sitsd.model.arch import arch_from_hf_config
from sitsd.model.llama import build_weights
from sitsd.outputs import CachedRequestData, NewRequestData, SchedulerOutput
from sitsd.runtime.weight_slots import WeightSlots, row_chunks
from sitsd.types import SamplingParams
from tests.weights.tiny_models import state_dict_of, tiny_llama_model

BLOCK = 16


def tiny(seed: int, **kwargs):
    model = tiny_llama_model(seed=seed, **kwargs)
    return arch_from_hf_config(model.config.to_dict()), state_dict_of(model)


@pytest.mark.parametrize("tied", [False, True])
def test_a_staged_slot_equals_built_weights_and_keeps_its_tensor_addresses(tied):
    arch, first = tiny(1, tie_word_embeddings=tied)
    _, second = tiny(2, tie_word_embeddings=tied)
    slots = WeightSlots(arch, build_weights(arch, first, "cpu", torch.float32), "v1")
    standby = slots.standby
    addresses = [t.data_ptr() for _, t in slots.weights(standby).named_tensors()]
    slots.release(standby)
    progress = []
    # A tiny chunk: every tensor is copied in several pieces.
    nbytes = slots.copy_into(
        standby, second, chunk_bytes=999, on_progress=lambda d, t: progress.append((d, t))
    )
    slots.fill(standby, "v2")
    want = build_weights(arch, second, "cpu", torch.float32)
    got = slots.weights(standby)
    for (name, a), (_, b) in zip(got.named_tensors(), want.named_tensors(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0, msg=name)
    assert (got.lm_head is got.embed_tokens) == tied
    assert [t.data_ptr() for _, t in got.named_tensors()] == addresses
    assert progress[-1] == (nbytes, nbytes) == (slots.slot_nbytes, slots.slot_nbytes)
    assert len(progress) > len(list(got.named_tensors()))


def test_row_chunks_cover_every_row_once():
    t = torch.empty(random.randrange(1, 300), random.randrange(1, 50))
    chunk = random.randrange(1, 4000)
    rows = [r for s in row_chunks(t, chunk) for r in range(s.start, s.stop)]
    assert rows == list(range(t.shape[0]))


def test_only_a_released_standby_slot_changes_and_the_active_one_cannot_be_released():
    arch, first = tiny(1)
    slots = WeightSlots(arch, build_weights(arch, first, "cpu", torch.float32), "v1")
    with pytest.raises(ValueError, match="active"):
        slots.release(slots.active)
    slots.release(1)
    slots.fill(1, "v2")
    slots.activate("v2")
    assert (slots.active, slots.active_version, slots.standby_version) == (1, "v2", "v1")
    with pytest.raises(KeyError, match="v3"):
        slots.activate("v3")


def runner_with_two_versions(tmp_seed_a=1, tmp_seed_b=2):
    arch, first = tiny(tmp_seed_a)
    _, second = tiny(tmp_seed_b)
    cfg = SitsdConfig(
        model=ModelConfig(max_model_len=256),
        cache=CacheConfig(num_blocks=64, block_size=BLOCK),
        scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        weights=WeightsConfig(weight_slots="2"),
    )
    runner, info = build_runner(cfg, arch, first, "v1")
    assert info.num_weight_slots == 2
    standby = runner.slots.standby
    runner.slots.release(standby)
    runner.slots.copy_into(standby, second)
    runner.slots.fill(standby, "v2")
    return runner, arch


def greedy(runner, prompts: dict[str, tuple[list[int], str]], num_new: int) -> dict[str, list]:
    """Run requests (prompt, version) to `num_new` greedy tokens each, in one batch."""
    params = SamplingParams(max_tokens=num_new, temperature=0.0)
    ids = iter(range(64))
    blocks = {r: [next(ids) for _ in range(-(-(len(p) + num_new) // BLOCK))]
              for r, (p, _) in prompts.items()}  # fmt: skip
    new = [NewRequestData(r, list(p), len(p), params, 0, blocks[r], 0, v)
           for r, (p, v) in prompts.items()]  # fmt: skip
    sched = {r: len(p) for r, (p, _) in prompts.items()}
    total = sum(sched.values())
    out = runner.execute(
        SchedulerOutput(new_reqs=new, num_scheduled_tokens=sched, total_num_scheduled_tokens=total)
    )
    tokens = {r: list(t) for r, t in zip(out.req_ids, out.sampled_token_ids)}
    for step in range(num_new - 1):
        cached = [CachedRequestData(r, [], len(p) + step) for r, (p, _) in prompts.items()]
        out = runner.execute(SchedulerOutput(cached_reqs=cached,
                                             num_scheduled_tokens=dict.fromkeys(prompts, 1),
                                             total_num_scheduled_tokens=len(prompts)))  # fmt: skip
        for r, t in zip(out.req_ids, out.sampled_token_ids):
            tokens[r] += t
    runner.execute(SchedulerOutput(finished_req_ids=set(prompts)))
    return tokens


def test_requests_of_two_versions_in_one_step_each_get_their_own_slots_output(rng):
    runner, arch = runner_with_two_versions()
    prompts = [[rng.randrange(arch.vocab_size) for _ in range(rng.randrange(5, 40))]
               for _ in range(3)]  # fmt: skip
    alone = {
        (i, v): greedy(runner, {"r": (p, v)}, 6)["r"] for i, p in enumerate(prompts)
        for v in ("v1", "v2")
    }  # fmt: skip
    assert any(alone[i, "v1"] != alone[i, "v2"] for i in range(3)), "versions must differ"
    mixed = greedy(runner, {f"{i}{v}": (p, v) for i, p in enumerate(prompts)
                            for v in ("v1", "v2")}, 6)  # fmt: skip
    assert mixed == {f"{i}{v}": alone[i, v] for i in range(3) for v in ("v1", "v2")}
