"""per_token_quant_fp8 and fp8_matmul (Triton, and torch's scaled matmul) against their
references: codes and scales bit for bit (zero rows, subnormals, odd K), both GEMM backends,
argument checks; Llama-3-8B shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  make test installs it: no kernel test may skip for want of it

from sitsd.kernels.fp8_matmul import fp8_matmul, per_token_quant_fp8
from sitsd.kernels.quant_layout import FP8_MIN_SCALE
from sitsd.kernels.quant_reference import fp8_matmul_ref, per_token_quant_fp8_ref
from tests.kernels.helpers import assert_close
from tests.kernels.int4_inputs import LLAMA3_8B_SHAPES

SMALL_TILES = {"block_m": 16, "block_n": 16, "block_k": 32}


def _fp8_weight(n, k, device):
    weight = (torch.randn(n, k, device=device) * 8).to(torch.float8_e4m3fn)
    scale = (torch.rand(n, device=device) + 0.5) / (8 * k**0.5)
    return weight, scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("block_k", [32, 1024])
def test_codes_and_scales_equal_the_reference_bit_for_bit(dtype, block_k, device):
    # K = 100: a partial last chunk; row 1 all zeros (the scale floor); row 2 spans 2**-12..8
    # relative to its max, so its small entries land on e4m3's subnormal grid.
    x = torch.randn(4, 100, device=device) * 3
    x[1] = 0.0
    x[2] = 2.0 ** torch.linspace(-12, 3, 100, device=device)
    x = x.to(dtype)
    codes, scales = per_token_quant_fp8(x, block_k=block_k)
    ref_codes, ref_scales = per_token_quant_fp8_ref(x)
    assert torch.equal(scales, ref_scales)
    assert scales[1, 0] == FP8_MIN_SCALE
    assert torch.equal(codes.view(torch.uint8), ref_codes.view(torch.uint8))


def test_rounding_carries_into_the_next_binade_and_keeps_the_sign_of_zero(device):
    # 31.2 / 1 rounds up to 32 (a new exponent), -1e-4 to -0.0: the cases a cast that drops the
    # carry or the sign gets wrong.
    x = torch.tensor([[448.0, 31.2, -1e-4, -0.0, 0.7, 15.9]], device=device)
    codes, _ = per_token_quant_fp8(x)
    ref, _ = per_token_quant_fp8_ref(x)
    assert torch.equal(codes.view(torch.uint8), ref.view(torch.uint8))
    assert codes.float()[0, 1] == 32.0


@pytest.mark.parametrize("backend", ["scaled_mm", "triton"])
@pytest.mark.parametrize("num_rows", [1, 5, 17])
def test_matmul_matches_the_reference(backend, num_rows, device):
    if backend == "scaled_mm" and device.type == "cuda":
        pytest.skip("covered with bf16 and multiples of 16 by the GPU test below")
    weight, scale = _fp8_weight(37, 96, device)
    x = torch.randn(num_rows, 96, device=device).to(torch.bfloat16)
    out = fp8_matmul(x, weight, scale, backend=backend, **({} if backend == "scaled_mm" else
                                                           SMALL_TILES))  # fmt: skip
    assert_close(out, fp8_matmul_ref(x, weight, scale), torch.bfloat16)


def test_triton_backend_writes_into_out_and_handles_empty_batches(device):
    weight, scale = _fp8_weight(32, 64, device)
    x = torch.randn(3, 64, device=device)
    out = torch.full((3, 32), float("nan"), device=device)
    assert fp8_matmul(x, weight, scale, backend="triton", out=out, **SMALL_TILES) is out
    assert_close(out, fp8_matmul_ref(x, weight, scale), torch.float32)
    assert fp8_matmul(x[:0], weight, scale, backend="triton").shape == (0, 32)


def test_rejects_bad_arguments_with_messages(device):
    weight, scale = _fp8_weight(32, 64, device)
    x = torch.randn(2, 64, device=device)
    with pytest.raises(ValueError, match="backend must be one of"):
        fp8_matmul(x, weight, scale, backend="cutlass")
    with pytest.raises(ValueError, match=r"x must have shape \[M, K\] with K = 64"):
        fp8_matmul(torch.randn(2, 48, device=device), weight, scale)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \[N\]"):
        fp8_matmul(x, weight, scale[:1])
    with pytest.raises(ValueError, match="out is only taken by backend='triton'"):
        fp8_matmul(x, weight, scale, out=torch.empty(2, 32, device=device))
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        per_token_quant_fp8(x, block_k=8)


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
def test_gpu_llama_shapes_both_backends(name, device):
    n, k = LLAMA3_8B_SHAPES[name]
    weight, scale = _fp8_weight(n, k, device)
    for num_rows in (1, 8, 32, 128, 512):
        x = torch.randn(num_rows, k, device=device).to(torch.bfloat16)
        ref = fp8_matmul_ref(x, weight, scale)
        for backend in ("scaled_mm", "triton"):
            assert_close(fp8_matmul(x, weight, scale, backend=backend), ref, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_scaled_mm_refuses_shapes_it_cannot_take(device):
    weight, scale = _fp8_weight(40, 72, device)
    with pytest.raises(ValueError, match="use backend='triton'"):
        fp8_matmul(torch.randn(2, 72, device=device).bfloat16(), weight, scale)
