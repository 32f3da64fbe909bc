"""Triton kernel: dequantize an INT4 group-quantized weight into a 16-bit `[N, K]` matrix.

The other half of the prefill path "dequantize + cuBLAS": for a prompt chunk of hundreds of
tokens a GEMM is compute bound, and cuBLAS on the 16-bit weight may beat `int4_matmul`'s `dot`
mode; the dequantization reads 0.5 byte and writes 2 bytes per weight once per layer and chunk,
into a workspace the caller owns (one, sized for the largest layer, serves every layer).

Each program dequantizes a `[BLOCK_N, BLOCK_K]` tile in float32 exactly as
`quant_reference.dequantize_int4_ref` defines it (`q * scale + offset`, or `(q - 8) * scale`)
and rounds it once to the output dtype; with act-order (`perm`) it stores layout column j at
input column `perm[j]`, so the result multiplies x as it is (`x @ out.T`). Which path a layer
takes is the model's decision, by measurement (`bench/bench_quant_kernels.py`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._int4_tile import dequant_tile
from sitsd.kernels._utils import FLOAT_DTYPES, cdiv, check_dtype, check_out
from sitsd.kernels.quant_layout import SLICE_MAJOR_BLOCK, check_int4_layout, check_slice_major

__all__ = ["int4_dequantize"]


@triton.jit
def _int4_dequant_kernel(
    qw_ptr,
    s_ptr,
    o_ptr,  # offsets, or any pointer without HAS_OFFSETS
    perm_ptr,  # act-order permutation, or any pointer without HAS_PERM
    out_ptr,  # [N, K]
    N,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_OFFSETS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SLICED: tl.constexpr,  # slice-major codes, BLOCK_K whole blocks of 128 (HAS_PERM False)
    EVEN: tl.constexpr,  # BLOCK_N divides N and BLOCK_K divides K: no masks
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    w = dequant_tile(qw_ptr, s_ptr, o_ptr, offs_n, n_mask, k0, N, K, GROUP, BLOCK_N, BLOCK_K,
                     HAS_OFFSETS, EVEN)  # fmt: skip
    if SLICED:  # each block's [16 words, 8 nibbles] holds its columns as [8, 16]: turned back
        w = tl.reshape(tl.permute(tl.reshape(w, [BLOCK_N, BLOCK_K // 128, 16, 8]), (0, 1, 3, 2)),
                       [BLOCK_N, BLOCK_K])  # fmt: skip
    cols = offs_k
    if HAS_PERM:
        cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
    ptrs = out_ptr + offs_n[:, None].to(tl.int64) * K + cols[None, :]
    if EVEN:
        tl.store(ptrs, w.to(out_ptr.dtype.element_ty))
    else:
        tl.store(ptrs, w.to(out_ptr.dtype.element_ty), mask=n_mask[:, None] & (offs_k < K)[None, :])


def int4_dequantize(
    qweight: torch.Tensor,  # [N, K // 8] int32
    scales: torch.Tensor,  # [G, N]
    offsets: torch.Tensor | None,  # [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # [K] int32
    *,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    block_k: int = 128,
    num_warps: int = 4,
    slice_major: bool = False,
) -> torch.Tensor:  # [N, K]
    """W of an INT4 weight (`sitsd.kernels.quant_layout`), input columns in x's order.

    Host-sync free and shape-deterministic, so it can be captured in a CUDA graph.

    Args:
        qweight: `[N, K // 8]` int32 codes.
        scales: `[ceil(K / group_size), N]`, float16/bfloat16/float32.
        offsets: Same shape and dtypes as scales, or None (symmetric: zero point 8).
        group_size: 32, 64 or 128.
        perm: act-order permutation `[K]` int32, or None.
        dtype: Output dtype (fp32/fp16/bf16), ignored when `out` is given.
        out: Optional preallocated contiguous output `[N, K]` (a shared workspace).
        block_n: Rows per program (power of two).
        block_k: Columns per program (power of two >= 8).
        num_warps: Warps per program.
        slice_major: The codes are slice-major and `perm` is their permutation
            (`quant_layout.slice_major_perm`, not checked); with `block_k` a multiple of 128
            each tile is put back in column order in registers and stored in runs, instead of
            scattered through `perm`.

    Returns:
        `[N, K]` (`out` when given).

    Raises:
        ValueError: Shapes, strides, devices or tiles that do not fit.
        TypeError: Unsupported dtypes.
    """
    n, k = check_int4_layout(qweight, scales, offsets, group_size, perm)
    if out is None:
        if dtype not in FLOAT_DTYPES:
            raise TypeError(f"dtype must be float32, float16 or bfloat16, got {dtype}")
        out = torch.empty((n, k), dtype=dtype, device=qweight.device)
    check_dtype("out", out, FLOAT_DTYPES)
    check_out("out", out, (n, k), out.dtype, qweight.device)
    for name, value, least in (("block_n", block_n, 1), ("block_k", block_k, 8)):
        if value < least or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= {least}, got {value}")
    if n == 0 or k == 0:
        return out
    if slice_major:
        check_slice_major(perm, group_size)
    sliced = slice_major and block_k % SLICE_MAJOR_BLOCK == 0
    grid = (cdiv(n, block_n), cdiv(k, block_k))
    _int4_dequant_kernel[grid](
        qweight, scales, scales if offsets is None else offsets,
        qweight if perm is None else perm, out, n,
        K=k, GROUP=group_size, BLOCK_N=block_n, BLOCK_K=block_k,
        HAS_OFFSETS=offsets is not None, HAS_PERM=perm is not None and not sliced, SLICED=sliced,
        EVEN=n % block_n == 0 and k % block_k == 0, num_warps=num_warps,
    )  # fmt: skip
    return out
