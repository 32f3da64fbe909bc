"""Triton kernel: small-batch GEMV, `y = x @ weight.T` for decode's linear layers (M <= 64 rows).

At decode batch sizes a linear layer is one pass over its weight, so it is memory bound; the kernel
is built to read every weight byte once, at full bandwidth, in a single launch
(`reference.gemv_ref` defines the result):

* one program per `BLOCK_N` rows of `weight` (output columns); it streams those rows over K in
  `BLOCK_K` chunks once for all M rows of `x`, whose chunk is reloaded each step (a few KB that
  stay in L2);
* no split-K: the parallelism comes from many narrow programs (`BLOCK_N` is chosen so that
  `N / BLOCK_N` fills the SMs several times over), so there is no workspace, no atomics and no
  reduce launch;
* two ways to multiply a chunk (`use_dot`): `tl.dot` on the tensor cores (Triton pads the M rows
  to the MMA tile; the weight tile goes through shared memory, software-pipelined over
  `num_stages`), or FMAs into a `[BLOCK_M, BLOCK_N, BLOCK_K]` fp32 accumulator that is summed
  over K once after the loop, so no cross-thread reduction runs per chunk;
* `swiglu=True`: `x` holds the fused `[gate | up]` rows of width 2K and the kernel applies
  `silu(gate) * up` to each chunk as it loads it, rounded like `silu_and_mul_ref`, so the down
  projection needs no activation kernel and no `[M, K]` intermediate.

fp32 accumulation, output in `x`'s dtype. Whether a layer runs this kernel or cuBLAS is the model
runner's decision; `bench/bench_gemv.py` measures both.
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

__all__ = ["GemvConfig", "choose_gemv_config", "gemv"]

# Rows of x; past this a tiled GEMM (cuBLAS) is the right tool. Measured faster than cuBLAS up
# to 8 rows (bench/bench_gemv.py); 16-64 are allowed so the benchmark can measure them.
MAX_ROWS = 64


@dataclass(frozen=True)
class GemvConfig:
    """Launch configuration of one `gemv` call."""

    block_n: int = 8  # rows of weight (output columns) per program, a power of two
    block_k: int = 256  # K elements per chunk, a power of two >= 16
    num_warps: int = 4  # warps per program
    num_stages: int = 3  # software-pipelining depth of the chunk loads
    use_dot: bool = True  # tl.dot (tensor cores) rather than FMAs into a 3-D accumulator


@triton.jit
def _activation(x_ptrs, mask, K: tl.constexpr, SWIGLU: tl.constexpr):
    """One chunk of the activation rows: x itself, or silu(gate) * up from fused [gate | up]."""
    a = tl.load(x_ptrs, mask=mask, other=0.0)
    if SWIGLU:
        up = tl.load(x_ptrs + K, mask=mask, other=0.0)
        gate = a.to(tl.float32)
        # Round like silu_and_mul_ref: silu to x's dtype, then the product to x's dtype.
        silu = (gate / (1.0 + tl.exp(-gate))).to(a.dtype).to(tl.float32)
        a = (silu * up.to(tl.float32)).to(a.dtype)
    return a


@triton.jit
def _gemv_dot(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, stride_xm, K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN: tl.constexpr, SWIGLU: tl.constexpr, UPCAST: tl.constexpr):  # fmt: skip
    """`x @ w.T` for one program's rows of w, chunk by chunk on the tensor cores."""
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :]  # [BLOCK_M, BLOCK_K]
    w_ptrs = w_ptr + offs_n[:, None].to(tl.int64) * K + offs_k[None, :]  # [BLOCK_N, BLOCK_K]
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = k_start + offs_k < K
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None] & k_mask[None, :], other=0.0)
        a = _activation(x_ptrs, m_mask[:, None] & k_mask[None, :], K, SWIGLU)
        if UPCAST:
            a, w = a.to(tl.float32), w.to(tl.float32)
        acc = tl.dot(a, tl.trans(w), acc, input_precision="ieee")
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return acc  # [BLOCK_M, BLOCK_N]


