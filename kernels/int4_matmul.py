"""Triton kernel: W4A16 GEMM, `y = x @ W.T` with W an INT4 group-quantized weight, for 1 to a
few hundred rows of x (decode batches and prefill chunks).

W stays packed in memory (`sitsd.kernels.quant_layout`: int32 words of 8 codes along K, `[G, N]`
scales, optional offsets, optional act-order permutation); each program dequantizes the tiles it
needs in registers, in float32 (`q * scale + offset`, or `(q - 8) * scale`), and multiplies them
right away, so a decode step reads 4 bits per weight instead of 16 (`quant_reference.
int4_matmul_ref` defines the result). Four ways to multiply a tile (`mode`):

* `gemv`: 1 to 4 rows of x per program, the weight rows' words sliced by nibble
  (`_int4_sliced`): each slice's codes meet x's matching strided columns in the words' own
  registers, with no reshape; x is read once per word (its 8 columns in one load). A code set
  as mantissa bits under the exponent of 256.0 (or 16.0) reads as `256 + q` (`16 + q`) and is
  multiplied as it is; the biases come off once per word and chunk, from x's sums, with the
  scale and the offset. So a weight costs half a shift, a LOP3 and an FMA per row of x: 3.3-3.6
  instructions per code in the loop's SASS at 128 weight rows per program, 4.3-5.0 at 32
  (sm_90, `bench.sass_int4`; 5.3-7.3 before, with a shift, a bit-field extract, a LOP3, an add
  and an FMA). A float32 x keeps exact products (an add per code more). For decode batches of
  one or two, with split-K for enough programs to keep every SM streaming.
* `fma`: FMAs into a `[BLOCK_M, BLOCK_N, BLOCK_K]` float32 accumulator summed over K once after
  the loop: the 3-D formulation `gemv` replaced (kept as a second path for few rows; it
  converts every tile through shared memory and measures 1.3-2x slower).
* `dot_swapped`: `tl.dot(W_tile [BLOCK_N, BLOCK_K], x_tile^T [BLOCK_K, BLOCK_M])`, the weight rows
  on the MMA's M side (64 or 128 on Hopper's warp-group MMA) and the few rows of x on its N side
  (skinny_gemm's trick): for up to 64 rows.
* `dot`: `tl.dot(x_tile, W_tile^T)`, the tiled GEMM on the tensor cores, for prefill.
* `mma` (`_int4_mma`; 16-bit x, group size 128): the words of a group sliced by nibble into eight
  16-bit tiles `BIAS + q` by one inline-PTX LOP3 per code, straight in the MMA's register
  layout, each slice multiplied with x's matching strided columns on the tensor cores (weight
  rows on the M side), the group's scale and offset applied once per output element. About 2.7
  instructions per code in all on 128-row tiles (SASS of the loop, sm_90), where `gemv` takes
  3.3-5.0 and the dot modes 5-6.

Codes stored slice-major (`quant_layout`: groups of 128, how CUDA serves them; `slice_major=True`
with their `perm`) let `mma` take x as it is, with no reordering copy or permute, and `gemv`
read each slice's columns as one run; the other modes gather x through `perm`, as for any
act-order.

In both dot modes the dequantized tile is rounded to x's dtype before the MMA. With `split_k >
1` the programs along K write float32 partials `[split_k, M, N]` that a second small kernel sums
in a fixed order (deterministic) and rounds to x's dtype, or, given the caller's counters, the
last program of each tile to finish (`_split_merge`: one launch fewer, the same bits).
act-order (`perm`) gathers the columns of x as each chunk loads them, so the weight keeps
contiguous groups.

Whether a layer runs this kernel, or `int4_dequantize` + cuBLAS, and with which configuration, is
the model's decision; `choose_int4_config` gives defaults from the GPU benchmark
(`bench/bench_quant_kernels.py`). No mode reaches its memory floor yet: up to 32 rows `mma`
reads the weight at 25-38% of the copy bandwidth (`gemv` 20-38%, the other modes 12-20%),
where cuBLAS bf16 reaches 60-97%: every code cost instructions (about 2.5 in `mma`, 5-6 in
`gemv` when those figures were taken) near the SMs' issue rate at full bandwidth, and the
kernels run few warps per SM.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from sitsd.kernels._int4_mma import int4_mma_kernel
from sitsd.kernels._int4_sliced import MASKS, int4_gemv_kernel
from sitsd.kernels._int4_tile import dequant_tile
from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._split_merge import merge_splits
from sitsd.kernels._utils import (
    FLOAT_DTYPES,
    cdiv,
    check_contiguous,
    check_dtype,
    check_last_dim_contiguous,
    check_ndim,
    check_out,
    check_pdl,
    check_same_device,
    check_shape,
    next_power_of_2,
    num_sms,
    runs_in_interpreter,
)
from sitsd.kernels.quant_layout import SLICE_MAJOR_BLOCK, check_int4_layout, check_slice_major

__all__ = ["MODES", "Int4MatmulConfig", "choose_int4_config", "int4_matmul"]

MODES = ("fma", "dot_swapped", "dot", "gemv", "mma")
MMA_GROUP_SIZE = 128  # the one group size mode "mma" takes (a group is one 16-word MMA K)
MMA_MAX_SPLIT = 16  # the most parts `choose_int4_config` splits K into for mode "mma"
MMA_ORDER_X_ROWS = 64  # mode "mma" tiles of this many rows of x take it in slice-major order
# `choose_int4_config`'s mode "mma" loads x one group ahead (`Int4MatmulConfig.x_ahead`) up to
# this many rows; its 32-row tiles past them take x in the loop, and so does a large N from 33
MMA_X_AHEAD_ROWS = 16
# Registers per thread of an 8-warp `mma` tile that lets two programs share an SM's 64K: gate_up's
# 64 x 128 tile with zero points took 135 at split 1 (one program an SM, 12.5% occupancy: 122 us
# at 128 rows, ncu, an H100, session 34) and 128 capped, with no spills and 3 more instructions
MMA_WIDE_REGISTERS = 128
GEMV_MAX_ROWS = 2  # `choose_int4_config` picks mode "gemv" up to this many rows
_MODE_IDS = {mode: i for i, mode in enumerate(MODES)}
_SUM_BLOCK = 1024  # elements per program of the split-sum kernel


@dataclass(frozen=True)
class Int4MatmulConfig:
    """Launch configuration of one `int4_matmul` call."""

    mode: str = "dot"  # one of MODES
    # rows of x per program (power of two; >= 16 for the dot modes and mma; gemv <= 4)
    block_m: int = 16
    block_n: int = 64  # rows of W (output columns) per program, a power of two
    # K elements per chunk: a power of two >= 8 (>= 16 for the dot modes; mma: the group, 128)
    block_k: int = 64
    # programs along K; their partials are summed by a second kernel (or `split_counters`)
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 3  # software-pipelining depth of the chunk loads
    # mode mma: the scale multiplied into the 16-bit codes before the MMA (`_int4_mma` SCALED:
    # no float32 partial per group, one rounding more per weight, as a dequantized one has)
    scaled: bool = False
    # mode mma: x put in slice-major order by one copy before the kernel (True: fewer
    # instructions in the loop, one more kernel) or by each program as it loads a group
    # (False); None: a copy for tiles of `MMA_ORDER_X_ROWS` rows of x or more
    order_x: bool | None = None
    # mode mma: a group's x, scales and zero points loaded one group ahead into registers by the
    # kernel (True), or where the group uses them, x copied into shared memory asynchronously by
    # Triton's pipeliner, `num_stages` deep (False)
    x_ahead: bool = True
    # registers a thread may hold (ptxas's maxnreg), or None for the compiler's choice: a cap
    # where a few registers more would halve the programs an SM holds (`MMA_WIDE_REGISTERS`)
    max_registers: int | None = None


@triton.jit
def _load_x(x_ptr, perm_ptr, offs_m, m_mask, k0, stride_xm, K: tl.constexpr,
            BLOCK_K: tl.constexpr, HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """x at the chunk's layout columns (gathered through perm): [BLOCK_M, BLOCK_K]."""
    offs_k = k0 + tl.arange(0, BLOCK_K)
    cols = offs_k
    if EVEN_K:  # a mask constant along K: the loads stay 16-byte vectors
        mask = m_mask[:, None]  # broadcast by the load
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k)
    else:
        mask = m_mask[:, None] & (offs_k < K)[None, :]
        if HAS_PERM:
            cols = tl.load(perm_ptr + offs_k, mask=offs_k < K, other=0)
    ptrs = x_ptr + offs_m[:, None] * stride_xm + cols[None, :]
    return tl.load(ptrs, mask=mask, other=0.0)


