"""SmolLM2-135M from the embedded GGUF: our logits equal transformers' on the same file."""

from __future__ import annotations

import pytest
import torch

from sitsd.model.llama import LlamaModel, build_weights
from sitsd.model.ops import reference_kernels
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.types import SamplingParams

pytestmark = pytest.mark.slow
BLOCK = 16


def test_chat_prompt_logits_and_greedy_continuation_match_transformers(smollm2, smollm2_hf_model):
    arch, tok = smollm2.arch, smollm2.tokenizer
    text = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}])
    ids = tok.encode(text, add_special_tokens=False)
    weights = build_weights(arch, smollm2.tensors, "cpu", torch.float32)
    model = LlamaModel(arch, reference_kernels(), 512, "cpu")
    kv = allocate_kv_caches(arch, 8, BLOCK, torch.float32, "cpu")
    state = CachedRequestState("a", list(ids), len(ids), SamplingParams(), 0, [6, 1, 4, 0, 7], 0)
    with torch.inference_mode():
        # Prefill in two chunks, then greedy decode 24 tokens one step at a time.
        chunks = []
        for n in (20, len(ids) - 20):
            inp = build_step_inputs([state], {"a": n}, BLOCK, "cpu")
            hidden = model.forward(weights, inp.input_ids, inp.positions, inp.meta, kv)
            chunks.append(model.compute_logits(weights, hidden))
            state.num_computed_tokens += n
        prompt_logits = torch.cat(chunks)
        for _ in range(24):
            next_id = int(chunks[-1][-1].argmax())
            state.token_ids.append(next_id)
            inp = build_step_inputs([state], {"a": 1}, BLOCK, "cpu")
            hidden = model.forward(weights, inp.input_ids, inp.positions, inp.meta, kv)
            chunks.append(model.compute_logits(weights, hidden))
            state.num_computed_tokens += 1
        with torch.no_grad():
            want = smollm2_hf_model(torch.tensor([state.token_ids])).logits[0]
    got = torch.cat(chunks)
    scale = want.abs().max().item()
    # float32 rounding: logits of magnitude ~40 through 30 layers, fused projections.
    torch.testing.assert_close(prompt_logits, want[: len(ids)], atol=2e-4, rtol=0)
    torch.testing.assert_close(got, want, atol=2e-4, rtol=0)
    assert scale > 10
    generated = tok.decode(state.token_ids[len(ids) :])
    assert generated.startswith("The capital of France is Paris.")
