"""`bench.decode_ablation`: a decode step through the kernel set without one family calls none
of that family's kernels and every kernel of the other, and still gives logits of its shape."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path

import pytest
import torch

from sitsd.model.ops import cpu_kernels, norm_linear
from sitsd.runtime.input_batch import CachedRequestState, build_step_inputs
from sitsd.runtime.kv_cache import allocate_kv_caches
from sitsd.types import SamplingParams
from tests.model.test_llama_parity import BLOCK, NUM_BLOCKS, build_pair

COUNTED = ("linear", "rms_norm", "fused_add_rms_norm", "rotary_and_cache", "decode_attention",
           "silu_and_mul")  # fmt: skip


@pytest.fixture
def without(monkeypatch):
    """`bench.decode_ablation.without`, with the repository's root on the import path."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1]))
    from bench.decode_ablation import without

    return without


def _count(calls: Counter[str], name: str, fn: Callable[..., object], *args, **kwargs):
    calls[name] += 1
    return fn(*args, **kwargs)


# Per layer: two norms (the first layer's adds no residual), the rotary + cache write,
# attention, the SwiGLU activation and four projections; then the final norm and the lm_head.
LEFT_OUT = {
    "linears": ("linear",),
    "others": ("rms_norm", "fused_add_rms_norm", "rotary_and_cache", "decode_attention",
               "silu_and_mul"),
    "norms": ("rms_norm", "fused_add_rms_norm"),
    "rotary": ("rotary_and_cache",),
    "attention": ("decode_attention",),
    "swiglu": ("silu_and_mul",),
}  # fmt: skip


def _swiglu_linear(silu_and_mul, linear, gate_up, weight, *, unsummed=False):
    return linear(silu_and_mul(gate_up), weight, unsummed=unsummed)


@pytest.mark.parametrize("family", list(LEFT_OUT))
def test_a_decode_step_without_a_family_runs_none_of_its_kernels(family, without):
    _, arch, weights, model = build_pair("llama-gqa2", cpu_kernels)
    kv = allocate_kv_caches(arch, NUM_BLOCKS, BLOCK, torch.float32, "cpu")
    state = CachedRequestState("a", [5, 9, 2, 7, 11], 5, SamplingParams(), 0, [3, 1, 4], 0)
    with torch.inference_mode():  # the prompt, through the served kernels
        inputs = build_step_inputs([state], {"a": 5}, BLOCK, "cpu")
        model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
        state.num_computed_tokens = 5
        state.token_ids.append(13)
        calls: Counter[str] = Counter()
        served = model.kernels
        counted = {n: partial(_count, calls, n, getattr(served, n)) for n in COUNTED}
        # the two composite projections through the counted kernels, so that every kernel
        # a step runs is counted once, by its own name
        norm, add_norm, linear = (counted[n] for n in ("rms_norm", "fused_add_rms_norm", "linear"))
        counted["norm_linear"] = partial(norm_linear, norm, add_norm, linear)
        counted["swiglu_linear"] = partial(_swiglu_linear, counted["silu_and_mul"], linear)
        model.kernels = without(dataclasses.replace(served, **counted), family, weights.lm_head)
        inputs = build_step_inputs([state], {"a": 1}, BLOCK, "cpu")
        hidden = model.forward(weights, inputs.input_ids, inputs.positions, inputs.meta, kv)
        logits = model.compute_logits(weights, hidden)
    assert logits.shape == (1, arch.vocab_size)
    layers = arch.num_layers
    # Of the linears, the lm_head runs in every case.
    full = Counter(linear=4 * layers + 1, rms_norm=1, fused_add_rms_norm=2 * layers,
                   rotary_and_cache=layers, decode_attention=layers,
                   silu_and_mul=layers)  # fmt: skip
    expected = Counter({n: c for n, c in full.items() if n not in LEFT_OUT[family]})
    if family == "linears":  # a dense weight's SwiGLU goes with down (down's own kernel
        # on a GPU at one row)
        expected["linear"] = 1
        del expected["silu_and_mul"]
    assert calls == expected


def test_an_unknown_family_is_refused(without):
    with pytest.raises(ValueError, match="family must be one of"):
        without(cpu_kernels(), "lm_head", torch.empty(0))