# One compiled variant per (K, group, tile, flags): M changes with the batch, and layers that
# share K share variants whatever their N.
@triton.jit(do_not_specialize=["M"])
def _int4_matmul_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,  # offsets, or any pointer without HAS_OFFSETS
    perm_ptr,  # act-order permutation, or any pointer without HAS_PERM
    out_ptr,  # [M, N] in x's dtype, or with SPLIT_K > 1 the float32 partials [SPLIT_K, M, N]
    merged_ptr,  # MERGE: the [M, N] output in x's dtype (any pointer otherwise)
    counters_ptr,  # MERGE: int32 zeros, one per tile (left zero)
    M,
    N,
    stride_xm,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,  # K elements per split, a multiple of BLOCK_K
    MODE: tl.constexpr,  # 0 fma, 1 dot_swapped, 2 dot
    HAS_OFFSETS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides N and SPLIT_K * BLOCK_K divides K: no weight masks
    EVEN_K: tl.constexpr,  # SPLIT_K * BLOCK_K divides K: no K mask on x
    UPCAST: tl.constexpr,  # feed tl.dot float32 (the interpreter's bf16 dot is wrong)
    MERGE: tl.constexpr,  # SPLIT_K > 1: the tile's last program sums the partials (`_split_merge`)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if MODE == 0:
        acc3 = tl.zeros([BLOCK_M, BLOCK_N, BLOCK_K], dtype=tl.float32)
    elif MODE == 1:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(split * K_SPLIT, split * K_SPLIT + K_SPLIT, BLOCK_K):
        w = dequant_tile(qw_ptr, s_ptr, o_ptr, offs_n, n_mask, k0, N, K, GROUP,
                         BLOCK_N, BLOCK_K, HAS_OFFSETS, EVEN)  # fmt: skip
        a = _load_x(x_ptr, perm_ptr, offs_m, m_mask, k0, stride_xm, K, BLOCK_K, HAS_PERM, EVEN_K)
        if MODE == 0:
            acc3 += a.to(tl.float32)[:, None, :] * w[None, :, :]
        elif UPCAST:
            if MODE == 1:
                acc = tl.dot(w, tl.trans(a.to(tl.float32)), acc, input_precision="ieee")
            else:
                acc = tl.dot(a.to(tl.float32), tl.trans(w), acc, input_precision="ieee")
        elif MODE == 1:
            acc = tl.dot(w.to(a.dtype), tl.trans(a), acc, input_precision="ieee")
        else:
            acc = tl.dot(a, tl.trans(w.to(a.dtype)), acc, input_precision="ieee")
    if MODE == 0:
        y = tl.sum(acc3, axis=2)  # [BLOCK_M, BLOCK_N]
    elif MODE == 1:
        y = tl.trans(acc)
    else:
        y = acc
    offs = offs_m[:, None] * N + offs_n[None, :]  # [BLOCK_M, BLOCK_N] into row-major [M, N]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split * M * N + offs, y, mask=mask)
        if MERGE:
            merge_splits(out_ptr, merged_ptr, counters_ptr, offs, mask, M, N, SPLIT_K)


