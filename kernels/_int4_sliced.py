"""The sliced INT4 kernel behind `int4_matmul`'s `gemv` mode (1 to 4 rows of x).

A chunk of `8 * WORDS` layout columns is `WORDS` int32 words per weight row, loaded as one
`[BLOCK_N, WORDS]` tile of 16-byte vectors. Slice i of the chunk is nibble i of every word: the
codes of layout columns `k0 + 8 w + i` (w = 0 .. WORDS - 1), still `[BLOCK_N, WORDS]` in the
words' own registers. Each slice meets the matching strided columns of x, and the eight slices
together cover the chunk. Nothing is reshaped, joined or broadcast to a third dimension, so the
codes never move between registers, threads or shared memory (the 3-D formulation this replaced
converted every slice through shared memory and read the weight at a fifth of the rate).

A chunk's words and scales are loaded one chunk ahead (`PREFETCH`, the configuration's
`num_stages > 1`), in flight while the chunk before computes: Triton's pipeliner leaves loads
that feed no `tl.dot` where they are.

x is read once per word and chunk: its eight columns `k0 + 8 w .. k0 + 8 w + 7` as one
`[WORDS, 8]` tile, split into the slices' columns (passed to the words' layout through shared
memory once per chunk), not one gathered 2-byte load per slice and word. With codes stored
slice-major (SLICED) slice i of word `16 b + v` multiplies column `k0 + 128 b + 16 i + v`: each
slice's columns are runs, loaded as eight vectors straight in the words' layout (80-128
registers at 32-64 weight rows against 128-168, the same instructions; on an H100 the four
layers at one row 5-6% slower, at two rows as fast or faster: `bench/results/slice-major-h100.txt`).

A code becomes a float without a conversion or a subtraction: one shift brings nibbles 2j and
2j + 1 of a word to bits 15-18 and 19-22, and one AND-OR each sets them as mantissa bits under
the exponent of 256.0 and of 16.0, which read as `256 + q` and `16 + q` exactly. So a weight
costs half a shift, a LOP3 and an FMA per row of x. The biases (with a symmetric weight's
centre, 8) come off once per word and chunk: `sum_i (B_i + q_i) x_i - sum_i (B_i + 8) x_i`,
the second sum from x alone. A product of `256 + q` keeps 2^-16 of |x| (8 bits fewer than one
of `q`): far below a 16-bit x's own rounding, so a float32 x subtracts the bias from each code
instead (an add per code, exact products). The scale is applied per row and word after the
sum; an offset, times the sum of x, likewise.
"""

from __future__ import annotations

import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._split_merge import merge_splits

