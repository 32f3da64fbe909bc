"""Plain-PyTorch references for the quantized-weight kernels.

They define what `int4_matmul`, `int4_dequantize`, `per_token_quant_fp8` and `fp8_matmul`
compute, in float32 and without shortcuts; the kernel tests compare against them. The layouts
are `sitsd.kernels.quant_layout`'s. FP8 activations are quantized per token at run time: each
row of x gets the scale `max(|x_row|) / 448` (448 is e4m3's largest finite value; at least
`FP8_MIN_SCALE`), and `x_row / scale`, rounded to nearest even in e4m3, is what the FP8 GEMM
multiplies.

An INT8 weight (`[N, K]` int8 codes, `[G, N]` scales, W = q * scale) has a reference dequant
here too; no kernel reads it yet.
"""

from __future__ import annotations

import torch

from sitsd.kernels.quant_layout import FP8_MAX, FP8_MIN_SCALE, unpack_int4

__all__ = [
    "dequantize_int4_ref",
    "dequantize_int8_ref",
    "fp8_matmul_ref",
    "int4_matmul_ref",
    "per_token_quant_fp8_ref",
]


def _group_columns(table: torch.Tensor, k: int, group_size: int) -> torch.Tensor:  # [N, K]
    """Expand a `[G, N]` per-group table to one float32 value per (row, column) of W."""
    group = torch.arange(k, device=table.device) // group_size
    return table.float().T[:, group]


def dequantize_int4_ref(
    qweight: torch.Tensor,  # [N, K // 8] int32
    scales: torch.Tensor,  # [G, N]
    offsets: torch.Tensor | None,  # [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # [K] int32
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K], input columns in x's order (perm undone)
    """W of an INT4 weight: float32 arithmetic, then one cast to `dtype`."""
    codes = unpack_int4(qweight).float()  # [N, K]
    k = codes.shape[1]
    scale = _group_columns(scales, k, group_size)
    if offsets is None:
        weight = (codes - 8.0) * scale
    else:
        weight = codes * scale + _group_columns(offsets, k, group_size)
    if perm is not None:
        natural = torch.empty_like(weight)
        natural[:, perm.long()] = weight
        weight = natural
    return weight.to(dtype)


def int4_matmul_ref(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:  # [M, N] in x's dtype
    """`x @ W.T` for an INT4 weight, accumulated in float32."""
    weight = dequantize_int4_ref(qweight, scales, offsets, group_size, perm)
    return (x.float() @ weight.T).to(x.dtype)


def dequantize_int8_ref(
    qweight: torch.Tensor,  # [N, K] int8
    scales: torch.Tensor,  # [G, N]
    group_size: int,
    *,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [N, K]
    """W of an INT8 group-quantized weight: `q * scale` in float32 (exact), cast to `dtype`."""
    k = qweight.shape[1]
    return (qweight.float() * _group_columns(scales, k, group_size)).to(dtype)


def per_token_quant_fp8_ref(
    x: torch.Tensor,  # [M, K]
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] float8_e4m3fn, [M, 1] float32
    """Dynamic per-token FP8 quantization: each row's scale and its e4m3 codes."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp_min(FP8_MIN_SCALE)
    codes = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return codes, scale


def fp8_matmul_ref(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
) -> torch.Tensor:  # [M, N] in x's dtype
    """W8A8: x quantized per token, times the FP8 weight, both scales applied, float32 sums."""
    codes, x_scale = per_token_quant_fp8_ref(x)
    w = weight.float() * weight_scale.float()[:, None]
    return ((codes.float() * x_scale) @ w.T).to(x.dtype)
