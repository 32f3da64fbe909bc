"""Triton kernels: FP8 W8A8 linear layers, `y = x @ W.T` with W in float8_e4m3fn and per-output
scales, x quantized per token at run time.

Two steps (`quant_reference.fp8_matmul_ref` defines the result):

* `per_token_quant_fp8`: one program per row of x finds `max |x_row|` (a first pass over the
  row), sets the row's scale `max / 448` (at least `FP8_MIN_SCALE`), and writes
  `x_row / scale` rounded to nearest even in e4m3 (IEEE division, as the reference divides);
* the GEMM on the FP8 tensor cores (compute capability 8.9+), float32 accumulation, both scales
  applied to the accumulator in the epilogue: `backend="scaled_mm"` calls torch's
  `torch._scaled_mm` with row-wise scales (cuBLASLt/CUTLASS on Hopper; torch also runs it on the
  CPU), `backend="triton"` the tiled `tl.dot` kernel here, for shapes or dtypes `_scaled_mm`
  refuses (N or K not multiples of 16; row-wise scaling on Hopper wants a bf16 output).

The weight layout (`[N, K]` e4m3 rows, `[N]` float32 scales: `sitsd.kernels.quant_layout`) is
what `sitsd.quant` converts FP8 checkpoints into. Which backend a layer uses is the model's
decision; `bench/bench_quant_kernels.py` measures both.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    cdiv,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_out,
    next_power_of_2,
    runs_in_interpreter,
)
from sitsd.kernels.quant_layout import FP8_DTYPE, FP8_MAX, FP8_MIN_SCALE, check_fp8_layout

__all__ = ["BACKENDS", "fp8_matmul", "per_token_quant_fp8"]

BACKENDS = ("scaled_mm", "triton")


@triton.jit
def _round_to_e4m3(v):
    """v (float32, |v| <= 448) rounded to nearest even on the e4m3 grid, still float32.

    The cast to float8e4nv that follows is then exact. Rounding here rather than in the cast
    gives the same bits on the GPU and in the interpreter, whose fp32 -> fp8 cast drops the carry
    when the mantissa rounds up into the next binade (31.2 becomes 16, not 32).
    """
    bits = v.to(tl.int32, bitcast=True)
    exponent = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)  # below 2**-6: subnormal steps
    step = ((exponent - 3 + 127) << 23).to(tl.float32, bitcast=True)  # 2**(exponent - 3)
    inv_step = ((127 - exponent + 3) << 23).to(tl.float32, bitcast=True)
    r = tl.abs(v) * inv_step  # exact: a power of two; r < 16
    r = (r + 12582912.0) - 12582912.0  # 1.5 * 2**23: the add rounds r to an integer, half even
    return tl.where(bits < 0, -r, r) * step  # the sign from the bits: -0.0 stays -0.0


@triton.jit(do_not_specialize=["M"])
def _per_token_quant_kernel(
    x_ptr,  # [M, K]
    codes_ptr,  # [M, K] float8_e4m3fn
    scale_ptr,  # [M] float32
    M,
    stride_xm,
    K: tl.constexpr,
    BLOCK_K: tl.constexpr,
    FP8_MAX: tl.constexpr,
    MIN_SCALE: tl.constexpr,
):
    row = tl.program_id(0)
    x_row = x_ptr + row.to(tl.int64) * stride_xm
    offs = tl.arange(0, BLOCK_K)
    # -- the row's largest magnitude --
    amax = tl.zeros([BLOCK_K], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = tl.load(x_row + k0 + offs, mask=k0 + offs < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    scale = tl.maximum(tl.max(amax, axis=0) / FP8_MAX, MIN_SCALE)
    tl.store(scale_ptr + row, scale)
    # -- the codes --
    for k0 in range(0, K, BLOCK_K):
        mask = k0 + offs < K
        x = tl.load(x_row + k0 + offs, mask=mask, other=0.0).to(tl.float32)
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        q = _round_to_e4m3(q)
        tl.store(codes_ptr + row.to(tl.int64) * K + k0 + offs, q.to(tl.float8e4nv), mask=mask)


@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    a_ptr,  # [M, K] float8_e4m3fn codes of x
    a_scale_ptr,  # [M] float32
    w_ptr,  # [N, K] float8_e4m3fn
    w_scale_ptr,  # [N] float32
    out_ptr,  # [M, N]
    M,
    N,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # feed tl.dot float32 (the interpreter)
):
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    m_mask = offs_m < M
    n_mask = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_mask = k0 + offs_k < K
        a = tl.load(a_ptrs, mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    # epilogue: both scales on the float32 sums
    a_scale = tl.load(a_scale_ptr + offs_m, mask=m_mask, other=0.0)
    w_scale = tl.load(w_scale_ptr + offs_n, mask=n_mask, other=0.0)
    y = acc * a_scale[:, None] * w_scale[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def per_token_quant_fp8(
    x: torch.Tensor,  # [M, K]
    *,
    codes: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    block_k: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:  # [M, K] float8_e4m3fn, [M, 1] float32
    """Quantize each row of x to e4m3 with its own scale (see `per_token_quant_fp8_ref`).

    Host-sync free and shape-deterministic, so it can be captured in a CUDA graph.

    Args:
        x: fp32/fp16/bf16 `[M, K]`, last dimension contiguous.
        codes: Optional preallocated contiguous `[M, K]` float8_e4m3fn output.
        scales: Optional preallocated contiguous `[M, 1]` float32 output.
        block_k: Columns per chunk (a power of two >= 16; capped at K's power of two).

    Returns:
        The codes and the per-row scales.
    """
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    num_rows, k = x.shape
    if codes is None:
        codes = torch.empty((num_rows, k), dtype=FP8_DTYPE, device=x.device)
    if scales is None:
        scales = torch.empty((num_rows, 1), dtype=torch.float32, device=x.device)
    check_out("codes", codes, (num_rows, k), FP8_DTYPE, x.device)
    check_out("scales", scales, (num_rows, 1), torch.float32, x.device)
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if num_rows == 0:
        return codes, scales
    _per_token_quant_kernel[(num_rows,)](
        x, codes, scales, num_rows, x.stride(0), K=k,
        BLOCK_K=min(block_k, max(16, next_power_of_2(k))), FP8_MAX=FP8_MAX,
        MIN_SCALE=FP8_MIN_SCALE, num_warps=4,
    )  # fmt: skip
    return codes, scales


def fp8_matmul(
    x: torch.Tensor,  # [M, K]
    weight: torch.Tensor,  # [N, K] float8_e4m3fn
    weight_scale: torch.Tensor,  # [N] float32
    *,
    backend: str = "scaled_mm",
    out: torch.Tensor | None = None,
    block_m: int = 64,
    block_n: int = 128,
    block_k: int = 128,
    num_warps: int = 8,
    num_stages: int = 3,
) -> torch.Tensor:  # [M, N]
    """`x @ W.T` for an FP8 weight, x quantized per token (see `fp8_matmul_ref`).

    Args:
        x: Activations fp32/fp16/bf16 `[M, K]`, last dimension contiguous.
        weight: `[N, K]` float8_e4m3fn, contiguous.
        weight_scale: `[N]` float32 (a per-tensor scale repeated N times).
        backend: "scaled_mm" (`torch._scaled_mm`) or "triton".
        out: Optional preallocated contiguous output `[M, N]` in x's dtype ("triton" only).
        block_m, block_n, block_k, num_warps, num_stages: The Triton GEMM's tiling.

    Returns:
        `[M, N]` in x's dtype.

    Raises:
        ValueError: Shapes, devices or a backend that do not fit.
        TypeError: Unsupported dtypes.
    """
    n, k = check_fp8_layout(weight, weight_scale)
    check_ndim("x", x, 2, "[M, K]")
    if x.shape[1] != k:
        raise ValueError(f"x must have shape [M, K] with K = {k} (weight's), got {tuple(x.shape)}")
    if x.device != weight.device:
        raise ValueError(f"x is on {x.device}, the weight on {weight.device}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    codes, x_scale = per_token_quant_fp8(x)
    num_rows = x.shape[0]
    if backend == "scaled_mm":
        if out is not None:
            raise ValueError("out is only taken by backend='triton'")
        if x.device.type == "cuda" and (n % 16 or k % 16 or x.dtype != torch.bfloat16):
            raise ValueError(
                f"torch._scaled_mm with row-wise scales needs N and K multiples of 16 and a "
                f"bfloat16 x on CUDA, got N={n}, K={k}, {x.dtype}; use backend='triton'"
            )
        return torch._scaled_mm(codes, weight.t(), scale_a=x_scale, scale_b=weight_scale.view(1, n),
                                out_dtype=x.dtype)  # fmt: skip
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    check_out("out", out, (num_rows, n), x.dtype, x.device)
    for name, value in (("block_m", block_m), ("block_n", block_n), ("block_k", block_k)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if num_rows == 0 or n == 0:
        return out
    _fp8_gemm_kernel[(cdiv(n, block_n), cdiv(num_rows, block_m))](
        codes, x_scale, weight, weight_scale, out, num_rows, n, K=k, BLOCK_M=block_m,
        BLOCK_N=block_n, BLOCK_K=block_k, UPCAST=runs_in_interpreter(x), num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out