# Bits 15-18 under 256.0's exponent read as 256 + q; bits 19-22 under 16.0's as 16 + q.
_LO_BIAS = tl.constexpr(256.0)
_LO_BITS = tl.constexpr(0x43800000)  # 256.0
_HI_BIAS = tl.constexpr(16.0)
_HI_BITS = tl.constexpr(0x41800000)  # 16.0
# The masks of those bits travel as kernel arguments (`int4_gemv_kernel`'s lo_mask, hi_mask):
# a LOP3 takes one immediate, and with both constants immediates ptxas sets the other with a
# MOV before every use (sm_90 SASS, triton 3.9: 4.0 instructions per code instead of 3.4 on
# 128 weight rows, 5.0 instead of 4.3 on 32).
MASKS = (0x00078000, 0x00780000)


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
def _x_sliced(x_row, k0, offs_w, K: tl.constexpr, WORDS: tl.constexpr, EVEN_K: tl.constexpr):
    """`_x_slices` for codes stored slice-major (`quant_layout.SLICE_MAJOR_BLOCK`): slice i of
    word w multiplies column `k0 + 128 b + 16 i + v` (w = 16 b + v), so each slice's columns are
    runs of 16 consecutive ones: eight loads in the words' own layout, nothing to split."""
    base = k0 + (offs_w // 16) * 128 + (offs_w % 16)  # [WORDS]
    x0 = _x_run(x_row, base, K, EVEN_K)
    x1 = _x_run(x_row, base + 16, K, EVEN_K)
    x2 = _x_run(x_row, base + 32, K, EVEN_K)
    x3 = _x_run(x_row, base + 48, K, EVEN_K)
    x4 = _x_run(x_row, base + 64, K, EVEN_K)
    x5 = _x_run(x_row, base + 80, K, EVEN_K)
    x6 = _x_run(x_row, base + 96, K, EVEN_K)
    x7 = _x_run(x_row, base + 112, K, EVEN_K)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _x_run(x_row, cols, K: tl.constexpr, EVEN_K: tl.constexpr):
    if EVEN_K:
        return tl.load(x_row + cols).to(tl.float32)
    return tl.load(x_row + cols, mask=cols < K, other=0.0).to(tl.float32)


@triton.jit
def _x_slices(x_row, k0, offs_w, K: tl.constexpr, WORDS: tl.constexpr, HAS_PERM: tl.constexpr,
              perm_ptr, EVEN_K: tl.constexpr, SLICED: tl.constexpr):  # fmt: skip
    """x's columns under the chunk's words, `[WORDS]` float32 per slice (zero past K): one
    `[WORDS, 8]` load (8 consecutive columns per word), split into the slices; with SLICED
    (slice-major codes) each slice's run of columns (`_x_sliced`)."""
    if SLICED:
        return _x_sliced(x_row, k0, offs_w, K, WORDS, EVEN_K)
    cols = k0 + 8 * offs_w[:, None] + tl.arange(0, 8)[None, :]  # [WORDS, 8]
    k_mask = cols < K
    if HAS_PERM:
        if EVEN_K:
            cols = tl.load(perm_ptr + cols)
        else:
            cols = tl.load(perm_ptr + cols, mask=k_mask, other=0)
    if EVEN_K:
        x = tl.load(x_row + cols).to(tl.float32)
    else:
        x = tl.load(x_row + cols, mask=k_mask, other=0.0).to(tl.float32)
    # Column 8 w + i, i = 4 a + 2 b + c: split c, then b, then a.
    even, odd = tl.split(tl.reshape(x, [WORDS, 4, 2]))  # i = 2 j, 2 j + 1 (j = 2 a + b)
    e_lo, e_hi = tl.split(tl.reshape(even, [WORDS, 2, 2]))  # j even, odd
    o_lo, o_hi = tl.split(tl.reshape(odd, [WORDS, 2, 2]))
    x0, x4 = tl.split(e_lo)
    x2, x6 = tl.split(e_hi)
    x1, x5 = tl.split(o_lo)
    x3, x7 = tl.split(o_hi)
    return x0, x1, x2, x3, x4, x5, x6, x7


@triton.jit
def _biased_pair(words, j: tl.constexpr, lo_mask, hi_mask, EXACT: tl.constexpr,
                 CENTRE: tl.constexpr):  # fmt: skip
    """Nibbles 2j and 2j + 1 of every word as float32 `256 + q` and `16 + q` (the module
    docstring): one shift, one AND-OR each (`MASKS`). With EXACT, `q - CENTRE` (an add each)."""
    SHIFT: tl.constexpr = 15 - 8 * j  # nibble 2j to bit 15
    if SHIFT >= 0:
        t = words << SHIFT
    else:
        t = words >> (-SHIFT)  # arithmetic: the sign lands above bit 22, outside both masks
    lo = ((t & lo_mask) | _LO_BITS).to(tl.float32, bitcast=True)
    hi = ((t & hi_mask) | _HI_BITS).to(tl.float32, bitcast=True)
    if EXACT:
        return lo - (_LO_BIAS + CENTRE), hi - (_HI_BIAS + CENTRE)
    return lo, hi


@triton.jit
def _row_partial(words, lo_mask, hi_mask, x_row, k0, offs_w, K: tl.constexpr, WORDS: tl.constexpr,
                 HAS_PERM: tl.constexpr, perm_ptr, EVEN_K: tl.constexpr, EXACT: tl.constexpr,
                 CENTRE: tl.constexpr, SLICED: tl.constexpr):  # fmt: skip
    """For one row of x: `sum_i (q_i - CENTRE) x_i` per weight row and word (`[BLOCK_N,
    WORDS]`) and x's sum per word (`[WORDS]`)."""
    x0, x1, x2, x3, x4, x5, x6, x7 = _x_slices(x_row, k0, offs_w, K, WORDS, HAS_PERM, perm_ptr,
                                              EVEN_K, SLICED)  # fmt: skip
    lo, hi = _biased_pair(words, 0, lo_mask, hi_mask, EXACT, CENTRE)
    p = lo * x0[None, :]
    p += hi * x1[None, :]
    lo, hi = _biased_pair(words, 1, lo_mask, hi_mask, EXACT, CENTRE)
    p += lo * x2[None, :]
    p += hi * x3[None, :]
    lo, hi = _biased_pair(words, 2, lo_mask, hi_mask, EXACT, CENTRE)
    p += lo * x4[None, :]
    p += hi * x5[None, :]
    lo, hi = _biased_pair(words, 3, lo_mask, hi_mask, EXACT, CENTRE)
    p += lo * x6[None, :]
    p += hi * x7[None, :]
    even = x0 + x2 + x4 + x6
    odd = x1 + x3 + x5 + x7
    if EXACT:
        return p, even + odd
    bias = (_LO_BIAS + CENTRE) * even + (_HI_BIAS + CENTRE) * odd
    return p - bias[None, :], even + odd


@triton.jit
def _row_chunk(acc, words, scale, offset, lo_mask, hi_mask, x_row, k0, offs_w, K: tl.constexpr,
               WORDS: tl.constexpr, HAS_PERM: tl.constexpr, perm_ptr, EVEN_K: tl.constexpr,
               EXACT: tl.constexpr, HAS_OFFSETS: tl.constexpr, SLICED: tl.constexpr):  # fmt: skip
    """acc + one row of x times the chunk, dequantized: `(q * scale + offset) x`, or
    `(q - 8) scale x` without offsets."""
    CENTRE: tl.constexpr = 0.0 if HAS_OFFSETS else 8.0  # symmetric codes are q - 8
    p, s = _row_partial(words, lo_mask, hi_mask, x_row, k0, offs_w, K, WORDS, HAS_PERM, perm_ptr,
                        EVEN_K, EXACT, CENTRE, SLICED)  # fmt: skip
    if HAS_OFFSETS:
        return acc + p * scale + offset * s[None, :]
    return acc + p * scale


@triton.jit(do_not_specialize=["M"])
def int4_gemv_kernel(
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
    lo_mask,  # MASKS[0]
    hi_mask,  # MASKS[1]
    K: tl.constexpr,
    GROUP: tl.constexpr,
    ROWS: tl.constexpr,  # rows of x per program, 1 to 4 (each its own 2-D accumulator)
    BLOCK_N: tl.constexpr,
    WORDS: tl.constexpr,  # words per row per chunk (chunks of 8 * WORDS columns)
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,  # K elements per split, a multiple of 8 * WORDS
    HAS_OFFSETS: tl.constexpr,
    HAS_PERM: tl.constexpr,
    SLICED: tl.constexpr,  # codes stored slice-major (x read in runs; HAS_PERM is then False)
    EVEN: tl.constexpr,  # BLOCK_N divides N and SPLIT_K * 8 * WORDS divides K: no weight masks
    EVEN_K: tl.constexpr,  # SPLIT_K * 8 * WORDS divides K
    PREFETCH: tl.constexpr,  # load a chunk's words and scales one chunk ahead
    MERGE: tl.constexpr,  # SPLIT_K > 1: the tile's last program sums the partials (`_split_merge`)
    PDL: tl.constexpr,
):
    """One `[BLOCK_N, WORDS]` float32 accumulator per row of x (see the module docstring)."""
    pdl_enter(PDL)
    # A float32 x keeps exact products (an add per code): `256 + q` would cost it 8 bits.
    EXACT: tl.constexpr = x_ptr.dtype.element_ty == tl.float32
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
    first = split * K_SPLIT
    end = first + K_SPLIT
    if PREFETCH:
        words = _load_words(qw_ptr, offs_n, n_mask, offs_w, first, K, EVEN)
        scale, offset = _group_params(s_ptr, o_ptr, offs_n, n_mask, offs_w, first, N, K, GROUP,
                                      WORDS, HAS_OFFSETS)  # fmt: skip
    for k0 in range(first, end, 8 * WORDS):
        if PREFETCH:  # the next chunk's words and scales in flight while this one computes
            now_words, now_scale, now_offset = words, scale, offset
            nxt = tl.where(k0 + 8 * WORDS < end, k0 + 8 * WORDS, k0)  # past the end: this again
            words = _load_words(qw_ptr, offs_n, n_mask, offs_w, nxt, K, EVEN)
            scale, offset = _group_params(s_ptr, o_ptr, offs_n, n_mask, offs_w, nxt, N, K, GROUP,
                                          WORDS, HAS_OFFSETS)  # fmt: skip
        else:
            now_words = _load_words(qw_ptr, offs_n, n_mask, offs_w, k0, K, EVEN)
            now_scale, now_offset = _group_params(s_ptr, o_ptr, offs_n, n_mask, offs_w, k0, N, K,
                                                  GROUP, WORDS, HAS_OFFSETS)  # fmt: skip
        acc0 = _row_chunk(acc0, now_words, now_scale, now_offset, lo_mask, hi_mask, x0, k0,
                          offs_w, K, WORDS, HAS_PERM, perm_ptr, EVEN_K, EXACT,
                          HAS_OFFSETS, SLICED)  # fmt: skip
        if ROWS > 1:
            acc1 = _row_chunk(acc1, now_words, now_scale, now_offset, lo_mask, hi_mask, x1, k0,
                              offs_w, K, WORDS, HAS_PERM, perm_ptr, EVEN_K, EXACT,
                              HAS_OFFSETS, SLICED)  # fmt: skip
        if ROWS > 2:
            acc2 = _row_chunk(acc2, now_words, now_scale, now_offset, lo_mask, hi_mask, x2, k0,
                              offs_w, K, WORDS, HAS_PERM, perm_ptr, EVEN_K, EXACT,
                              HAS_OFFSETS, SLICED)  # fmt: skip
        if ROWS > 3:
            acc3 = _row_chunk(acc3, now_words, now_scale, now_offset, lo_mask, hi_mask, x3, k0,
                              offs_w, K, WORDS, HAS_PERM, perm_ptr, EVEN_K, EXACT,
                              HAS_OFFSETS, SLICED)  # fmt: skip
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
    if SPLIT_K > 1 and MERGE:
        rows = row0 + tl.arange(0, ROWS)  # ROWS is a power of two (`_check_config`)
        merge_splits(out_ptr, merged_ptr, counters_ptr, rows[:, None] * N + offs_n[None, :],
                     (rows < M)[:, None] & n_mask[None, :], M, N, SPLIT_K)  # fmt: skip


@triton.jit
def _store_row(out_ptr, row, M, N, offs_n, n_mask, y):
    mask = n_mask & (row + 0 * offs_n < M)  # a block: the interpreter's & wants two
    tl.store(out_ptr + row * N + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask)
