"""gemv (Triton) against gemv_ref: both multiply paths, fused SwiGLU, argument checks."""

from __future__ import annotations

import pytest
import torch
import triton  # make test installs it: no kernel test may skip for want of it

from sitsd.kernels.activation import silu_and_mul
from sitsd.kernels.gemv import MAX_ROWS, choose_gemv_config, gemv
from sitsd.kernels.reference import gemv_ref
from tests.kernels.helpers import assert_close

# Llama-3-8B's linear layers at decode: (N, K); gate_up's output feeds down through SwiGLU.
LLAMA3_8B_SHAPES = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}


def _inputs(num_rows, n, k, dtype, device, *, swiglu=False, x_scale=1.0):
    """x (fused [gate | up] rows with swiglu) and a weight scaled to give outputs of order 1."""
    x = (torch.randn(num_rows, 2 * k if swiglu else k, device=device) * x_scale).to(dtype)
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    return x, weight


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [1, 3, 33])
@pytest.mark.parametrize("swiglu", [False, True])
@pytest.mark.parametrize("use_dot", [False, True])
def test_matches_reference_with_ragged_tiles(dtype, num_rows, swiglu, use_dot, device):
    # Odd N and K: the last program's rows and the last K chunk are partial (masked loads).
    x, weight = _inputs(num_rows, 37, 100, dtype, device, swiglu=swiglu, x_scale=2.0)
    out = gemv(x, weight, swiglu=swiglu, block_n=8, block_k=32, use_dot=use_dot)
    # bf16 under the interpreter: its fp32 -> bf16 casts truncate (kernels/NOTES.md), and the
    # SwiGLU prologue casts twice per element: 33 rows meet the odd element at 1.0x the bound.
    scale = 2.0 if dtype == torch.bfloat16 and x.device.type == "cpu" else 1.0
    assert_close(out, gemv_ref(x, weight, swiglu=swiglu), dtype, scale=scale)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_dot", [False, True])
def test_matches_reference_with_even_tiles_and_default_config(dtype, use_dot, device):
    x, weight = _inputs(2, 48, 64, dtype, device)
    assert_close(gemv(x, weight, block_n=16, block_k=32, use_dot=use_dot),
                 gemv_ref(x, weight), dtype)  # fmt: skip
    assert_close(gemv(x, weight), gemv_ref(x, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("use_dot", [False, True])
def test_fused_swiglu_equals_silu_and_mul_then_gemv_bit_for_bit(dtype, use_dot, device):
    # The fused prologue rounds silu and the product to x's dtype like the activation kernel,
    # so with one launch config the two routes feed identical tiles to the same arithmetic.
    gate_up, weight = _inputs(3, 24, 80, dtype, device, swiglu=True, x_scale=3.0)
    config = {"block_n": 8, "block_k": 32, "use_dot": use_dot}
    fused = gemv(gate_up, weight, swiglu=True, **config)
    unfused = gemv(silu_and_mul(gate_up), weight, **config)
    assert torch.equal(fused, unfused)


def test_writes_into_out_and_takes_strided_rows(device):
    wide = torch.randn(3, 90, device=device)
    x = wide[:, :40]  # row stride 90
    weight = torch.randn(20, 40, device=device)
    out = torch.full((3, 20), float("nan"), device=device)
    assert gemv(x, weight, out=out) is out
    assert_close(out, gemv_ref(x, weight), torch.float32)


def test_empty_batch_and_empty_reduction(device):
    weight = torch.randn(5, 8, device=device)
    assert gemv(torch.randn(0, 8, device=device), weight).shape == (0, 5)
    out = torch.full((2, 5), float("nan"), device=device)
    gemv(torch.randn(2, 0, device=device), torch.randn(5, 0, device=device), out=out)
    assert torch.equal(out, torch.zeros(2, 5, device=device))


def test_wrapper_rejects_bad_arguments_with_clear_errors(device):
    x = torch.randn(2, 16, device=device)
    weight = torch.randn(8, 16, device=device)
    with pytest.raises(TypeError, match="x must have dtype"):
        gemv(x.double(), weight.double())
    with pytest.raises(TypeError, match="dtypes must match"):
        gemv(x.half(), weight)
    with pytest.raises(ValueError, match=r"x must have shape \[M, K\]"):
        gemv(x[:, :15], weight)
    with pytest.raises(ValueError, match=r"x must have shape \[M, 2 \* K\]"):
        gemv(x, weight, swiglu=True)
    with pytest.raises(ValueError, match="small-batch kernel"):
        gemv(torch.randn(MAX_ROWS + 1, 16, device=device), weight)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        gemv(x, torch.randn(16, 8, device=device).t())
    with pytest.raises(ValueError, match="x must be contiguous in its last dimension"):
        gemv(torch.randn(16, 2, device=device).t(), weight)
    with pytest.raises(ValueError, match="weight must be"):
        gemv(x, weight[0])
    with pytest.raises(ValueError, match="out must be"):
        gemv(x, weight, out=torch.empty(2, 9, device=device))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        gemv(x, weight, block_n=6)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 16"):
        gemv(x, weight, block_k=8)


@pytest.mark.parametrize("num_rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
def test_default_config_fills_an_h200_without_split_k(num_rows, name):
    n, k = LLAMA3_8B_SHAPES[name]
    swiglu = name == "down"
    config = choose_gemv_config(num_rows, n, k, torch.bfloat16, swiglu=swiglu, num_sms=132)
    assert triton.cdiv(n, config.block_n) >= 132  # every SM streams part of the weight
    if not config.use_dot:  # the 3-D accumulator stays within 64 fp32 registers per thread
        threads = 32 * config.num_warps
        assert num_rows * config.block_n * config.block_k <= 64 * threads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
def test_gpu_llama_shapes_match_reference(dtype, name, device):
    n, k = LLAMA3_8B_SHAPES[name]
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    for num_rows in (1, 2, 4, 8):
        for swiglu in (False, True) if name == "down" else (False,):
            x = torch.randn(num_rows, 2 * k if swiglu else k, device=device).to(dtype)
            ref = gemv_ref(x, weight, swiglu=swiglu)
            default = choose_gemv_config(num_rows, n, k, dtype, swiglu=swiglu)
            for use_dot in (default.use_dot, not default.use_dot):  # the default path, the other
                assert_close(gemv(x, weight, swiglu=swiglu, use_dot=use_dot), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("num_rows", [3, 16, 33, 64])
def test_gpu_odd_and_largest_batches_match_reference(num_rows, device):
    x, weight = _inputs(num_rows, 4096, 4096, torch.bfloat16, device)
    assert_close(gemv(x, weight), gemv_ref(x, weight), torch.bfloat16)


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph(device):
    x, weight = _inputs(4, 6144, 2048, torch.bfloat16, device, swiglu=True)
    out = torch.empty(4, 6144, device=device, dtype=torch.bfloat16)
    gemv(x, weight, swiglu=True, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        gemv(x, weight, swiglu=True, out=out)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_close(out, gemv_ref(x, weight, swiglu=True), torch.bfloat16)
