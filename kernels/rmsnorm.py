"""Triton kernels: RMSNorm, and residual add fused with RMSNorm.

One program per row (token) reads the row once, computes `rsqrt(mean(x^2) + eps)` in fp32 and
writes the normed row; the fused variant first adds the residual and also writes the new
residual, so the pre-norm residual stream costs one read of each input and one write of each
output. Rounding follows `reference.rms_norm_ref` (Hugging Face's LlamaRMSNorm): the normed row is
cast to the input dtype before the weight multiplies it, and the output dtype is
`torch.promote_types(x.dtype, weight.dtype)`. The fused variant also takes x as a split-K
layer's float32 partials (`int4_matmul(unsummed=True)`): it sums them in split order and rounds
the sum to the residual's dtype, the bits a separate sum kernel would have written, without
that kernel's launch and its 16-bit round trip. Where the norm sits in the model is the
model's business.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    check_contiguous,
    check_dtype,
    check_out,
    check_pdl,
    check_same_device,
    check_shape,
    next_power_of_2,
)

__all__ = ["fused_add_rms_norm", "rms_norm"]

# One row must fit in one program's registers: 64k elements covers hidden sizes well past
# today's models (Llama-3-405B: 16384).
_MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr,
    residual_ptr,
    weight_ptr,
    out_ptr,
    residual_out_ptr,
    eps,
    stride_x,
    stride_r,
    stride_o,
    stride_ro,
    parts_stride,  # PARTS: elements between two partials of x
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,
    ADD_RESIDUAL: tl.constexpr,
    PARTS: tl.constexpr,  # x is this many float32 partials summed here (0: x itself)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    if PARTS > 0:  # in split order, rounded to the residual's dtype, as `_split_sum_kernel`
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        for part in tl.static_range(PARTS):
            acc += tl.load(x_ptr + part * parts_stride + row * stride_x + offs, mask=mask,
                           other=0.0)  # fmt: skip
        x = acc.to(residual_out_ptr.dtype.element_ty)
    else:
        x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK]
    if ADD_RESIDUAL:
        residual = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0)
        # Round the sum to the activation dtype, as `x + residual` does in PyTorch.
        x = (x.to(tl.float32) + residual.to(tl.float32)).to(x.dtype)
        tl.store(residual_out_ptr + row * stride_ro + offs, x, mask=mask)
    xf = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / HIDDEN + eps)
    normed = (xf * rstd).to(x.dtype).to(tl.float32)  # rounded like the reference
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + row * stride_o + offs, (normed * weight).to(out_ptr.dtype.element_ty), mask=mask
    )


def _as_rows(name: str, x: torch.Tensor) -> torch.Tensor:
    """View `x` as [num_rows, hidden]: 2-D may have any row stride, N-D must be contiguous."""
    if x.dim() < 1:
        raise ValueError(f"{name} must have at least one dimension")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"{name} must be contiguous in its last dimension, got {x.stride()}")
    if x.dim() == 2:
        return x
    check_contiguous(name, x)
    return x.view(-1, x.shape[-1])


def _check_norm_args(x: torch.Tensor, weight: torch.Tensor) -> None:
    check_dtype("x", x, FLOAT_DTYPES)
    check_dtype("weight", weight, FLOAT_DTYPES)
    check_shape("weight", weight, (x.shape[-1],), "[hidden]")
    check_contiguous("weight", weight)
    check_same_device(x=x, weight=weight)
    if x.shape[-1] > _MAX_HIDDEN:
        raise ValueError(f"hidden size {x.shape[-1]} exceeds {_MAX_HIDDEN}")


def _launch(x2d, residual2d, weight, out2d, residual_out2d, eps: float, pdl: bool,
            parts: torch.Tensor | None = None) -> None:  # fmt: skip
    """`parts` ([P, rows, hidden] float32, contiguous): x is their sum (x2d is parts[0])."""
    num_rows, hidden = x2d.shape
    if num_rows == 0:
        return
    block = next_power_of_2(hidden)
    add_residual = residual2d is not None
    if not add_residual:
        residual2d = residual_out2d = x2d  # unused by the kernel
    num_parts = 0 if parts is None else parts.shape[0]
    _rms_norm_kernel[(num_rows,)](
        x2d, residual2d, weight, out2d, residual_out2d, eps,
        x2d.stride(0), residual2d.stride(0), out2d.stride(0), residual_out2d.stride(0),
        x2d.numel(), HIDDEN=hidden, BLOCK=block, ADD_RESIDUAL=add_residual, PARTS=num_parts,
        PDL=pdl,
        num_warps=min(max(block // 256, 1), 16), launch_pdl=pdl,
    )  # fmt: skip


def rms_norm(
    x: torch.Tensor,  # [..., hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [..., hidden]
    """RMSNorm of each row of `x` (see `rms_norm_ref`).

    Args:
        x: Activations, fp32/fp16/bf16; 2-D with a contiguous last dimension, or contiguous N-D.
        weight: Per-channel scale, fp32/fp16/bf16, contiguous.
        eps: Added to the mean square before the reciprocal square root.
        out: Optional preallocated contiguous output (keyword-only), `x`'s shape and dtype
            `promote_types(x.dtype, weight.dtype)`.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).

    Returns:
        The normed rows (`out` when given).
    """
    _check_norm_args(x, weight)
    x2d = _as_rows("x", x)
    out_dtype = torch.promote_types(x.dtype, weight.dtype)
    if out is None:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    check_out("out", out, tuple(x.shape), out_dtype, x.device)
    check_pdl(pdl, x)
    _launch(x2d, None, weight, out.view(-1, x.shape[-1]), None, eps, pdl)
    return out


def fused_add_rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
    *,
    pdl: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:  # normed [num_tokens, hidden], residual
    """`residual = x + residual; return rms_norm(residual), residual`, in one pass, in place.

    x may also be a split-K layer's float32 partials, `[parts, *residual's shape]`
    (`int4_matmul(unsummed=True)`): x is then their sum in split order, rounded to the
    residual's dtype, and the normed rows get a new tensor.

    Writes the new residual into `residual` and, when the normed output has `x`'s dtype (the
    weight's dtype does not promote it), the normed rows into `x`; both are returned (see
    `fused_add_rms_norm_ref`). A promoting weight (fp32 weight, 16-bit `x`) gets a new output.

    Args:
        x: Layer output, fp32/fp16/bf16, rows with a contiguous last dimension; overwritten.
        residual: Residual stream, `x`'s shape and dtype; overwritten with `x + residual`.
        weight: Per-channel scale, fp32/fp16/bf16, contiguous.
        eps: Added to the mean square before the reciprocal square root.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).

    Returns:
        `(normed, residual)`.
    """
    parts = None
    if x.dim() == residual.dim() + 1:  # a split-K layer's partials, summed here
        check_dtype("x", x, (torch.float32,))
        check_contiguous("x", x)
        check_shape("x", x, (x.shape[0], *residual.shape), "[parts, *residual's shape]")
        parts, x = x, x[0]
    _check_norm_args(x, weight)
    check_shape("residual", residual, tuple(x.shape), "x's shape")
    if residual.dtype != x.dtype and parts is None:
        raise TypeError(f"residual dtype {residual.dtype} differs from x dtype {x.dtype}")
    check_same_device(x=x, residual=residual)
    x2d = _as_rows("x", x)
    residual2d = _as_rows("residual", residual)
    out_dtype = torch.promote_types(residual.dtype, weight.dtype)
    # Rows are read before they are written within one program, so normed may alias x (but
    # not float32 partials: another dtype)
    if parts is None and out_dtype == x.dtype:
        out = x
    else:
        out = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    out2d = _as_rows("out", out)
    check_pdl(pdl, x)
    _launch(x2d, residual2d, weight, out2d, residual2d, eps, pdl, parts)
    return out, residual