@triton.jit
def _gemv_fma(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, stride_xm, K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
              EVEN: tl.constexpr, SWIGLU: tl.constexpr):  # fmt: skip
    """`x @ w.T` with FMAs into a 3-D accumulator, reduced over K once at the end.

    The tiles are 3-D from the load on, so the weight, activation and accumulator tiles share
    one register layout when BLOCK_K is a 16-byte vector per thread across the program's
    threads: no shuffles or shared-memory round trips inside the loop.
    """
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + offs_m[:, None, None] * stride_xm + offs_k[None, None, :]  # [BM, 1, BK]
    w_ptrs = w_ptr + offs_n[None, :, None].to(tl.int64) * K + offs_k[None, None, :]  # [1, BN, BK]
    acc = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    for k_start in range(0, K, BLOCK_K):
        k_mask = (k_start + offs_k < K)[None, None, :]
        if EVEN:
            w = tl.load(w_ptrs)
        else:
            w = tl.load(w_ptrs, mask=n_mask[None, :, None] & k_mask, other=0.0)
        a = _activation(x_ptrs, m_mask[:, None, None] & k_mask, K, SWIGLU)
        acc += a.to(tl.float32) * w.to(tl.float32)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    return tl.sum(acc, axis=2)  # [BLOCK_M, BLOCK_N]


