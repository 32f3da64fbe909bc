"""skinny_gemm (Triton) against gemv_ref: split and unsplit K, ragged N, odd row counts, the
default tiling of Llama-3-8B's layers, argument checks, CUDA-graph replay."""

from __future__ import annotations

import pytest
import torch
import triton  # make test installs it: no kernel test may skip for want of it

from sitsd.kernels.reference import gemv_ref
from sitsd.kernels.skinny_gemm import MAX_ROWS, choose_skinny_config, skinny_gemm
from tests.kernels.helpers import assert_close
from tests.kernels.test_gemv import LLAMA3_8B_SHAPES, _inputs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("num_rows", [2, 5, 17])
@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_matches_reference_with_a_ragged_last_tile(dtype, num_rows, split_k, device):
    # N = 40 with 16-row tiles: the last program's weight rows are masked.
    x, weight = _inputs(num_rows, 40, 128, dtype, device, x_scale=2.0)
    out = skinny_gemm(x, weight, block_n=16, block_k=32, split_k=split_k)
    assert_close(out, gemv_ref(x, weight), dtype)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_split_k_gives_the_same_sum_each_time_and_default_config_works(dtype, device):
    x, weight = _inputs(3, 64, 256, dtype, device)
    first = skinny_gemm(x, weight, block_n=32, block_k=32, split_k=4)
    assert torch.equal(skinny_gemm(x, weight, block_n=32, block_k=32, split_k=4), first)
    assert_close(skinny_gemm(x, weight), gemv_ref(x, weight), dtype)


def test_writes_into_a_given_out_and_handles_empty_inputs(device):
    x, weight = _inputs(4, 32, 64, torch.float32, device)
    out = torch.full((4, 32), float("nan"), device=device)
    assert skinny_gemm(x, weight, block_n=16, block_k=32, out=out) is out
    assert_close(out, gemv_ref(x, weight), torch.float32)
    assert skinny_gemm(x[:0], weight).shape == (0, 32)


def test_rejects_bad_arguments_with_messages(device):
    x, weight = _inputs(2, 32, 64, torch.float32, device)
    with pytest.raises(ValueError, match="skinny_gemm is a small-batch kernel: x has 65 rows"):
        skinny_gemm(torch.zeros(MAX_ROWS + 1, 64, device=device), weight)
    with pytest.raises(ValueError, match=r"x must have shape \[M, K\] for weight"):
        skinny_gemm(x, torch.zeros(32, 48, device=device))
    with pytest.raises(TypeError, match="dtypes must match"):
        skinny_gemm(x, weight.half())
    with pytest.raises(ValueError, match="does not split into 4 x whole 32-wide chunks"):
        skinny_gemm(x, weight, block_k=32, split_k=4)
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16"):
        skinny_gemm(x, weight, block_n=8)
    with pytest.raises(ValueError, match="split_k must be a power of two"):
        skinny_gemm(x, weight, block_k=16, split_k=3)
    with pytest.raises(ValueError, match="weight must be contiguous"):
        skinny_gemm(x, torch.zeros(64, 32, device=device).T)


@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
def test_default_config_fills_an_h200_and_splits_k_into_whole_chunks(name):
    n, k = LLAMA3_8B_SHAPES[name]
    config = choose_skinny_config(32, n, k, num_sms=132)
    assert k % (config.split_k * config.block_k) == 0
    programs = triton.cdiv(n, config.block_n) * config.split_k
    assert programs >= 2 * 132 or config.split_k == 8


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
def test_gpu_llama_shapes_match_reference(dtype, name, device):
    n, k = LLAMA3_8B_SHAPES[name]
    weight = (torch.randn(n, k, device=device) / k**0.5).to(dtype)
    for num_rows in (9, 16, 24, 32, 33, 64):
        x = torch.randn(num_rows, k, device=device).to(dtype)
        ref = gemv_ref(x, weight)
        for split_k in (None, 1, 2):
            assert_close(skinny_gemm(x, weight, split_k=split_k), ref, dtype)


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph(device):
    x, weight = _inputs(24, 4096, 4096, torch.bfloat16, device)
    out = torch.empty(24, 4096, device=device, dtype=torch.bfloat16)
    skinny_gemm(x, weight, split_k=4, out=out)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_gemm(x, weight, split_k=4, out=out)
    for _ in range(2):
        x.copy_(torch.randn_like(x))
        graph.replay()
        assert_close(out, gemv_ref(x, weight), torch.bfloat16)
