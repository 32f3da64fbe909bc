"""A split-K layer's partials handed to the add + RMSNorm after it (o and down): the Triton kernel
set routes them to the unfused pre-norm projection, whose norm sums them to the bits of the
summed layer, and decides PDL by the tokens, not the partials (CPU interpreter; on CUDA the model
takes this path whenever an INT4 layer splits past `INT4_MERGE_ROWS` rows)."""

from __future__ import annotations

import torch

from sitsd.kernels.int4_matmul import Int4MatmulConfig, int4_matmul
from sitsd.model.ops import add_norm_with_pdl, triton_kernels
from sitsd.model.qlinear import split_partials
from sitsd.quant.layout import Int4Weight
from tests.kernels.int4_inputs import random_int4

HIDDEN, K, TOKENS = 576, 512, 5


def _layer_both_ways(split_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One INT4 layer's output summed by its kernel, and its float32 partials unsummed."""
    w = random_int4(HIDDEN, K, 128, offsets=True, device="cpu")
    x = torch.randn(TOKENS, K).to(torch.bfloat16)
    config = Int4MatmulConfig("dot", block_m=16, block_n=64, block_k=128, split_k=split_k)
    summed = int4_matmul(x, *w.args, config=config)
    return summed, int4_matmul(x, *w.args, config=config, unsummed=True)


def test_partials_take_the_unfused_projection_and_give_the_summed_layers_bits():
    kernels = triton_kernels(use_gemv=False, pdl=False)
    summed, parts = _layer_both_ways(split_k=4)
    residual = torch.randn(TOKENS, HIDDEN).to(torch.bfloat16)
    assert split_partials(parts, residual)
    assert not split_partials(summed, residual)
    assert not split_partials(summed, None)  # the first layer: no residual, never partials
    norm = torch.randn(HIDDEN).to(torch.bfloat16)
    dense = torch.randn(64, HIDDEN).to(torch.bfloat16)  # a 16-bit next projection
    quantized = Int4Weight(*random_int4(64, HIDDEN, 64, offsets=False).args[:4])
    for weight in (dense, quantized):
        # (the summed output is normed in place: a copy each time)
        want, want_residual = kernels.norm_linear(summed.clone(), residual.clone(), norm, 1e-5,
                                                  weight)  # fmt: skip
        got, got_residual = kernels.norm_linear(parts, residual.clone(), norm, 1e-5, weight)
        assert torch.equal(got_residual, want_residual)
        assert torch.equal(got, want)
    # the model's last norm takes them too
    want, _ = kernels.fused_add_rms_norm(summed.clone(), residual.clone(), norm, 1e-5)
    got, _ = kernels.fused_add_rms_norm(parts, residual.clone(), norm, 1e-5)
    assert torch.equal(got, want)


def test_the_norm_decides_pdl_by_the_residuals_tokens_not_the_partials():
    seen = []

    def kernel(x, residual, weight, eps, *, pdl):
        seen.append(pdl)
        return x, residual

    hidden = 8
    # 40 tokens in 2 partials: PDL (it pays from 32 rows); 5 tokens in 40 partials: none
    add_norm_with_pdl(kernel, True, torch.zeros(2, 40, hidden), torch.zeros(40, hidden), None, 0.0)
    add_norm_with_pdl(kernel, True, torch.zeros(40, 5, hidden), torch.zeros(5, hidden), None, 0.0)
    add_norm_with_pdl(kernel, False, torch.zeros(40, hidden), torch.zeros(40, hidden), None, 0.0)
    assert seen == [True, False, False]