@triton.jit
def _split_sum_kernel(part_ptr, out_ptr, size, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr,
                      PDL: tl.constexpr):  # fmt: skip
    pdl_enter(PDL)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < size
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for split in tl.static_range(SPLIT_K):  # a fixed order: the same bits every time
        acc += tl.load(part_ptr + split * size + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_int4_config(
    num_rows: int,
    n: int,
    k: int,
    group_size: int,
    *,
    num_sms: int = 132,
    has_offsets: bool = False,
    has_zeros: bool = False,
    dtype: torch.dtype = torch.bfloat16,
) -> Int4MatmulConfig:
    """A default configuration for `x [num_rows, k] @ W[n, k].T` (x in `dtype`), from an H100's
    figures (`bench/bench_quant_kernels.py` of 2026-12-06, Llama-3-8B's layers, groups of 128;
    `bench/results/quant-kernels-h100.txt`).

    One or two rows: `gemv`, split along K into up to 8 parts (a power of two, into whole
    chunks). Without offsets, 128 weight rows per program and 4 warps (qkv 10.6, o 9.0 us
    against `mma`'s 12.4, 10.5), or for a large N (gate_up) 32 rows, 2 warps and no loads
    ahead (34.3 against 38.3 us with them, 36.6 on 128 rows), or for a long K (down) 64 rows,
    2 warps and 256-column chunks (17.4 against 20.0 us on 128 rows and 128-column chunks,
    the H100 sweep of session 22; 255 registers, no spills); with offsets 64 rows and 2 warps
    (qkv 10.9, o 9.2, gate_up 36.8, down 20.2 us against `mma`'s 12.1, 10.7, 40.8 and 24.4;
    256-column chunks spill there: 62.1 us for gate_up). Two rows of x take 64 weight rows
    (registers).

    Groups of 128 and 16-bit x, from 3 rows: `mma`, on 64 weight rows per program, or 128
    with offsets that need x's sums (GGUF's minima), and with integer zero points on a layer
    as small as o (4096 x 4096). Zero points took 128 rows everywhere until the kernel loaded
    them where each group unpacks on 64-row tiles (`_int4_mma`, session 32): then, at 8 rows,
    qkv 12.9 us on 64 against 13.4 on 128, gate_up 36.7 against 43.2, down 22.7 against 23.2,
    but o 11.9 against 9.5; at 128 rows qkv 25.1 against 29.8 (`bench.probe_int4_zeros`, an
    H100). Up to 32 rows all rows of x in one tile, K split into parts of about 8 groups (4
    for K = 4096, 8 for down's 14336: down at 8 rows 21.4 us against 26.5 split in 4), and
    further until the grid has a program per SM; but a large N with x in the loop (gate_up
    from 17 rows) is not split (with offsets that need x's sums past 32 rows it is, in two):
    its tiles fill the SMs, and a second kernel summing the parts reads them back (gate_up at
    32 rows 38.0 us against 44.9 split in four, with uint8 zero points 46.6 against 50.3; at 128
    rows 82.3 against 93.5 split in two, `bench.probe_int4_split`, an H100, session 33). Its
    8-warp tile is capped at `MMA_WIDE_REGISTERS`, so that two programs share an SM: with
    zero points, unsplit, it took 135 registers, one program an SM, and 121.0 us at 128 rows
    (split in two 106.0); capped 80.1 (symmetric 82.8; at 64 rows 44.1 against 57.9 split,
    session 34). Offsets with sums take 173 registers and would spill under the cap. From 33
    rows tiles of 64 rows of x (128 for a large N without offsets), split in two (at 128 rows
    qkv 26.8, o 20.8,
    gate_up 108, down 60.2 us, against `dot`'s 54.2, 35.1, 193 and 94.8 and dequantize +
    cuBLAS's 45.8, 28.5, 210 and 112); from 65 rows a long K without offsets (down's 14336)
    takes 128-row tiles split in four (down at 128 rows 51.2 us against 61.3, the sweep of
    the second H100 run; o's 20.0 against 21.1 was within noise, qkv's default won). The
    same tiles from 256 rows, where the model runs `int4_matmul` below
    `sitsd.model.qlinear.INT4_DEQUANT_FROM_ROWS` (512) and without the dequantize's workspace
    (a version swapped into a slot of a 16-bit model): the four layers at 256 rows 386 us
    (with zero points 421) against `dot`'s 622 (894), at 512 rows 770 (808) against 1121
    (1580); the sweep's best tile per layer is faster for o at 256 rows (32.1 against 41.0
    us), within 6% for the others, and at 512 rows by up to 18% (o 56.6 against 66.6, down
    184 against 206).

    x in the loop (`x_ahead=False`: Triton's pipeliner copies x into shared memory instead of
    each program loading it a group ahead into registers), from an H100 sweep of session 30
    (`bench/results/quant-kernels-h100.txt` run 7): on 32-row tiles (17-32 rows), where a
    group's x tile is twice its codes', with 64 weight rows also with zero points and K split
    until the grid has two programs per SM: at 32 rows qkv 12.5 us against 13.0, o 10.8
    against 11.7, gate_up 44.9 against 46.1, down 23.3 against 23.5; with zero points 14.5
    against 15.3, 12.0 against 11.7, 50.2 against 59.0, 26.2 against 27.3. From 33 rows a large
    N (gate_up) takes 64 x 128 tiles on 8 warps, x in the loop (both then split in two): at 128
    rows 92.8 against 106.9 us, with zero points 111.3 against 122.4. The other layers past 32
    rows keep x ahead: the sweep had no winner there that held across layers and formats (down with
    zero points 62.9 us in the loop against 51.2).

    Otherwise (other group sizes, float32 x), from 3 rows: up to 64 rows `dot_swapped` on 64
    weight rows, 128-wide chunks; more: `dot` on 64 x 128 (128 x 128 past 128 rows) tiles,
    64-wide chunks. The dot modes split K (a power of two, at most 8, into whole chunks) until
    the grid has two programs per SM.
    """
    k_pow2 = next_power_of_2(k)
    large_n = n >= 16384
    if num_rows <= GEMV_MAX_ROWS:
        block_k = 128
        if has_offsets:
            block_n, num_warps, num_stages = 64, 2, 3
        elif large_n:
            block_n, num_warps, num_stages = 32, 2, 1
        elif num_rows == 1 and k >= 8192:
            block_n, block_k, num_warps, num_stages = 64, 256, 2, 3
        else:
            block_n, num_warps, num_stages = (128, 4, 3) if num_rows == 1 else (64, 2, 3)
        split_k = 1
        while split_k < 8 and k % (2 * split_k * block_k) == 0:
            split_k *= 2
        return Int4MatmulConfig("gemv", max(1, num_rows), block_n, block_k, split_k, num_warps,
                                num_stages)  # fmt: skip
    mma = group_size == MMA_GROUP_SIZE and dtype in (torch.float16, torch.bfloat16)
    if mma:
        groups = cdiv(k, MMA_GROUP_SIZE)
        # offsets that need x's sums (GGUF's minima) take 128 weight rows, and so do zero
        # points on a layer as small as o (4096 x 4096)
        sums = has_offsets and not has_zeros
        wide = sums or (has_zeros and n * k <= 4096 * 4096)
        block_n, num_warps = (128 if wide else 64), 4
        x_ahead = num_rows <= MMA_X_AHEAD_ROWS or (num_rows > 32 and not large_n)
        if num_rows <= 32:
            block_m, split_k = max(16, next_power_of_2(num_rows)), 1
            # parts of about 8 groups; a large N with x in the loop fills the SMs unsplit
            while ((x_ahead or not large_n) and 2 * split_k * 8 <= groups
                   and split_k < MMA_MAX_SPLIT):  # fmt: skip
                split_k *= 2
            if not x_ahead:
                block_n = 64  # zero points too, with x in the loop
        elif large_n:
            # unsplit, two programs an SM (`MMA_WIDE_REGISTERS`); offsets with x's sums take
            # 173 registers, spill under that cap, and split in two
            block_m, block_n, num_warps = 64, 128, 8
            split_k = 2 if sums else 1
        elif num_rows > 64 and k >= 8192 and not sums:
            block_m, split_k = 128, 4  # a long K (down's): 128-row tiles in four parts
        else:
            block_m, split_k = 64, 2
        tiles = cdiv(n, block_n) * cdiv(num_rows, block_m)
        # a program per SM (two with x in the loop on 32-row tiles), each keeping a group
        least = num_sms * (2 if num_rows <= 32 and not x_ahead else 1)
        while tiles * split_k < least and split_k < MMA_MAX_SPLIT and 2 * split_k <= groups:
            split_k *= 2
        while split_k > 1 and split_k > groups:
            split_k //= 2
        cap = MMA_WIDE_REGISTERS if num_warps == 8 and not sums else None
        return Int4MatmulConfig("mma", block_m, block_n, MMA_GROUP_SIZE, split_k, num_warps,
                                x_ahead=x_ahead, max_registers=cap)  # fmt: skip
    if num_rows <= 64:
        config = Int4MatmulConfig("dot_swapped", max(16, next_power_of_2(num_rows)), 64,
                                  max(16, min(128, k_pow2)))  # fmt: skip
    elif num_rows <= 128:
        config = Int4MatmulConfig("dot", 64, 128, max(16, min(64, k_pow2)))
    else:
        config = Int4MatmulConfig("dot", 128, 128, max(16, min(64, k_pow2)), num_warps=8)
    tiles = cdiv(n, config.block_n) * cdiv(num_rows, config.block_m)
    split_k = 1
    while tiles * split_k < 2 * num_sms and split_k < 8 and k % (2 * split_k * config.block_k) == 0:
        split_k *= 2
    return Int4MatmulConfig(config.mode, config.block_m, config.block_n, config.block_k, split_k,
                            config.num_warps, config.num_stages)  # fmt: skip


def slice_major_x(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:  # [M, KP]
    """x's columns as mode "mma" multiplies them: through act-order's `perm`, zero-padded to
    whole groups of 128, and within each group column `8 w + i` at index `16 i + w` (the order
    of its weight slices: `_int4_mma`). A copy: one to three kernels, graph-capturable."""
    if perm is not None:
        x = x.index_select(1, perm)
    m, k = x.shape
    padded = cdiv(k, MMA_GROUP_SIZE) * MMA_GROUP_SIZE
    if padded != k:
        x = torch.nn.functional.pad(x, (0, padded - k))
    words = MMA_GROUP_SIZE // 8
    return x.reshape(m, padded // MMA_GROUP_SIZE, words, 8).transpose(2, 3).reshape(m, padded)


def _check_config(config: Int4MatmulConfig) -> None:
    if config.mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {config.mode!r}")
    dot = config.mode in ("dot", "dot_swapped", "mma")  # tl.dot needs every side >= 16
    if config.mode == "mma" and config.block_k != MMA_GROUP_SIZE:
        raise ValueError(f"block_k must be {MMA_GROUP_SIZE} (the group) in mode 'mma', got "
                         f"{config.block_k}")  # fmt: skip
    least = {"block_m": 16 if dot else 1, "block_n": 16 if dot else 1, "block_k": 16 if dot else 8}
    if config.mode == "gemv" and config.block_m > 4:
        raise ValueError(f"block_m must be at most 4 in mode 'gemv' (an accumulator per row), "
                         f"got {config.block_m}")  # fmt: skip
    for name, minimum in least.items():
        value = getattr(config, name)
        if value < minimum or value & (value - 1):
            raise ValueError(
                f"{name} must be a power of two >= {minimum} in mode {config.mode!r}, got {value}"
            )
    if config.split_k < 1 or config.split_k & (config.split_k - 1):
        raise ValueError(f"split_k must be a power of two, got {config.split_k}")
    if config.scaled and config.mode != "mma":
        raise ValueError(f"scaled applies to mode 'mma' only, got mode {config.mode!r}")
    if config.order_x is not None and config.mode != "mma":
        raise ValueError(f"order_x applies to mode 'mma' only, got mode {config.mode!r}")
    if not config.x_ahead and config.mode != "mma":
        raise ValueError(f"x_ahead applies to mode 'mma' only, got mode {config.mode!r}")
    if config.max_registers is not None and not 32 <= config.max_registers <= 255:
        raise ValueError(f"max_registers must be 32 to 255 (or None), got {config.max_registers}")


def int4_matmul(
    x: torch.Tensor,  # [M, K]
    qweight: torch.Tensor,  # [N, K // 8] int32
    scales: torch.Tensor,  # [G, N]
    offsets: torch.Tensor | None,  # [G, N]
    group_size: int,
    perm: torch.Tensor | None = None,  # [K] int32
    *,
    config: Int4MatmulConfig | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    zeros: torch.Tensor | None = None,  # [G, N] int32
    split_counters: torch.Tensor | None = None,  # [>= tiles] int32 zeros
    slice_major: bool = False,
    unsummed: bool = False,
) -> torch.Tensor:  # [M, N], or unsummed [split_k, M, N] float32
    """`x @ W.T` for an INT4 weight in `sitsd.kernels.quant_layout` (see `int4_matmul_ref`).

    Host-sync free and shape-deterministic (split-K partials come from torch's caching
    allocator), so it can be captured in a CUDA graph.

    Args:
        x: Activations, fp32/fp16/bf16, last dimension contiguous, `[M, K]`.
        qweight: `[N, K // 8]` int32 codes.
        scales: `[ceil(K / group_size), N]`, float16/bfloat16/float32.
        offsets: Same shape and dtypes as scales, or None (symmetric: zero point 8).
        group_size: 32, 64 or 128.
        perm: act-order permutation `[K]` int32, or None.
        config: Launch configuration; `choose_int4_config` by default.
        out: Optional preallocated contiguous output, `[M, N]` in x's dtype.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).
        zeros: The integer zero points, `[G, N]` int32 in 0..127 with `offsets == -zeros *
            scales` exactly (`sitsd.quant.layout.mark_integer_zeros` finds them), or None.
            Mode `mma` then subtracts them from the codes as it unpacks them instead of summing
            x per group; the other modes read the offsets. Values are not checked (a host sync).
        split_counters: int32 zeros, contiguous, on x's device, at least one per output tile
            (`cdiv(N, block_n) * cdiv(M, block_m)`; `cdiv(N, 16) * cdiv(M, 16)` covers every
            default configuration): with split-K the last program of each tile sums the partials
            (`_split_merge`, the same bits) instead of a second kernel, and zeroes its counter
            again. The caller owns them; two launches must not use them at once (one stream).
        slice_major: The codes are slice-major (`quant_layout.to_slice_major`) and `perm` is
            `slice_major_perm(K)` (not checked: a host sync); groups of 128. Modes `mma` and
            `gemv` (on chunks of whole groups) then read x in order; the others gather it
            through `perm` as for any act-order.
        unsummed: With split-K not merged in the kernel, return the float32 partials `[split_k,
            M, N]` and leave their sum (in split order, then rounded to x's dtype) to the
            consumer (`rmsnorm.fused_add_rms_norm` takes them), instead of a second kernel.
            Not with `out`.

    Returns:
        `[M, N]` in x's dtype (`out` when given), or with `unsummed` and split partials those.

    Raises:
        ValueError: Shapes, strides, devices or configurations that do not fit.
        TypeError: Unsupported dtypes.
    """
    n, k = check_int4_layout(qweight, scales, offsets, group_size, perm)
    if zeros is not None:
        check_dtype("zeros", zeros, (torch.int32,))
        check_shape("zeros", zeros, tuple(scales.shape), "[ceil(K / group_size), N]")
        if offsets is None or not zeros.is_contiguous() or zeros.device != qweight.device:
            raise ValueError("zeros must be contiguous, on the weight's device, beside offsets")
    check_ndim("x", x, 2, "[M, K]")
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    if x.shape[1] != k:
        raise ValueError(f"x must have shape [M, K] with K = {k} (qweight's), got {tuple(x.shape)}")
    if x.device != qweight.device:
        raise ValueError(f"x is on {x.device}, the weight on {qweight.device}")
    num_rows = x.shape[0]
    if unsummed and out is not None:
        raise ValueError("out and unsummed exclude each other (unsummed partials are new)")
    if out is not None:
        check_out("out", out, (num_rows, n), x.dtype, x.device)
    check_pdl(pdl, x)
    if slice_major:
        check_slice_major(perm, group_size)
    config = config or choose_int4_config(
        num_rows,
        n,
        k,
        group_size,
        num_sms=num_sms(x.device),
        has_offsets=offsets is not None,
        has_zeros=zeros is not None,
        dtype=x.dtype,
    )
    _check_config(config)
    if config.mode == "mma" and (group_size != MMA_GROUP_SIZE or x.dtype == torch.float32):
        raise ValueError(f"mode 'mma' takes group size {MMA_GROUP_SIZE} and float16 or bfloat16 "
                         f"x, got group size {group_size} and {x.dtype}")  # fmt: skip
    grid = (cdiv(n, config.block_n), cdiv(num_rows, config.block_m), config.split_k)
    merge = split_counters is not None and config.split_k > 1
    if split_counters is not None:
        check_dtype("split_counters", split_counters, (torch.int32,))
        check_contiguous("split_counters", split_counters)
        check_same_device(x=x, split_counters=split_counters)
        if merge and split_counters.numel() < grid[0] * grid[1]:
            raise ValueError(f"split_counters holds {split_counters.numel()} counters; "
                             f"{grid[0]} x {grid[1]} tiles need {grid[0] * grid[1]}")  # fmt: skip
    parts = None  # the float32 split partials, when K is split
    if config.split_k > 1:
        parts = torch.empty((config.split_k, num_rows, n), dtype=torch.float32, device=x.device)
    if unsummed and parts is not None and not merge:
        out = parts  # the result: no [M, N] output (below, only an unused pointer)
    elif out is None:
        out = torch.empty((num_rows, n), dtype=x.dtype, device=x.device)
    if num_rows == 0 or n == 0:
        return out
    counters = split_counters if merge else out  # any pointer without MERGE
    k_split = cdiv(cdiv(k, config.split_k), config.block_k) * config.block_k
    even_k = k % (config.split_k * config.block_k) == 0
    even = even_k and n % config.block_n == 0
    target = out if parts is None else parts
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
    upcast = runs_in_interpreter(x) and x.dtype == torch.bfloat16
    if config.mode == "mma":
        # Tiles of 64 rows or more take x put in slice-major order once (one more kernel)
        # rather than by every program that reads it (N / block_n of them): 25-33% fewer
        # instructions in the loop at 64-128 rows (`bench.sass_int4`, triton 3.6).
        # Slice-major codes take x as it is, already in their order.
        ordered = config.order_x
        if ordered is None:
            ordered = config.block_m >= MMA_ORDER_X_ROWS
        ordered = ordered or slice_major
        xk = slice_major_x(x, perm) if ordered and not slice_major else x
        int4_mma_kernel[grid](
            xk, qweight, scales, scales if offsets is None else offsets,
            qweight if zeros is None else zeros, qweight if perm is None else perm, target,
            out, counters, num_rows, n, xk.stride(0),
            K=k, BLOCK_M=config.block_m, BLOCK_N=config.block_n, SPLIT_K=config.split_k,
            K_SPLIT=k_split, HAS_OFFSETS=offsets is not None, HAS_ZEROS=zeros is not None,
            HAS_PERM=perm is not None and not slice_major,
            EVEN=even, EVEN_K=even_k, ASM=not runs_in_interpreter(x), X_ORDERED=ordered,
            KX=xk.shape[1], MERGE=merge, SCALED=config.scaled, X_AHEAD=config.x_ahead,
            PDL=pdl,
            num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
            maxnreg=config.max_registers,
        )  # fmt: skip
    elif config.mode == "gemv":
        # Slice-major codes in chunks of whole blocks: x's slices are runs of columns.
        sliced = slice_major and config.block_k % SLICE_MAJOR_BLOCK == 0
        int4_gemv_kernel[grid](
            x, qweight, scales, scales if offsets is None else offsets,
            qweight if perm is None else perm, target, out, counters, num_rows, n, x.stride(0),
            *MASKS,
            K=k, GROUP=group_size, ROWS=config.block_m, BLOCK_N=config.block_n,
            WORDS=config.block_k // 8, SPLIT_K=config.split_k, K_SPLIT=k_split,
            HAS_OFFSETS=offsets is not None, HAS_PERM=perm is not None and not sliced,
            SLICED=sliced, EVEN=even,
            EVEN_K=even_k, PREFETCH=config.num_stages > 1, MERGE=merge, PDL=pdl,
            num_warps=config.num_warps,
            num_stages=config.num_stages, launch_pdl=pdl, maxnreg=config.max_registers,
        )  # fmt: skip
    else:
        _int4_matmul_kernel[grid](
            x, qweight, scales, scales if offsets is None else offsets,
            qweight if perm is None else perm, target, out, counters, num_rows, n, x.stride(0),
            K=k, GROUP=group_size, BLOCK_M=config.block_m, BLOCK_N=config.block_n,
            BLOCK_K=config.block_k, SPLIT_K=config.split_k, K_SPLIT=k_split,
            MODE=_MODE_IDS[config.mode], HAS_OFFSETS=offsets is not None,
            HAS_PERM=perm is not None, EVEN=even, EVEN_K=even_k, UPCAST=upcast, MERGE=merge,
            PDL=pdl, num_warps=config.num_warps, num_stages=config.num_stages, launch_pdl=pdl,
            maxnreg=config.max_registers,
        )  # fmt: skip
    if config.split_k > 1 and not merge and not unsummed:
        size = num_rows * n
        _split_sum_kernel[(cdiv(size, _SUM_BLOCK),)](
            target, out, size, SPLIT_K=config.split_k, BLOCK=_SUM_BLOCK, PDL=pdl, num_warps=4,
            launch_pdl=pdl,
        )  # fmt: skip
    return out
