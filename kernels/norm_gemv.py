"""Triton kernel: residual add + RMSNorm + GEMV for one row, the pre-norm linear layer of a
decode step at batch 1.

A Llama layer at batch 1 runs `fused_add_rms_norm` and then a GEMV twice (before qkv and before
gate_up): two launches of ~2 us each and the gaps around them, per layer. Here the GEMV's
programs compute the norm themselves. Each program first reads the whole row (hidden, plus the
residual: 2 x 8 KB at hidden 4096, from L2) for its sum of squares, then streams its
`BLOCK_N` rows of the weight while normalizing the row's chunks on the fly; program 0 also
writes the new residual. Values and rounding are `fused_add_rms_norm_ref` then `x @ weight.T`
(`reference.norm_gemv_ref`). One row only: at more rows the norm is cheap next to a GEMM that
tensor cores run, and cuBLAS or `gemv` do that.

Whether this beats `fused_add_rms_norm` + `gemv` on a GPU is `bench/bench_gemv.py`'s question;
`sitsd.model.linear` uses it only where measured faster.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_same_device,
    check_same_dtype,
    check_shape,
    next_power_of_2,
)

__all__ = ["norm_gemv"]


@triton.jit
def _row_chunk(h_ptr, res_ptr, offs, mask, HAS_RESIDUAL: tl.constexpr):
    """One chunk of `hidden + residual`, rounded to the activation dtype as torch's add is."""
    r = tl.load(h_ptr + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        res = tl.load(res_ptr + offs, mask=mask, other=0.0)
        r = (r.to(tl.float32) + res.to(tl.float32)).to(r.dtype)
    return r


@triton.jit
def _norm_gemv_kernel(
    h_ptr,
    res_ptr,
    res_out_ptr,
    norm_w_ptr,
    w_ptr,
    out_ptr,
    N,
    eps,
    K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_k = tl.arange(0, BLOCK_K)
    # Pass 1: the row's sum of squares (program 0 also writes the new residual).
    ss = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + offs_k
        mask = offs < K
        r = _row_chunk(h_ptr, res_ptr, offs, mask, HAS_RESIDUAL)
        if HAS_RESIDUAL:  # noqa: SIM102 (a constexpr branch, then a runtime one)
            if pid == 0:
                tl.store(res_out_ptr + offs, r, mask=mask)
        rf = r.to(tl.float32)
        ss += rf * rf
    rstd = 1.0 / tl.sqrt(tl.sum(ss, 0) / K + eps)
    # Pass 2: stream this program's weight rows against the normed row.
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    w_rows = w_ptr + offs_n.to(tl.int64)[:, None] * K
    for k0 in range(0, K, BLOCK_K):
        offs = k0 + offs_k
        mask = offs < K
        r = _row_chunk(h_ptr, res_ptr, offs, mask, HAS_RESIDUAL)
        normed = (r.to(tl.float32) * rstd).to(r.dtype).to(tl.float32)  # as rms_norm_ref rounds
        g = tl.load(norm_w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x = (normed * g).to(r.dtype).to(tl.float32)
        w = tl.load(w_rows + offs[None, :], mask=n_mask[:, None] & mask[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)  # [BLOCK_N]
    tl.store(out_ptr + offs_n, y.to(out_ptr.dtype.element_ty), mask=n_mask)


def norm_gemv(
    hidden: torch.Tensor,  # [1, K]
    residual: torch.Tensor | None,  # [1, K]; None: no add (the first layer)
    norm_weight: torch.Tensor,  # [K]
    eps: float,
    weight: torch.Tensor,  # [N, K]
    *,
    block_n: int = 4,
    block_k: int | None = None,
    num_warps: int = 4,
) -> tuple[torch.Tensor, torch.Tensor]:  # [1, N], [1, K]
    """`x, residual = fused_add_rms_norm(hidden, residual, norm_weight, eps)`, then
    `x @ weight.T`, in one launch; returns `(out, residual)` (see `norm_gemv_ref`).

    With `residual` None the row is only normed and `hidden` itself is returned as the residual.
    The new residual is a new tensor (never written over an input: programs other than the one
    that writes it still read the old one). Capturable in a CUDA graph (no host sync).

    Args:
        hidden: The row, fp16/bf16/fp32, contiguous.
        residual: The residual stream's row, `hidden`'s shape and dtype, or None.
        norm_weight: RMSNorm weight `[K]`, `hidden`'s dtype.
        eps: RMSNorm epsilon.
        weight: `[N, K]`, contiguous, `hidden`'s dtype.
        block_n: Weight rows per program (power of two).
        block_k: K elements per chunk (power of two >= 16; default one 16-byte vector per
            thread across the program).
        num_warps: Warps per program.

    Raises:
        ValueError, TypeError: shapes, strides, devices or dtypes that do not fit.
    """
    check_shape("weight", weight, (weight.shape[0], hidden.shape[-1]), "[N, K]")
    n, k = weight.shape
    check_shape("hidden", hidden, (1, k), "[1, K] (one row)")
    check_shape("norm_weight", norm_weight, (k,), "[K]")
    check_dtype("hidden", hidden, FLOAT_DTYPES)
    tensors = {"hidden": hidden, "norm_weight": norm_weight, "weight": weight}
    if residual is not None:
        check_shape("residual", residual, (1, k), "[1, K]")
        tensors["residual"] = residual
    check_same_dtype(**tensors)
    check_same_device(**tensors)
    for name, t in tensors.items():
        check_contiguous(name, t)
    if block_k is None:
        block_k = 16 // hidden.element_size() * 32 * num_warps
    block_k = max(16, min(block_k, next_power_of_2(k)))
    if block_n & (block_n - 1) or block_n < 1:
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    out = torch.empty(1, n, device=hidden.device, dtype=hidden.dtype)
    res_out = torch.empty_like(hidden) if residual is not None else hidden
    _norm_gemv_kernel[(triton.cdiv(n, block_n),)](
        hidden, residual if residual is not None else hidden, res_out, norm_weight, weight, out,
        n, eps, K=k, BLOCK_N=block_n, BLOCK_K=block_k, HAS_RESIDUAL=residual is not None,
        num_warps=num_warps,
    )  # fmt: skip
    return out, res_out
