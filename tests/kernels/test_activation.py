"""silu_and_mul (Triton) against silu_and_mul_ref."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.activation import silu_and_mul
from sitsd.kernels.reference import silu_and_mul_ref
from tests.kernels.helpers import assert_close


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("d", [1, 7, 1536, 2500])  # 2500 spans several column blocks
def test_matches_reference(dtype, num_tokens, d, device):
    x = (torch.randn(num_tokens, 2 * d, device=device) * 4).to(dtype)
    out = torch.full((num_tokens, d), float("nan"), device=device).to(dtype)
    assert silu_and_mul(x, out=out) is out
    assert_close(out, silu_and_mul_ref(x), dtype)


def test_takes_3d_input_and_strided_rows(device):
    x = torch.randn(2, 3, 64, device=device).half()
    assert_close(silu_and_mul(x), silu_and_mul_ref(x), torch.float16)
    wide = torch.randn(5, 100, device=device)
    rows = wide[:, :64]  # row stride 100
    assert_close(silu_and_mul(rows), silu_and_mul_ref(rows), torch.float32)


def test_wrapper_rejects_bad_arguments_with_clear_errors(device):
    x = torch.randn(3, 8, device=device)
    with pytest.raises(ValueError, match="even last dimension"):
        silu_and_mul(x[:, :7])
    with pytest.raises(TypeError, match="x must have dtype"):
        silu_and_mul(x.double())
    with pytest.raises(ValueError, match="contiguous in its last dimension"):
        silu_and_mul(torch.randn(4, 8, device=device).t())
    with pytest.raises(ValueError, match="out must be"):
        silu_and_mul(x, out=torch.empty(3, 8, device=device))


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("d", [1536, 11008, 14336])
def test_gpu_grid_matches_reference(dtype, d, device):
    for num_tokens in (1, 7, 33, 4099):
        x = (torch.randn(num_tokens, 2 * d, device=device) * 4).to(dtype)
        assert_close(silu_and_mul(x), silu_and_mul_ref(x), dtype)
