"""Triton kernel: skinny GEMM, `y = x @ weight.T` for 2 to 64 rows of x (decode batches of
9-64 sequences), split over K.

At these batch sizes a linear layer still reads its whole weight once and does little else, so it
is memory bound, but `gemv`'s narrow tiles stop paying: every program re-reads all M rows of x
from L2, and at 32 rows that is more traffic than the weight itself (`bench/bench_gemv.py`
measured gemv at 0.57-0.85 of copy bandwidth there). cuBLAS reaches only 0.57-0.72 on the
Llama-3-8B o and qkv shapes (its small-N tiles leave SMs idle, and its split-K adds a reduce).
Here (`reference.gemv_ref` defines the result):

* swapped operands: each program multiplies a `[BLOCK_N, BLOCK_K]` weight tile by the
  `[BLOCK_K, M]` transposed activation chunk, so the weight rows fill the MMA's M side (64 or
  128: Hopper's warp-group MMA) and the few activation rows its N side, instead of padding x's
  rows to the MMA tile;
* split-K: programs `(N / BLOCK_N) x split_k`, each over `K / split_k` of the reduction, so that
  layers with few output columns (o, down: 4096) still occupy every SM. With `split_k > 1` each
  split writes an fp32 partial `[M, N]` slab and a second small kernel sums the slabs in a fixed
  order (deterministic) and rounds to x's dtype;
* fp32 accumulation; weight loads need no mask when `BLOCK_N` divides N, and K must split into
  whole `BLOCK_K` chunks (`K % (split_k * block_k) == 0`).

Both kernels take programmatic dependent launch (`kernels/_pdl.py`). Whether a layer runs this
kernel, `gemv` or cuBLAS is the model runner's decision (`sitsd.model.linear`), by measurement.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._utils import (
    cdiv,
    check_out,
    check_pdl,
    check_small_linear,
    next_power_of_2,
    num_sms,
    runs_in_interpreter,
)

__all__ = ["MAX_ROWS", "SkinnyConfig", "choose_skinny_config", "skinny_gemm"]

MAX_ROWS = 64  # rows of x: the MMA's N side holds them all
_SUM_BLOCK = 1024  # elements per program of the split-sum kernel


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch configuration of one `skinny_gemm` call."""

    block_n: int = 128  # weight rows per program (the MMA's M side), a power of two >= 16
    block_k: int = 128  # K elements per chunk, a power of two >= 16
    split_k: int = 1  # programs along K; their partials are summed by a second kernel
    num_warps: int = 4
    num_stages: int = 4  # software-pipelining depth of the chunk loads


@triton.jit(do_not_specialize=["M"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    out_ptr,  # [M, N] in x's dtype, or with SPLIT_K > 1 the fp32 partials [SPLIT_K, M, N]
    M,
    N,
    stride_xm,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr,  # BLOCK_N divides N: weight loads need no mask
    UPCAST: tl.constexpr,  # feed tl.dot fp32 (the interpreter's bf16 dot is wrong)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    K_SPLIT: tl.constexpr = K // SPLIT_K
    split = tl.program_id(1)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = split * K_SPLIT + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    x_ptrs = x_ptr + offs_m[None, :] * stride_xm + offs_k[:, None]  # [BLOCK_K, BLOCK_M]: x^T
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for _ in range(0, K_SPLIT, BLOCK_K):
        if EVEN_N:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0)
        xt = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
        if UPCAST:
            w, xt = w.to(tl.float32), xt.to(tl.float32)
        acc = tl.dot(w, xt, acc, input_precision="ieee")
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    offs = offs_m[None, :] * N + offs_n[:, None]  # [BLOCK_N, BLOCK_M] into row-major [M, N]
    mask = n_mask[:, None] & m_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split * M * N + offs, acc, mask=mask)


