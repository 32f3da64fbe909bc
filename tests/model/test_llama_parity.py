"""The model's logits match Hugging Face transformers on the same weights (float32)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from sitsd.model.arch import arch_from_hf_config
from sitsd.model.llama import LlamaModel, WeightsError, build_weights
from sitsd.model.ops import cpu_kernels, reference_kernels
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.types import SamplingParams

BLOCK = 4
NUM_BLOCKS = 96
# float32 rounding: the fused QKV/gate-up matmuls sum in another order than transformers'.
ATOL = 2e-5

LLAMA3_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}

CONFIGS = {
    "llama-gqa2": LlamaConfig(num_attention_heads=4, num_key_value_heads=2),
    "llama-mha-tied": LlamaConfig(
        num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True
    ),
    "llama-gqa4-hd32": LlamaConfig(num_attention_heads=8, num_key_value_heads=2, hidden_size=256),
    "llama3-rope-scaling": LlamaConfig(
        num_attention_heads=4,
        num_key_value_heads=1,
        rope_scaling=LLAMA3_SCALING,
        rope_theta=500000.0,
    ),
    "llama-attn-bias": LlamaConfig(
        num_attention_heads=4, num_key_value_heads=2, attention_bias=True
    ),
    "mistral": MistralConfig(num_attention_heads=4, num_key_value_heads=2, sliding_window=None),
}


def build_pair(name, kernels=reference_kernels):
    cfg = CONFIGS[name]
    for key, value in dict(
        hidden_size=cfg.hidden_size if name == "llama-gqa4-hd32" else 64,
        intermediate_size=160,
        num_hidden_layers=2,
        vocab_size=257,
        max_position_embeddings=256,
    ).items():
        setattr(cfg, key, value)
    torch.manual_seed(random.randrange(2**31))
    hf_cls = MistralForCausalLM if name == "mistral" else LlamaForCausalLM
    hf = hf_cls(cfg).eval()
    if getattr(cfg, "attention_bias", False):  # transformers zeroes biases: make them count
        with torch.no_grad():
            for layer in hf.model.layers:
                attn = layer.self_attn
                for proj in (attn.q_proj, attn.k_proj, attn.v_proj):
                    proj.bias.normal_()
    arch = arch_from_hf_config(cfg.to_dict())
    weights = build_weights(arch, hf.state_dict(), "cpu", torch.float32)
    model = LlamaModel(arch, kernels(), 256, "cpu")
    return hf, arch, weights, model


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


def shuffled_blocks(n):
    ids = list(range(NUM_BLOCKS))
    random.shuffle(ids)
    return ids[:n]


def run_steps(model, weights, kv, states, schedule):
    """Run steps; `schedule` is a list of {req_id: num_tokens}; returns logits per req."""
    by_id = {s.req_id: s for s in states}
    logits = {s.req_id: [] for s in states}
    with torch.inference_mode():
        for step in schedule:
            batch = [by_id[r] for r in step]
            inp = build_step_inputs(batch, step, BLOCK, "cpu")
            hidden = model.forward(weights, inp.input_ids, inp.positions, inp.meta, kv)
            all_logits = model.compute_logits(weights, hidden)
            for state in batch:
                i = inp.req_ids.index(state.req_id)
                start = inp.meta.query_start_loc[i].item()
                logits[state.req_id].append(all_logits[start : start + step[state.req_id]])
                state.num_computed_tokens += step[state.req_id]
    return {r: torch.cat(v) for r, v in logits.items()}


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_prefill_logits_match_transformers(name):
    hf, arch, weights, model = build_pair(name)
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    ids = [random.randrange(arch.vocab_size) for _ in range(45)]
    state = CachedRequestState("a", ids, len(ids), SamplingParams(), 0, shuffled_blocks(12), 0)
    got = run_steps(model, weights, kv, [state], [{"a": 45}])["a"]
    torch.testing.assert_close(got, hf_logits(hf, ids), atol=ATOL, rtol=0)


@pytest.mark.parametrize("kernels", [reference_kernels, cpu_kernels])
@pytest.mark.parametrize("name", ["llama-gqa2", "llama3-rope-scaling"])
def test_chunked_prefill_then_decode_match_transformers(name, kernels):
    hf, arch, weights, model = build_pair(name, kernels)
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    ids = [random.randrange(arch.vocab_size) for _ in range(40)]
    state = CachedRequestState("a", ids, len(ids), SamplingParams(), 0, shuffled_blocks(11), 0)
    # 13 + 27 prompt tokens in two chunks, then three single-token decode steps.
    schedule = [{"a": 13}, {"a": 27}]
    logits = run_steps(model, weights, kv, [state], schedule)["a"]
    for _ in range(3):
        state.token_ids.append(random.randrange(arch.vocab_size))
        logits = torch.cat([logits, run_steps(model, weights, kv, [state], [{"a": 1}])["a"]])
    torch.testing.assert_close(logits, hf_logits(hf, state.token_ids), atol=ATOL, rtol=0)


def test_ragged_batch_of_decodes_and_chunks_matches_each_sequence_alone():
    hf, arch, weights, model = build_pair("llama-gqa2")
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    prompts = {
        r: [random.randrange(arch.vocab_size) for _ in range(n)]
        for r, n in (("a", 9), ("b", 30), ("c", 1), ("d", 17))
    }
    blocks = shuffled_blocks(40)
    states = [
        CachedRequestState(r, p, len(p), SamplingParams(), 0, blocks[i * 10 : (i + 1) * 10], 0)
        for i, (r, p) in enumerate(prompts.items())
    ]
    # Step 1: a (9 tokens) and c (1 token) prefill whole while b and d prefill a first chunk;
    # step 2: b and d finish their prompts over the KV cached in step 1.
    logits = run_steps(
        model, weights, kv, states, [{"a": 9, "b": 11, "c": 1, "d": 5}, {"b": 19, "d": 12}]
    )
    for state in states:
        torch.testing.assert_close(
            logits[state.req_id], hf_logits(hf, state.token_ids), atol=ATOL, rtol=0
        )


def test_missing_or_misshapen_tensors_are_rejected():
    hf, arch, _, _ = build_pair("llama-gqa2")
    sd = dict(hf.state_dict())
    del sd["model.layers.1.mlp.up_proj.weight"]
    with pytest.raises(WeightsError, match="missing"):
        build_weights(arch, sd, "cpu", torch.float32)
    sd = dict(hf.state_dict())
    sd["model.norm.weight"] = torch.ones(3)
    with pytest.raises(WeightsError, match=r"model.norm.weight has shape \(3,\)"):
        build_weights(arch, sd, "cpu", torch.float32)


def test_non_finite_weights_are_rejected():
    hf, arch, _, _ = build_pair("llama-gqa2")
    sd = dict(hf.state_dict())
    bad = sd["model.layers.0.self_attn.k_proj.weight"].clone()
    bad[3, 5] = float("nan")
    sd["model.layers.0.self_attn.k_proj.weight"] = bad
    with pytest.raises(WeightsError, match=r"k_proj\.weight holds NaN or Inf"):
        build_weights(arch, sd, "cpu", torch.float32)
