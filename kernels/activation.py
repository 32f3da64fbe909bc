"""Triton kernel: SiLU-and-mul, the SwiGLU activation on a fused gate/up projection output.

`out = silu(x[..., :d]) * x[..., d:]` for rows of width `2d`, one read of each input element and
one write of each output element. Rounding follows `reference.silu_and_mul_ref` in 16-bit dtypes
(`silu` rounded to the input dtype, then the product rounded again). The projection that
produces the fused `[gate | up]` layout is the model's business.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    check_dtype,
    check_out,
    check_pdl,
    next_power_of_2,
)

__all__ = ["silu_and_mul"]

_BLOCK = 1024


@triton.jit
def _silu_and_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_o,
    D: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < D
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)  # [BLOCK]
    up = tl.load(x_ptr + row * stride_x + D + offs, mask=mask, other=0.0)
    gate_f = gate.to(tl.float32)
    silu = (gate_f / (1.0 + tl.exp(-gate_f))).to(gate.dtype).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (silu * up.to(tl.float32)).to(gate.dtype), mask=mask)


def silu_and_mul(
    x: torch.Tensor,  # [..., 2 * d]
    *,
    out: torch.Tensor | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [..., d]
    """`silu(x[..., :d]) * x[..., d:]` (see `silu_and_mul_ref`).

    Args:
        x: Fused gate/up activations, fp32/fp16/bf16, even last dimension; 2-D with a contiguous
            last dimension, or contiguous N-D.
        out: Optional preallocated contiguous output (keyword-only), `[..., d]` in `x`'s dtype.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).

    Returns:
        The activated rows (`out` when given).
    """
    check_dtype("x", x, FLOAT_DTYPES)
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"x must have an even last dimension, got shape {tuple(x.shape)}")
    if x.shape[-1] > 1 and x.stride(-1) != 1:
        raise ValueError(f"x must be contiguous in its last dimension, got strides {x.stride()}")
    if x.dim() != 2 and not x.is_contiguous():
        raise ValueError(f"x must be 2-D or contiguous, got strides {x.stride()}")
    d = x.shape[-1] // 2
    out_shape = (*x.shape[:-1], d)
    if out is None:
        out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    check_out("out", out, out_shape, x.dtype, x.device)
    check_pdl(pdl, x)
    x2d = x if x.dim() == 2 else x.view(-1, 2 * d)
    num_rows = x2d.shape[0]
    if num_rows == 0 or d == 0:
        return out

    block = min(_BLOCK, next_power_of_2(d))
    _silu_and_mul_kernel[(num_rows, triton.cdiv(d, block))](
        x2d, out, x2d.stride(0), d, D=d, BLOCK=block, PDL=pdl, num_warps=4, launch_pdl=pdl
    )
    return out
