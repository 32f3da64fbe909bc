"""The sliced INT4 kernel behind `int4_matmul`'s `gemv` mode (1 to 4 rows of x).

A chunk of `8 * WORDS` layout columns is `WORDS` int32 words per weight row, loaded as one
`[BLOCK_N, WORDS]` tile of 16-byte vectors. Slice i of the chunk is nibble i of every word,
`(words >> 4 i) & 0xF`: the codes of layout columns `k0 + 8 w + i` (w = 0 .. WORDS - 1), still
`[BLOCK_N, WORDS]` in the words' own registers. Each slice meets the matching strided columns of
x (`[WORDS]`, gathered from cache: x is small, and its loads take the slice's layout directly)
and the eight slices together cover the chunk. Nothing is reshaped, joined or broadcast to a
third dimension, so the codes never move between registers, threads or shared memory (the
3-D formulation this replaced converted every slice through shared memory and read the weight
at a fifth of the rate). Per code that is a shift, a mask-and-or (one LOP3), an add and an FMA.

A code becomes a float by setting it as the low mantissa bits of 2^23, `(q | 0x4B000000)` read
as float32 = 2^23 + q exactly, so one add gives `q - 8` (symmetric weights) or `q` (with
offsets). A chunk's `q * x` are summed per word before the scale is applied (and the offset,
times the sum of x), once per row and word.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sitsd.kernels._int4_tile import as_float
from sitsd.kernels._pdl import pdl_enter


@triton.jit
def _group_params(s_ptr, o_ptr, offs_n, n_mask, offs_w, k0, N, K: tl.constexpr,
                  GROUP: tl.constexpr, WORDS: tl.constexpr, HAS_OFFSETS: tl.constexpr):  # fmt: skip
    """The chunk's scales (and offsets) in float32: `[BLOCK_N, 1]` when the chunk lies in one
    group, else `[BLOCK_N, WORDS]` (a word never straddles two groups)."""
    NUM_GROUPS: tl.constexpr = (K + GROUP - 1) // GROUP
    if 8 * WORDS <= GROUP:
        g = k0 // GROUP
        mask = n_mask & (g + 0 * offs_n < NUM_GROUPS)
        ptrs = g * N + offs_n
        scale = tl.load(s_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)[:, None]
        offset = scale
        if HAS_OFFSETS:
            offset = tl.load(o_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)[:, None]
    else:
        g = (k0 + 8 * offs_w) // GROUP  # [WORDS]
        mask = n_mask[:, None] & (g < NUM_GROUPS)[None, :]
        ptrs = g[None, :] * N + offs_n[:, None]
        scale = tl.load(s_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
        offset = scale
        if HAS_OFFSETS:
            offset = tl.load(o_ptr + ptrs, mask=mask, other=0.0).to(tl.float32)
    return scale, offset


@triton.jit
def _load_words(qw_ptr, offs_n, n_mask, offs_w, k0, K: tl.constexpr, EVEN: tl.constexpr):
    """The chunk's words, `[BLOCK_N, WORDS]` int32 (zero past N and K)."""
    words_at = k0 // 8 + offs_w
    ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 8) + words_at[None, :]
    if EVEN:
        return tl.load(ptrs)
    return tl.load(ptrs, mask=n_mask[:, None] & (words_at < K // 8)[None, :], other=0)


@triton.jit
def _slice_partial(part, words, i: tl.constexpr, x_row, cols, k_mask, HAS_PERM: tl.constexpr,
                   perm_ptr, HAS_OFFSETS: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """`part + q_i * x[cols]` for one row of x (`[BLOCK_N, WORDS]`), and x[cols] itself."""
    if HAS_PERM:
        if EVEN_K:
            cols = tl.load(perm_ptr + cols)
        else:
            cols = tl.load(perm_ptr + cols, mask=k_mask, other=0)
    if EVEN_K:
        x = tl.load(x_row + cols).to(tl.float32)
    else:
        x = tl.load(x_row + cols, mask=k_mask, other=0.0).to(tl.float32)
    codes = (words >> (4 * i)) & 0xF
    if HAS_OFFSETS:
        q = as_float(codes)  # q
    else:
        q = as_float(codes, 8.0)  # q - 8
    return part + q * x[None, :], x


@triton.jit(do_not_specialize=["M"])
def int4_gemv_kernel(
    x_ptr,
    qw_ptr,
    s_ptr,
    o_ptr,  # offsets, or any pointer without HAS_OFFSETS
    perm_ptr,  # act-order permutation, or any pointer without HAS_PERM
    out_ptr,  # [M, N] in x's dtype, or with SPLIT_K > 1 the float32 partials [SPLIT_K, M, N]
    M,
    N,
    stride_xm,
    K: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # rows of x per program, 1 to 4 (each its own 2-D accumulator)
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,  # words per row per chunk (chunks of 8 * WORDS columns)
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,  # K elements per split, a multiple of 8 * WORDS
    HAS_OFFSETS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides N and SPLIT_K * 8 * WORDS divides K: no weight masks
    EVEN_K: tl.constexpr,  # SPLIT_K * 8 * WORDS divides K
    PDL: tl.constexpr,
):
    """One `[BLOCK_N, WORDS]` float32 accumulator per row of x (see the module docstring)."""
    pdl_enter(PDL)
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row0 = tl.program_id(1) * ROWS
    split = tl.program_id(2)
    n_mask = offs_n < N
    offs_w = tl.arange(0, WORDS)
    # Rows past M read row 0 again (in bounds) and are not stored.
    x0 = x_ptr + row0.to(tl.int64) * stride_xm
    x1 = x_ptr + tl.where(row0 + 1 < M, row0 + 1, row0).to(tl.int64) * stride_xm
    x2 = x_ptr + tl.where(row0 + 2 < M, row0 + 2, row0).to(tl.int64) * stride_xm
    x3 = x_ptr + tl.where(row0 + 3 < M, row0 + 3, row0).to(tl.int64) * stride_xm
    acc0 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    acc1 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    acc2 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    acc3 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
    for k0 in range(split * K_SPLIT, split * K_SPLIT + K_SPLIT, 8 * WORDS):
        words = _load_words(qw_ptr, offs_n, n_mask, offs_w, k0, K, EVEN)
        scale, offset = _group_params(s_ptr, o_ptr, offs_n, n_mask, offs_w, k0, N, K, GROUP,
                                      WORDS, HAS_OFFSETS)  # fmt: skip
        p0 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        p1 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        p2 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        p3 = tl.zeros([BLOCK_N, WORDS], dtype=tl.float32)
        s0 = tl.zeros([WORDS], dtype=tl.float32)
        s1 = tl.zeros([WORDS], dtype=tl.float32)
        s2 = tl.zeros([WORDS], dtype=tl.float32)
        s3 = tl.zeros([WORDS], dtype=tl.float32)
        for i in tl.static_range(8):
            cols = k0 + 8 * offs_w + i
            k_mask = cols < K
            p0, x = _slice_partial(p0, words, i, x0, cols, k_mask, HAS_PERM, perm_ptr,
                                   HAS_OFFSETS, EVEN_K)  # fmt: skip
            s0 += x
            if ROWS > 1:
                p1, x = _slice_partial(p1, words, i, x1, cols, k_mask, HAS_PERM, perm_ptr,
                                       HAS_OFFSETS, EVEN_K)  # fmt: skip
                s1 += x
            if ROWS > 2:
                p2, x = _slice_partial(p2, words, i, x2, cols, k_mask, HAS_PERM, perm_ptr,
                                       HAS_OFFSETS, EVEN_K)  # fmt: skip
                s2 += x
            if ROWS > 3:
                p3, x = _slice_partial(p3, words, i, x3, cols, k_mask, HAS_PERM, perm_ptr,
                                       HAS_OFFSETS, EVEN_K)  # fmt: skip
                s3 += x
        if HAS_OFFSETS:
            acc0 += p0 * scale + offset * s0[None, :]
            acc1 += p1 * scale + offset * s1[None, :]
            acc2 += p2 * scale + offset * s2[None, :]
            acc3 += p3 * scale + offset * s3[None, :]
        else:
            acc0 += p0 * scale
            acc1 += p1 * scale
            acc2 += p2 * scale
            acc3 += p3 * scale
    out = out_ptr
    if SPLIT_K > 1:
        out = out_ptr + split * M * N
    _store_row(out, row0, M, N, offs_n, n_mask, tl.sum(acc0, axis=1))
    if ROWS > 1:
        _store_row(out, row0 + 1, M, N, offs_n, n_mask, tl.sum(acc1, axis=1))
    if ROWS > 2:
        _store_row(out, row0 + 2, M, N, offs_n, n_mask, tl.sum(acc2, axis=1))
    if ROWS > 3:
        _store_row(out, row0 + 3, M, N, offs_n, n_mask, tl.sum(acc3, axis=1))


@triton.jit
def _store_row(out_ptr, row, M, N, offs_n, n_mask, y):
    mask = n_mask & (row + 0 * offs_n < M)  # a block: the interpreter's & wants two
    tl.store(out_ptr + row * N + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask)
