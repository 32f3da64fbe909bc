"""The start-up profiling step: as many tokens as the largest step, never a position past the
served context (the rotary table has `max_model_len` rows; on the GPU a read past it is an
illegal memory access, here the reference kernels' indexing raises)."""

from __future__ import annotations

import pytest
import torch

from sitsd.model.llama import LlamaModel, build_weights
from sitsd.model.ops import reference_kernels
from sitsd.runtime.input_batch import build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.runtime.memory_plan import profile_requests
from tests.runtime.test_weight_slots import tiny

BLOCK = 16


@pytest.mark.parametrize(("num_tokens", "max_model_len"), [(96, 40), (64, 64), (30, 256)])
def test_profile_step_splits_its_tokens_into_prompts_within_the_context(num_tokens, max_model_len):
    arch, tensors = tiny(1)
    states, num_blocks = profile_requests(num_tokens, max_model_len, BLOCK, arch.vocab_size)
    assert sum(s.num_prompt_tokens for s in states) == num_tokens
    assert all(s.num_prompt_tokens <= max_model_len for s in states)
    blocks = [b for s in states for b in s.block_ids]
    assert sorted(blocks) == list(range(num_blocks))  # each prompt on blocks of its own
    assert all(len(s.block_ids) * BLOCK >= s.num_prompt_tokens for s in states)

    inputs = build_step_inputs(states, {s.req_id: s.num_prompt_tokens for s in states}, BLOCK)
    assert int(inputs.positions.max()) < max_model_len
    model = LlamaModel(arch, reference_kernels(), max_model_len, "cpu")
    weights = build_weights(arch, tensors, "cpu", torch.float32)
    kv = allocate_kv_caches(arch, num_blocks, BLOCK, torch.float32, "cpu")
    with torch.inference_mode():
        hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
    assert hidden.shape[0] == num_tokens
    assert torch.isfinite(hidden).all()
