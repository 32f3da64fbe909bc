"""The INT4 tile dequantization that `int4_matmul` and `int4_dequantize` share (a `@triton.jit`
helper, inlined into both kernels).

`dequant_tile` loads `BLOCK_N` rows x `BLOCK_K` columns of an INT4 weight
(`sitsd.kernels.quant_layout`) starting at layout column `k0`, and returns them in float32:
`q * scale + offset`, or `(q - 8) * scale` without offsets, zero past N and K. A chunk lies in one
group (one scale per row) or spans whole groups (one scale per word of 8 codes: a word never
straddles two groups); the codes keep the register layout of the words they came from until one
final reshape, so the loads of the weight words stay 16-byte vectors and the scale loads few.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def as_float(codes, BIAS: tl.constexpr = 0.0):
    """Codes 0..15 (int32) as float32 minus BIAS, exactly: set as the low mantissa bits of 2^23,
    minus 2^23 + BIAS in the same add (an OR and an add, at the full rate; an int-to-float
    conversion runs at a quarter of it). BIAS 8 gives a symmetric weight's `q - 8`."""
    return (codes | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + BIAS)


@triton.jit
def dequant_tile(qw_ptr, s_ptr, o_ptr, offs_n, n_mask, k0, N, K: tl.constexpr,
                 GROUP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                 HAS_OFFSETS: tl.constexpr, EVEN: tl.constexpr):  # fmt: skip
    """W_layout[offs_n, k0 : k0 + BLOCK_K] in float32 (zero past N and K)."""
    WORDS: tl.constexpr = BLOCK_K // 8
    offs_w = k0 // 8 + tl.arange(0, WORDS)
    w_ptrs = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 8) + offs_w[None, :]
    if EVEN:
        words = tl.load(w_ptrs)
    else:
        words = tl.load(w_ptrs, mask=n_mask[:, None] & (offs_w < K // 8)[None, :], other=0)
    shifts = tl.arange(0, 8) * 4
    codes = (words[:, :, None] >> shifts[None, None, :]) & 0xF  # [BLOCK_N, WORDS, 8]
    NUM_GROUPS: tl.constexpr = (K + GROUP - 1) // GROUP
    if BLOCK_K <= GROUP:
        # The chunk lies in one group (both widths are powers of two): one scale per row.
        g = k0 // GROUP
        g_mask = n_mask & (g + 0 * offs_n < NUM_GROUPS)  # a block: the interpreter's & wants two
        scale = tl.load(s_ptr + g * N + offs_n, mask=g_mask, other=0.0).to(tl.float32)[:, None]
        q = as_float(tl.reshape(codes, [BLOCK_N, BLOCK_K]))
        if HAS_OFFSETS:
            offset = tl.load(o_ptr + g * N + offs_n, mask=g_mask, other=0.0).to(tl.float32)
            return q * scale + offset[:, None]
        return (q - 8.0) * scale
    # The chunk spans whole groups: one scale per word (a word never straddles two groups),
    # broadcast over its 8 codes, then one reshape (the words' register layout survives it).
    g = (offs_w * 8) // GROUP  # [WORDS]
    g_ptrs = g[None, :] * N + offs_n[:, None]  # [BLOCK_N, WORDS] into [G, N]
    g_mask = n_mask[:, None] & (g < NUM_GROUPS)[None, :]
    scale = tl.load(s_ptr + g_ptrs, mask=g_mask, other=0.0).to(tl.float32)[:, :, None]
    q = as_float(codes)
    if HAS_OFFSETS:
        offset = tl.load(o_ptr + g_ptrs, mask=g_mask, other=0.0).to(tl.float32)
        w = q * scale + offset[:, :, None]
    else:
        w = (q - 8.0) * scale
    return tl.reshape(w, [BLOCK_N, BLOCK_K])
