"""norm_gemv (Triton) against norm_gemv_ref: the output, the new residual, no input written."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.norm_gemv import norm_gemv
from sitsd.kernels.reference import norm_gemv_ref
from tests.kernels.helpers import assert_close


def _inputs(n, k, dtype, device, *, with_residual=True):
    hidden = (torch.randn(1, k, device=device) * 3).to(dtype)
    residual = (torch.randn(1, k, device=device) * 3).to(dtype) if with_residual else None
    norm_weight = (1 + 0.1 * torch.randn(k, device=device)).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    return hidden, residual, norm_weight, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize(("n", "k", "block_n", "block_k"), [(37, 100, 4, 32), (48, 64, 8, 64)])
def test_matches_reference(dtype, with_residual, n, k, block_n, block_k, device):
    hidden, residual, norm_weight, weight = _inputs(n, k, dtype, device,
                                                    with_residual=with_residual)  # fmt: skip
    before = [t.clone() for t in (hidden, residual) if t is not None]
    want, want_res = norm_gemv_ref(hidden, residual, norm_weight, 1e-5, weight)
    got, got_res = norm_gemv(hidden, residual, norm_weight, 1e-5, weight,
                             block_n=block_n, block_k=block_k)  # fmt: skip
    assert_close(got, want, dtype, scale=2.0)
    # One rounded add on both sides: exact, except that the interpreter truncates fp32 -> bf16
    # casts where the GPU rounds them (kernels/NOTES.md); the GPU test checks bf16 exactly.
    if dtype == torch.float32:
        assert torch.equal(got_res, want_res)
    else:
        assert_close(got_res, want_res, dtype)
    for t, b in zip((t for t in (hidden, residual) if t is not None), before, strict=True):
        assert torch.equal(t, b)  # inputs untouched
    if residual is None:
        assert got_res is hidden


def test_wrapper_rejects_bad_arguments_with_clear_errors(device):
    hidden, residual, norm_weight, weight = _inputs(8, 32, torch.float32, device)
    with pytest.raises(ValueError, match=r"hidden must have shape \[1, K\]"):
        norm_gemv(torch.cat([hidden, hidden]), residual, norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match="residual must have shape"):
        norm_gemv(hidden, residual[:, :16], norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        norm_gemv(hidden, residual, norm_weight[:16], 1e-5, weight)
    with pytest.raises(TypeError, match="dtypes must match"):
        norm_gemv(hidden, residual.half(), norm_weight, 1e-5, weight)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        norm_gemv(hidden, residual, norm_weight, 1e-5, weight.T.contiguous().T)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        norm_gemv(hidden, residual, norm_weight, 1e-5, weight, block_n=3)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (28672, 4096), (4096, 4096)])
def test_gpu_llama_shapes_match_reference(dtype, n, k, device):
    for with_residual in (True, False):
        hidden, residual, norm_weight, weight = _inputs(n, k, dtype, device,
                                                        with_residual=with_residual)  # fmt: skip
        want, want_res = norm_gemv_ref(hidden, residual, norm_weight, 1e-5, weight)
        got, got_res = norm_gemv(hidden, residual, norm_weight, 1e-5, weight)
        assert_close(got, want, dtype, scale=2.0)
        assert torch.equal(got_res, want_res)