# One compiled variant per (K, tile, flags): M changes with the batch (one variant serves every M
# of a BLOCK_M; Triton would otherwise specialize M == 1 and M == 16), and the layers of a model
# that share K (q/k/v, o, gate/up and lm_head in Llama) share variants whatever their N.
@triton.jit(do_not_specialize=["M"])
def _gemv_kernel(
    x_ptr,
    w_ptr,
    out_ptr,
    M,
    N,
    stride_xm,
    K: tl.constexpr,  # a constant: loops over K unroll, and x's up half sits at a known offset
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides N and BLOCK_K divides K: weight loads need no mask
    SWIGLU: tl.constexpr,  # x rows are [gate | up], 2K wide; multiply by silu(gate) * up
    USE_DOT: tl.constexpr,
    UPCAST: tl.constexpr,  # feed tl.dot fp32 (the interpreter's bf16 dot is wrong)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    offs_m = tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = offs_m < M
    n_mask = offs_n < N
    if USE_DOT:
        y = _gemv_dot(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, stride_xm, K,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN, SWIGLU, UPCAST)  # fmt: skip
    else:
        y = _gemv_fma(x_ptr, w_ptr, offs_m, offs_n, m_mask, n_mask, stride_xm, K,
                      BLOCK_M, BLOCK_N, BLOCK_K, EVEN, SWIGLU)  # fmt: skip
    out_ptrs = out_ptr + offs_m[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N]
    tl.store(out_ptrs, y.to(out_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


def choose_gemv_config(
    num_rows: int, n: int, k: int, dtype: torch.dtype, *, swiglu: bool = False, num_sms: int = 132
) -> GemvConfig:
    """The default launch configuration for `x [num_rows, k] @ weight[n, k].T`.

    The winners of `bench/bench_gemv.py`'s sweep on an H200 (bf16, Llama-3-8B shapes, inside
    CUDA graphs, 2026-11-30), which were the same for nearly every shape:

    * one row: FMAs (a padded MMA would waste 15/16 of it) into a 3-D accumulator, 4 weight
      rows per program, `block_k` = one 16-byte vector per thread of 4 warps (1024 bf16), the
      chunk width at which weight, activation and accumulator share a register layout; 1.11x
      cuBLAS on down, 1.34x on o (qkv and lm_head did best with 2048 and 8 warps: the caller
      may pass those);
    * more rows: `tl.dot` on 16 weight rows, 512-byte chunks, 2 warps, a 4-stage `cp.async`
      pipeline: 1.03-1.23x cuBLAS at 2-8 rows except on gate_up (0.98x).

    With `swiglu` and more than one row the fused prologue measured 2-5x slower than a separate
    `silu_and_mul`: callers should not fuse there (`sitsd.model.linear` does not).

    Args:
        num_rows: Rows of x (M).
        n: Output columns (rows of weight).
        k: Reduction length (columns of weight).
        dtype: The dtype of x and weight.
        swiglu: Whether x holds fused [gate | up] rows (same configuration).
        num_sms: Streaming multiprocessors of the device (unused: kept for callers that tune).
    """
    del swiglu, num_sms
    elem_bytes = torch.finfo(dtype).bits // 8
    if num_rows == 1:
        num_warps, block_n, stages, use_dot = 4, 4, 2, False
        block_k = 16 // elem_bytes * 32 * num_warps
    else:
        num_warps, block_n, stages, use_dot = 2, 16, 4, True
        block_k = 512 // elem_bytes
    block_k = max(16, min(block_k, next_power_of_2(k)))
    block_n = min(block_n, next_power_of_2(n))
    if use_dot:
        block_n = max(block_n, 8)  # the MMA's N granularity
    return GemvConfig(block_n, block_k, num_warps, stages, use_dot)


def gemv(
    x: torch.Tensor,  # [M, K], or [M, 2K] with swiglu
    weight: torch.Tensor,  # [N, K]
    *,
    swiglu: bool = False,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    use_dot: bool | None = None,
    pdl: bool = False,
) -> torch.Tensor:  # [M, N]
    """`x @ weight.T` for up to 64 rows of x, optionally on `silu_and_mul(x)` (see `gemv_ref`).

    Host-sync free and shape-deterministic (one launch, no allocation when `out` is given), so
    it can be captured in a CUDA graph. The launch options default to `choose_gemv_config`;
    each one given overrides its default.

    Args:
        x: Activations, fp32/fp16/bf16, last dimension contiguous; `[M, K]`, or with `swiglu`
            the fused `[gate | up]` rows `[M, 2K]`. M <= 64.
        weight: `[N, K]`, contiguous, `x`'s dtype (an `nn.Linear` weight).
        swiglu: Multiply by `silu(gate) * up` instead of x (keyword-only).
        out: Optional preallocated contiguous output, `[M, N]` in `x`'s dtype.
        block_n: Rows of weight per program (power of two).
        block_k: K elements per chunk (power of two >= 16).
        num_warps: Warps per program.
        num_stages: Software-pipelining depth of the chunk loads.
        use_dot: Multiply on the tensor cores (`tl.dot`) rather than with FMAs.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).

    Returns:
        `[M, N]` in `x`'s dtype (`out` when given).

    Raises:
        ValueError: Shapes, strides or devices that do not fit, or M > 64.
        TypeError: Unsupported or mismatched dtypes.
    """
    check_small_linear("gemv", x, weight, MAX_ROWS, swiglu=swiglu)
    num_rows = x.shape[0]
    n, k = weight.shape
    if out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    check_out("out", out, (num_rows, n), x.dtype, x.device)
    check_pdl(pdl, x)
    default = choose_gemv_config(num_rows, n, k, x.dtype, swiglu=swiglu, num_sms=num_sms(x.device))
    block_n = block_n or default.block_n
    block_k = block_k or default.block_k
    use_dot = default.use_dot if use_dot is None else use_dot
    if block_n < 1 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two, got {block_n}")
    if block_k < 16 or block_k & (block_k - 1):
        raise ValueError(f"block_k must be a power of two >= 16, got {block_k}")
    if num_rows == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()

    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
    upcast = runs_in_interpreter(x) and x.dtype == torch.bfloat16
    _gemv_kernel[(cdiv(n, block_n),)](
        x, weight, out, num_rows, n, x.stride(0),
        K=k, BLOCK_M=next_power_of_2(num_rows), BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN=n % block_n == 0 and k % block_k == 0, SWIGLU=swiglu, USE_DOT=use_dot, UPCAST=upcast,
        PDL=pdl, num_warps=num_warps or default.num_warps,
        num_stages=num_stages or default.num_stages, launch_pdl=pdl,
    )  # fmt: skip
    return out
