"""The model's tensor-name table against a real Hugging Face checkpoint: `expected_shapes` names
every tensor transformers saves, `build_weights` fuses them, and `weight_copy_plan` refills a
second set of tensors (`empty_weights_like`) in place to the same bits, each element once."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from sitsd.model.arch import arch_from_hf_config
from sitsd.model.llama import (
    build_weights,
    empty_weights_like,
    expected_shapes,
    weight_copy_plan,
)

VARIANTS = [(False, False), (True, False), (False, True), (True, True)]  # (bias, tied)


def checkpoint(bias: bool, tied: bool):
    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=48, num_hidden_layers=2, vocab_size=67,
        num_attention_heads=4, num_key_value_heads=random.choice([1, 2, 4]),
        attention_bias=bias, tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(random.randrange(2**31))
    hf = LlamaForCausalLM(cfg)
    with torch.no_grad():  # transformers zeroes biases and sets norms to one: make them differ
        for p in hf.parameters():
            p.normal_()
    return arch_from_hf_config(cfg.to_dict()), dict(hf.state_dict())


@pytest.mark.parametrize(("bias", "tied"), VARIANTS)
def test_expected_shapes_are_the_names_and_shapes_transformers_saves(bias, tied):
    arch, tensors = checkpoint(bias, tied)
    saved = {name: tuple(t.shape) for name, t in tensors.items()}
    if tied:  # transformers saves the tied head under its own name too; it is not read
        del saved["lm_head.weight"]
    # sitsd's attention_bias is the q/k/v biases (Qwen2-style); transformers' Llama also gives
    # o_proj one, which the checkpoint loader rejects as unexpected (weights/formats.py)
    saved = {name: shape for name, shape in saved.items() if not name.endswith("o_proj.bias")}
    assert expected_shapes(arch) == saved


@pytest.mark.parametrize(("bias", "tied"), VARIANTS)
def test_the_copy_plan_refills_empty_weights_to_what_build_weights_builds(bias, tied):
    arch, tensors = checkpoint(bias, tied)
    built = build_weights(arch, tensors, "cpu", torch.float32)
    slot = empty_weights_like(built)
    for _, t in slot.named_tensors():
        t.fill_(float("nan"))  # an element the plan misses stays NaN
    plan = weight_copy_plan(arch, slot)
    assert [name for _, name in plan] == list(expected_shapes(arch))
    for dst, name in plan:
        assert dst.isnan().all(), f"{name} overlaps another destination"
        dst.copy_(tensors[name])
    for (name, got), (_, want) in zip(slot.named_tensors(), built.named_tensors(), strict=True):
        assert torch.equal(got, want), name
    assert (slot.lm_head is slot.embed_tokens) == tied
    assert all((layer.qkv_bias is not None) == bias for layer in slot.layers)


def test_empty_weights_like_has_the_same_shapes_in_new_storage():
    arch, tensors = checkpoint(bias=True, tied=True)
    built = build_weights(arch, tensors, "cpu", torch.bfloat16)
    for zero in (False, True):
        slot = empty_weights_like(built, zero=zero)
        pairs = list(zip(slot.named_tensors(), built.named_tensors(), strict=True))
        for (name, got), (want_name, want) in pairs:
            assert (name, got.shape, got.dtype) == (want_name, want.shape, want.dtype)
            assert got.data_ptr() != want.data_ptr(), name
            if zero:
                assert not got.any(), name
        assert slot.lm_head is slot.embed_tokens
