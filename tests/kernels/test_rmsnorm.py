"""rms_norm / fused_add_rms_norm (Triton) against their references: values, dtypes, in-place."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.int4_matmul import Int4MatmulConfig, int4_matmul
from sitsd.kernels.reference import fused_add_rms_norm_ref, rms_norm_ref
from sitsd.kernels.rmsnorm import fused_add_rms_norm, rms_norm
from tests.kernels.helpers import assert_close
from tests.kernels.int4_inputs import random_int4

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _rand(*shape, dtype, device, scale=1.0):
    return (torch.randn(*shape, device=device) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("hidden", [64, 576, 1000])
def test_rms_norm_matches_reference(dtype, num_tokens, hidden, device):
    x = _rand(num_tokens, hidden, dtype=dtype, device=device, scale=3.0)
    weight = _rand(hidden, dtype=dtype, device=device)
    out = torch.full_like(x, float("nan"))
    assert rms_norm(x, weight, 1e-5, out=out) is out
    assert_close(out, rms_norm_ref(x, weight, 1e-5), dtype)


def test_rms_norm_promotes_like_the_reference_for_an_fp32_weight(device):
    x = _rand(5, 96, dtype=torch.float16, device=device)
    weight = _rand(96, dtype=torch.float32, device=device)
    out = rms_norm(x, weight, 1e-6)
    assert out.dtype == torch.float32
    # The normalized x is rounded to float16 before the float32 weight multiplies it (as the
    # reference does): an element next to a float16 rounding boundary may land on the other
    # side (rsqrt differs in its last bits), one float16 ulp, so float16's bounds.
    assert_close(out, rms_norm_ref(x, weight, 1e-6), torch.float16)


def test_rms_norm_takes_3d_input_and_strided_rows(device):
    x = _rand(2, 3, 128, dtype=torch.float16, device=device)
    weight = _rand(128, dtype=torch.float16, device=device)
    assert_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), torch.float16)
    wide = _rand(6, 256, dtype=torch.float16, device=device)
    rows = wide[:, :128]  # row stride 256
    assert_close(rms_norm(rows, weight, 1e-5), rms_norm_ref(rows, weight, 1e-5), torch.float16)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_tokens", "hidden"), [(1, 64), (7, 576), (33, 1000)])
def test_fused_add_rms_norm_matches_reference_in_place(dtype, num_tokens, hidden, device):
    x = _rand(num_tokens, hidden, dtype=dtype, device=device)
    residual = _rand(num_tokens, hidden, dtype=dtype, device=device, scale=4.0)
    weight = _rand(hidden, dtype=dtype, device=device)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out is x  # written in place, as documented
    assert new_residual is residual
    assert_close(new_residual, ref_residual, dtype)
    assert_close(out, ref_out, dtype)


def test_fused_add_rms_norm_with_a_promoting_weight_returns_a_new_output(device):
    x = _rand(4, 64, dtype=torch.bfloat16, device=device)
    residual = _rand(4, 64, dtype=torch.bfloat16, device=device)
    weight = _rand(64, dtype=torch.float32, device=device)
    ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
    out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
    assert out.dtype == torch.float32
    assert new_residual is residual
    assert_close(new_residual, ref_residual, torch.bfloat16)
    # fp32 output, but the normed row is rounded to bf16 before the weight: bf16 tolerance.
    assert_close(out, ref_out, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("split_k", [2, 4])
def test_fused_add_rms_norm_sums_split_partials_to_the_bits_of_the_summed_layer(
    dtype, split_k, device
):
    # An INT4 layer split along K, its float32 partials left unsummed: the norm sums them in
    # split order and rounds the sum to the residual's dtype, what the layer's own sum kernel
    # writes, then adds and norms: the same bits as the summed layer followed by the norm.
    w = random_int4(576, 512, 128, offsets=True, device=device)
    x = torch.randn(5, 512, device=device).to(dtype)
    config = Int4MatmulConfig("dot", block_m=16, block_n=64, block_k=128, split_k=split_k)
    parts = int4_matmul(x, *w.args, config=config, unsummed=True)
    assert parts.shape == (split_k, 5, 576)
    assert parts.dtype == torch.float32
    residual = _rand(5, 576, dtype=dtype, device=device, scale=4.0)
    weight = _rand(576, dtype=dtype, device=device)
    summed = int4_matmul(x, *w.args, config=config)
    expected, expected_residual = fused_add_rms_norm(summed, residual.clone(), weight, 1e-5)
    out, new_residual = fused_add_rms_norm(parts, residual, weight, 1e-5)
    assert new_residual is residual
    assert out.dtype == dtype
    assert out.shape == (5, 576)
    assert torch.equal(new_residual, expected_residual)
    assert torch.equal(out, expected)
    with pytest.raises(TypeError, match="x must have dtype"):
        fused_add_rms_norm(parts.to(dtype), residual, weight, 1e-5)
    with pytest.raises(ValueError, match=r"x must have shape \[parts, \*residual's shape\]"):
        fused_add_rms_norm(parts[:, :4].contiguous(), residual, weight, 1e-5)
    with pytest.raises(ValueError, match="out and unsummed exclude each other"):
        int4_matmul(x, *w.args, config=config, unsummed=True, out=summed)


def test_wrappers_reject_bad_arguments_with_clear_errors(device):
    x = _rand(3, 64, dtype=torch.float16, device=device)
    weight = _rand(64, dtype=torch.float16, device=device)
    with pytest.raises(TypeError, match="x must have dtype"):
        rms_norm(x.to(torch.int32), weight, 1e-5)
    with pytest.raises(ValueError, match=r"weight must have shape \[hidden\]"):
        rms_norm(x, weight[:32], 1e-5)
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        rms_norm(x.t(), weight[:3], 1e-5)
    with pytest.raises(ValueError, match="out must be"):
        rms_norm(x, weight, 1e-5, out=torch.empty(3, 64, device=device))
    with pytest.raises(TypeError, match="residual dtype"):
        fused_add_rms_norm(x, x.float(), weight, 1e-5)
    with pytest.raises(ValueError, match="residual must have shape"):
        fused_add_rms_norm(x, x[:2], weight, 1e-5)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hidden", [576, 4096, 5120, 8192])
def test_gpu_grid_matches_reference(dtype, hidden, device):
    for num_tokens in (1, 7, 33, 4097):
        x = _rand(num_tokens, hidden, dtype=dtype, device=device, scale=2.0)
        residual = _rand(num_tokens, hidden, dtype=dtype, device=device)
        weight = _rand(hidden, dtype=dtype, device=device)
        assert_close(rms_norm(x, weight, 1e-5), rms_norm_ref(x, weight, 1e-5), dtype)
        ref_out, ref_residual = fused_add_rms_norm_ref(x, residual, weight, 1e-5)
        out, new_residual = fused_add_rms_norm(x, residual, weight, 1e-5)
        assert_close(new_residual, ref_residual, dtype)
        assert_close(out, ref_out, dtype)