@triton.jit
def _split_sum_kernel(
    part_ptr,  # [SPLIT_K, size] fp32
    out_ptr,  # [size]
    size,
    SPLIT_K: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # a fixed order: the same bits every time
        acc += tl.load(part_ptr + split * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_skinny_config(num_rows: int, n: int, k: int, *, num_sms: int = 132) -> SkinnyConfig:
    """A default for `x [num_rows, k] @ weight[n, k].T`: 128-row weight tiles (64 when N is not
    a multiple of 128), 128-wide chunks, and the smallest split of K into whole chunks that
    gives at least two programs per SM (at most 8 splits)."""
    del num_rows  # one tiling serves every row count up to MAX_ROWS
    block_n = 128 if n % 128 == 0 else 64
    block_k = max(16, min(128, next_power_of_2(k)))
    tiles = cdiv(n, block_n)
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k < 8 and k % (2 * split_k * block_k) == 0:
        split_k *= 2
    return SkinnyConfig(block_n, block_k, split_k)


def skinny_gemm(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K]
    *,
    block_n: int | None = None,
    block_k: int | None = None,
    split_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [M, N]
    """`x @ weight.T` for up to 64 rows of x (see `gemv_ref`), one launch, or two with
    `split_k > 1` (the partials' sum).

    Host-sync free and shape-deterministic (the fp32 partials come from torch's caching
    allocator), so it can be captured in a CUDA graph. The launch options default to
    `choose_skinny_config`; each one given overrides its default.

    Args:
        x: Activations, fp32/fp16/bf16, last dimension contiguous; `[M, K]`, M <= 64.
        weight: `[N, K]`, contiguous, `x`'s dtype (an `nn.Linear` weight).
        block_n: Weight rows per program (power of two >= 16).
        block_k: K elements per chunk (power of two >= 16).
        split_k: Programs along K (power of two); K must be a multiple of split_k * block_k.
        num_warps: Warps per program.
        num_stages: Software-pipelining depth of the chunk loads.
        out: Optional preallocated contiguous output, `[M, N]` in `x`'s dtype.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).

    Returns:
        `[M, N]` in `x`'s dtype (`out` when given).

    Raises:
        ValueError: Shapes, strides, devices or tilings that do not fit, or M > 64.
        TypeError: Unsupported or mismatched dtypes.
    """
    check_small_linear("skinny_gemm", x, weight, MAX_ROWS)
    num_rows, k = x.shape
    n = weight.shape[0]
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    check_out("out", out, (num_rows, n), x.dtype, x.device)
    check_pdl(pdl, x)
    default = choose_skinny_config(num_rows, n, k, num_sms=num_sms(x.device))
    block_n = block_n or default.block_n
    block_k = block_k or default.block_k
    split_k = split_k or default.split_k
    for name, value in (("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if split_k < 1 or split_k & (split_k - 1):
        raise ValueError(f"split_k must be a power of two, got {split_k}")
    if k % (split_k * block_k):
        raise ValueError(
            f"K = {k} does not split into {split_k} x whole {block_k}-wide chunks; "
            "choose a smaller block_k or split_k"
        )
    if num_rows == 0 or n == 0:
        return out

    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
    upcast = runs_in_interpreter(x) and x.dtype == torch.bfloat16
    target = out
    if split_k > 1:
        target = torch.empty((split_k, num_rows, n), dtype=torch.float32, device=x.device)
    _skinny_gemm_kernel[(cdiv(n, block_n), split_k)](
        x, weight, target, num_rows, n, x.stride(0),
        K=k, BLOCK_M=max(16, next_power_of_2(num_rows)), BLOCK_N=block_n, BLOCK_K=block_k,
        SPLIT_K=split_k, EVEN_N=n % block_n == 0, UPCAST=upcast, PDL=pdl,
        num_warps=num_warps or default.num_warps, num_stages=num_stages or default.num_stages,
        launch_pdl=pdl,
    )  # fmt: skip
    if split_k > 1:
        size = num_rows * n
        _split_sum_kernel[(cdiv(size, _SUM_BLOCK),)](
            target, out, size, SPLIT_K=split_k, BLOCK=_SUM_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )  # fmt: skip
    return out
