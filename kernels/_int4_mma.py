"""The tensor-core INT4 kernel behind `int4_matmul`'s `mma` mode: 16-bit x, group size 128, any
number of rows.

A group is 16 int32 words per weight row (`sitsd.kernels.quant_layout`: code 8w + i of the group
in nibble i of word w). Its `[BLOCK_N, 16]` word tile becomes eight 16-bit tiles `c_0 .. c_7` in
x's dtype, `c_i[n, w] = q[n, 8w + i] - z[n]`, exact. On the GPU that is one inline-PTX block per
two words (sixteen codes): two byte permutes pair the words' halves, six shifts and eight LOP3s
(`(t & 0x000F000F) | MAGIC`) set each code as the low mantissa bits of BIAS (128 in bfloat16,
whose last mantissa bit is worth 1 there; 1024 in float16), and eight packed subtractions of
`BIAS + z` leave `q - z`: 1.5 instructions per code (the float32 dequantization of the other
modes costs about four, plus a conversion to 16 bits). The words are loaded straight into the
MMA's register layout (through shared memory, pipelined) and never move again; the eight slices
side by side are one `[BLOCK_N, 128]` operand (a relabelling of registers), multiplied in one
chain of MMAs with x's columns in the same slice-major order (`x[:, k0 + 8w + i]` at K index
16 i + w): x is loaded in column order, in 16-byte vectors, and permuted on its way into shared
memory, where the MMA reads it anyway (a gather of 2-byte loads before: 5-12% more
instructions in the loop with triton 3.9, 33-88% with 3.6; `bench.sass_int4`); or, with
X_ORDERED (tiles of 64 rows or more), it comes in that order already, from one copy the
wrapper makes (`int4_matmul.slice_major_x`), and is stored to shared memory in 16-byte
pieces. Codes stored slice-major (`quant_layout.to_slice_major`, how CUDA serves groups of 128)
take x as it is under X_ORDERED: column `16 i + w` is already at K index `16 i + w`. The weight
rows are the MMA's M side.

The zero point z of a row and group is 8 without offsets; the integer zero points found at load
(`zeros`, int32: AWQ, GPTQ, compressed-tensors, sitsd's own RTN); else `round(-offset / scale)`.
The group's float32 partial `p = sum_k (q_k - z) x_k` takes its scale once per output element:

    y += scale * p + r * sum_k x_k,      r = offset + z * scale

r is 0 in the first two cases, which skip the sum of x; GGUF's Q4_1 and Q4_K minima leave a
remainder, and the sum of x per group (a contiguous load, summed along its rows) carries it.

The x, scales and offsets of a group are loaded one group ahead, so their latency hides behind
the group before (the words' loads are pipelined by Triton itself). Integer zero points are
loaded where the group unpacks, and pipelined as the words are: 32-bit, so that Triton copies
them asynchronously (see the kernel's comment). Without X_AHEAD x and the scales are
loaded in the group that uses them, and Triton's pipeliner copies x into shared memory
asynchronously, `num_stages` groups deep, as it does the words: at 32 and more rows of x a
group's x tile is larger than its codes (32 rows: 8 KB against 4 KB of words on 64 weight
rows), and ahead by hand it passes through registers on its way to shared memory.

With SCALED the scale goes into the codes instead, in the same PTX block (a packed multiply per
two codes: `(q - z) * scale` rounded to x's dtype, as a dequantized 16-bit weight is), and the
MMAs accumulate into the output tile itself: no float32 partial per group beside it. At 64 x 64
tiles that is 142 registers instead of 184 (three programs per SM, not two) for 10% more
instructions in the loop, a conversion of the scales' layout per group among them (SASS sm_90,
triton 3.6, `bench.sass_int4`). Whether it pays is the GPU sweep's to say
(`bench.bench_quant_kernels`); no default takes it.

Under the interpreter (no PTX) the slices are float32 arithmetic and the MMA runs in float32, so
the CPU checks the tiling, masks and the zero-point algebra; the PTX block is checked on the GPU
(`tests/kernels/test_int4_matmul.py`, `gpu`).
"""

from __future__ import annotations

import re

import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._split_merge import merge_splits

WORDS = tl.constexpr(16)  # words per group row: the kernel takes group size 128 only (8 * WORDS)

# Two words a, b in ($8, $9) and (BIAS + z, BIAS + z) in $10; eight 16-bit pairs out: $i =
# (nibble i of a, nibble i of b) - z. The permutes give lo = (a.lo16, b.lo16) and hi = (a.hi16,
# b.hi16); a shift by 4j brings nibble j of each half to bits 0-3 and 16-19; LOP3 0xEA is
# (t & mask) | MAGIC, which reads as BIAS + q; the subtraction is exact.
_UNPACK_PTX = """
{
.reg .b32 lo, hi, a1, a2, a3, b1, b2, b3, c0, c1, c2, c3, c4, c5, c6, c7;
prmt.b32 lo, $8, $9, 0x5410;
prmt.b32 hi, $8, $9, 0x7632;
shr.b32 a1, lo, 4;
shr.b32 a2, lo, 8;
shr.b32 a3, lo, 12;
shr.b32 b1, hi, 4;
shr.b32 b2, hi, 8;
shr.b32 b3, hi, 12;
lop3.b32 c0, lo, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c1, a1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c2, a2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c3, a3, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c4, hi, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c5, b1, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c6, b2, 0x000F000F, MAGIC, 0xEA;
lop3.b32 c7, b3, 0x000F000F, MAGIC, 0xEA;
SUB $0, c0, $10;
SUB $1, c1, $10;
SUB $2, c2, $10;
SUB $3, c3, $10;
SUB $4, c4, $10;
SUB $5, c5, $10;
SUB $6, c6, $10;
SUB $7, c7, $10;
}
"""
# A jit function reads only constexpr globals.
_UNPACK_BF16 = tl.constexpr(  # 128.0 in bfloat16, twice
    _UNPACK_PTX.replace("MAGIC", "0x43004300").replace("SUB", "sub.rn.bf16x2")
)
_UNPACK_F16 = tl.constexpr(  # 1024.0 in float16, twice
    _UNPACK_PTX.replace("MAGIC", "0x64006400").replace("SUB", "sub.rn.f16x2")
)
# SCALED: (scale, scale) in $11 as well; each `q - z` pair is multiplied by it (a rounding to
# x's dtype, as a dequantized 16-bit weight takes), one packed multiply per two codes more.
_SCALED_PTX = re.sub(r"SUB \$(\d), c(\d), \$10;", r"SUB c\2, c\2, $10;\nMUL $\1, c\2, $11;",
                     _UNPACK_PTX)  # fmt: skip
_SCALED_BF16 = tl.constexpr(
    _SCALED_PTX.replace("MAGIC", "0x43004300").replace("SUB", "sub.rn.bf16x2")
    .replace("MUL", "mul.rn.bf16x2")
)  # fmt: skip
_SCALED_F16 = tl.constexpr(
    _SCALED_PTX.replace("MAGIC", "0x64006400").replace("SUB", "sub.rn.f16x2")
    .replace("MUL", "mul.rn.f16x2")
)  # fmt: skip


@triton.jit
def _bias(DTYPE: tl.constexpr):
    if tl.bfloat16 == DTYPE:
        return 128.0
    return 1024.0


@triton.jit
def _bias_bits(DTYPE: tl.constexpr):
    """BIAS's bits (`_bias`): an integer z added to them gives BIAS + z's, for z up to 127
    (bfloat16; 1023 in float16)."""
    if tl.bfloat16 == DTYPE:
        return 0x4300
    return 0x6400


@triton.jit
def _slices_ptx(words, bias_z, DTYPE: tl.constexpr):
    """`[BLOCK_N, WORDS]` int32 words and `[BLOCK_N, WORDS]` DTYPE `BIAS + z` -> eight DTYPE
    tiles `q - z`, nibbles 0..7 (the PTX)."""
    # Eight pairs out; two words and a pair of BIAS + z in.
    if tl.bfloat16 == DTYPE:
        c = tl.inline_asm_elementwise(_UNPACK_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                                      [words, bias_z], dtype=(tl.bfloat16,) * 8, is_pure=True,
                                      pack=2)  # fmt: skip
    else:
        c = tl.inline_asm_elementwise(_UNPACK_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r",
                                      [words, bias_z], dtype=(tl.float16,) * 8, is_pure=True,
                                      pack=2)  # fmt: skip
    return c


@triton.jit
def _scaled_slices_ptx(words, bias_z, scale, DTYPE: tl.constexpr):
    """As `_slices_ptx`, each tile times `scale` (`[BLOCK_N, WORDS]` DTYPE): `(q - z) * scale`
    rounded to DTYPE."""
    if tl.bfloat16 == DTYPE:
        c = tl.inline_asm_elementwise(_SCALED_BF16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                      [words, bias_z, scale], dtype=(tl.bfloat16,) * 8,
                                      is_pure=True, pack=2)  # fmt: skip
    else:
        c = tl.inline_asm_elementwise(_SCALED_F16, "=r,=r,=r,=r,=r,=r,=r,=r,r,r,r,r",
                                      [words, bias_z, scale], dtype=(tl.float16,) * 8,
                                      is_pure=True, pack=2)  # fmt: skip
    return c


@triton.jit
def _slices_float32(words, z):
    """The same tiles in float32, by plain arithmetic (the interpreter runs no PTX)."""
    return (
        (words & 0xF).to(tl.float32) - z,
        ((words >> 4) & 0xF).to(tl.float32) - z,
        ((words >> 8) & 0xF).to(tl.float32) - z,
        ((words >> 12) & 0xF).to(tl.float32) - z,
        ((words >> 16) & 0xF).to(tl.float32) - z,
        ((words >> 20) & 0xF).to(tl.float32) - z,
        ((words >> 24) & 0xF).to(tl.float32) - z,
        ((words >> 28) & 0xF).to(tl.float32) - z,
    )


@triton.jit
def _slice_major(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N: tl.constexpr):
    """The eight `[BLOCK_N, WORDS]` slices side by side, `[BLOCK_N, 8 * WORDS]`: K index
    `WORDS * i + w` holds slice i's word w. A relabelling of registers (joins, a permute, a
    reshape): each slice's registers are already the MMA's for its K range."""
    a = tl.join(tl.join(tl.join(c0, c1), tl.join(c2, c3)),
                tl.join(tl.join(c4, c5), tl.join(c6, c7)))  # fmt: skip
    # [BLOCK_N, WORDS, 2, 2, 2], slice i = t0 + 2 t1 + 4 t2 over the last three dimensions
    return tl.reshape(tl.permute(a, (0, 4, 3, 2, 1)), (BLOCK_N, 8 * WORDS))


@triton.jit
def _group_inputs(x_ptr, perm_ptr, s_ptr, o_ptr, offs_m, m_mask, offs_n, n_mask, k0, live, N,
                  stride_xm, K: tl.constexpr, HAS_OFFSETS: tl.constexpr, HAS_PERM: tl.constexpr,
                  EVEN_K: tl.constexpr, X_ORDERED: tl.constexpr, KX: tl.constexpr):  # fmt: skip
    """What one group multiplies besides its codes: x's columns in slice-major order,
    transposed (`[8 * WORDS, BLOCK_M]`, zero past M and K; loaded in order and permuted here,
    or with X_ORDERED in that order already), and per weight row (float32 `[BLOCK_N]`) the
    scale, the zero point z (8 without offsets; integer zero points are the loop's) and the
    remainder `offset + z * scale` (HAS_OFFSETS: offsets whose zero points are not integers).
    `live` False (a prefetch past the split's last group) loads nothing."""
    cols, k_mask = _input_columns(perm_ptr, k0 + tl.arange(0, 8 * WORDS), live, KX,
                                  HAS_PERM and not X_ORDERED, EVEN_K and not X_ORDERED)  # fmt: skip
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
    if X_ORDERED:
        x = tl.trans(x)
    else:
        # [BLOCK_M, 128] in column order; column 8 w + i to K index WORDS * i + w: [M, w, i]
        # -> [i, w, M]
        x = tl.reshape(tl.permute(tl.reshape(x, (x.shape[0], WORDS, 8)), (2, 1, 0)),
                       (8 * WORDS, x.shape[0]))  # fmt: skip
    g = k0 // (8 * WORDS)
    num_groups = (K + 8 * WORDS - 1) // (8 * WORDS)
    g_mask = n_mask & (live + 0 * offs_n > 0) & (g + 0 * offs_n < num_groups)
    scale = tl.load(s_ptr + g * N + offs_n, mask=g_mask, other=1.0).to(tl.float32)
    if HAS_OFFSETS:
        offset = tl.load(o_ptr + g * N + offs_n, mask=g_mask, other=0.0).to(tl.float32)
        # Any z is right (the remainder carries the rest); one in 0..15 keeps q - z exact in
        # 16 bits whatever the offset.
        z = tl.minimum(tl.maximum(_round(tl.fdiv(-offset, scale)), 0.0), 15.0)
        rest = offset + z * scale
    else:
        z = tl.full(offs_n.shape, 8.0, tl.float32)
        rest = tl.zeros_like(scale)
    return x, scale, z, rest


@triton.jit
def _round(v):
    """To the nearest integer, halves away from zero."""
    return tl.where(v < 0, -tl.floor(0.5 - v), tl.floor(v + 0.5))


@triton.jit
def _input_columns(perm_ptr, cols, live, K: tl.constexpr, HAS_PERM: tl.constexpr,
                   EVEN_K: tl.constexpr):  # fmt: skip
    """The input columns of layout columns `cols` (through act-order's perm) and where they
    exist: below K, and nowhere when `live` is False."""
    k_mask = live + 0 * cols > 0  # a block (the interpreter's & wants two)
    if not EVEN_K:
        k_mask = k_mask & (cols < K)
    if HAS_PERM:
        cols = tl.load(perm_ptr + cols, mask=k_mask, other=0)
    return cols, k_mask


@triton.jit
def _x_sums(x_ptr, perm_ptr, offs_m, m_mask, k0, stride_xm, K: tl.constexpr,
            HAS_PERM: tl.constexpr, EVEN_K: tl.constexpr):  # fmt: skip
    """Each row's sum of x over the group's columns (`[BLOCK_M]` float32): one contiguous load
    (unless act-order gathers it), summed along the row."""
    cols, k_mask = _input_columns(perm_ptr, k0 + tl.arange(0, 8 * WORDS), True, K, HAS_PERM,
                                  EVEN_K)  # fmt: skip
    x = tl.load(x_ptr + offs_m[:, None] * stride_xm + cols[None, :],
                mask=m_mask[:, None] & k_mask[None, :], other=0.0)  # fmt: skip
    return tl.sum(x.to(tl.float32), axis=1)


# One compiled variant per (K, tile, flags): M changes with the batch.
@triton.jit(do_not_specialize=["M"])
def int4_mma_kernel(
    x_ptr,  # [M, K] float16 or bfloat16
    qw_ptr,  # [N, K // 8] int32
    s_ptr,
    o_ptr,  # offsets, or any pointer without HAS_OFFSETS
    z_ptr,  # integer zero points [G, N] int32 (0..127), or any pointer without HAS_ZEROS
    perm_ptr,  # act-order permutation, or any pointer without HAS_PERM
    out_ptr,  # [M, N] in x's dtype, or with SPLIT_K > 1 the float32 partials [SPLIT_K, M, N]
    merged_ptr,  # MERGE: the [M, N] output in x's dtype (any pointer otherwise)
    counters_ptr,  # MERGE: int32 zeros, one per tile (left zero)
    M,
    N,
    stride_xm,
    K: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows of x per program (the MMA's N side), >= 16
    BLOCK_N: tl.constexpr,  # rows of W per program (the MMA's M side), >= 16
    SPLIT_K: tl.constexpr,
    K_SPLIT: tl.constexpr,  # K elements per split, a multiple of the group (128)
    HAS_OFFSETS: tl.constexpr,
    HAS_ZEROS: tl.constexpr,  # offsets are -zeros * scales exactly: no x sums
    HAS_PERM: tl.constexpr,
    EVEN: tl.constexpr,  # BLOCK_N divides N and SPLIT_K * 128 divides K: no weight masks
    EVEN_K: tl.constexpr,  # SPLIT_K * 128 divides K: no K mask on x
    ASM: tl.constexpr,  # the PTX unpacking (GPU); plain float32 arithmetic otherwise
    # x arrives in slice-major column order (`slice_major_x`: through perm, zero-padded to
    # whole groups); otherwise each program loads a group's columns in order and permutes them
    X_ORDERED: tl.constexpr,
    KX: tl.constexpr,  # x's columns: K, or with X_ORDERED K padded to whole groups
    MERGE: tl.constexpr,  # SPLIT_K > 1: the tile's last program sums the partials (`_split_merge`)
    # the scale multiplied into the 16-bit codes, so the MMAs accumulate in place: no float32
    # partial per group beside the accumulator (registers), one rounding more per weight
    SCALED: tl.constexpr,
    # x, scales and zero points loaded one group ahead into registers, by hand (True), or where
    # each group uses them, for Triton's pipeliner to copy x into shared memory asynchronously
    # (`num_stages` deep: no register round trip, no loop-carried x tile)
    X_AHEAD: tl.constexpr,
    PDL: tl.constexpr,
):
    """`[BLOCK_N, BLOCK_M]` of `W @ x^T` per program (see the module docstring)."""
    pdl_enter(PDL)
    DTYPE: tl.constexpr = x_ptr.dtype.element_ty
    GROUP: tl.constexpr = 8 * WORDS
    # Integer zero points are loaded where each group unpacks, as int32: Triton's pipeliner
    # copies them into shared memory `num_stages` groups ahead, as it does the codes, and reads
    # them back in the codes' layout. As uint8 (a byte a row, too narrow for an asynchronous
    # copy) they were not copied ahead on every tile (gate_up's 64 x 128 on 8 warps among
    # them) and the unpacking waited on the load; carried a group ahead by hand, z came back in
    # a layout converted into the codes' each group. The zero points' BIAS + z is built in
    # integers: any arithmetic on z with a value that changes along the loop (a byte picked
    # out of a word by the group's index) sent the codes through shared memory instead
    # (`bench.sass_int4`). An H100, the four layers' kernels alone with zero points at 32 and
    # 128 rows: 89.4 and 189.0 us as uint8, 79.2 and 169.9 as int32 (a copy of this kernel
    # that loaded BIAS + z's bits), symmetric 77.8 and 164.5 (`kernels/NOTES.md`, session 33).
    X_SUMS: tl.constexpr = HAS_OFFSETS and not HAS_ZEROS
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    split = tl.program_id(2)
    n_mask = offs_n < N
    m_mask = offs_m < M
    offs_w = tl.arange(0, WORDS)
    rows = qw_ptr + offs_n[:, None].to(tl.int64) * (K // 8)  # [BLOCK_N, 1]
    first = split * K_SPLIT
    end = first + K_SPLIT
    if X_AHEAD:  # a group's x and scale, one group ahead (and offsets' z and remainder)
        x_t, scale, z, rest = _group_inputs(x_ptr, perm_ptr, s_ptr, o_ptr, offs_m, m_mask,
                                            offs_n, n_mask, first, True, N, stride_xm, K,
                                            X_SUMS, HAS_PERM, EVEN_K, X_ORDERED, KX)  # fmt: skip
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for k0 in range(first, end, GROUP):
        if not X_AHEAD:
            x_t, scale, z, rest = _group_inputs(x_ptr, perm_ptr, s_ptr, o_ptr, offs_m, m_mask,
                                                offs_n, n_mask, k0, True, N, stride_xm, K,
                                                X_SUMS, HAS_PERM, EVEN_K, X_ORDERED,
                                                KX)  # fmt: skip
        if HAS_ZEROS:
            z_at = z_ptr + (k0 // GROUP) * N + offs_n
            if EVEN:
                zq = tl.load(z_at)
            else:  # a split's range may run past K's last group
                zq = tl.load(z_at, mask=n_mask & (k0 + 0 * offs_n < K), other=0)
        word_cols = k0 // 8 + offs_w
        if EVEN:
            words = tl.load(rows + word_cols[None, :])
        else:
            w_mask = n_mask[:, None] & (word_cols < K // 8)[None, :]
            words = tl.load(rows + word_cols[None, :], mask=w_mask, other=0)
        if ASM:
            if HAS_ZEROS:  # BIAS + z as bits: z sits in BIAS's last mantissa bits, exactly
                bias_z = (zq + _bias_bits(DTYPE)).to(tl.int16).to(DTYPE, bitcast=True)
            else:
                bias_z = (_bias(DTYPE) + z).to(DTYPE)
            bias_z = tl.broadcast_to(bias_z[:, None], (BLOCK_N, WORDS))
            if SCALED:
                s16 = tl.broadcast_to(scale.to(DTYPE)[:, None], (BLOCK_N, WORDS))
                c0, c1, c2, c3, c4, c5, c6, c7 = _scaled_slices_ptx(words, bias_z, s16, DTYPE)
                acc = tl.dot(_slice_major(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N), x_t, acc)
            else:
                c0, c1, c2, c3, c4, c5, c6, c7 = _slices_ptx(words, bias_z, DTYPE)
                p = tl.dot(_slice_major(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N), x_t)
                acc += scale[:, None] * p
        else:
            if HAS_ZEROS:
                z = zq.to(tl.float32)
            c0, c1, c2, c3, c4, c5, c6, c7 = _slices_float32(words, z[:, None])
            w = _slice_major(c0, c1, c2, c3, c4, c5, c6, c7, BLOCK_N)
            if SCALED:  # rounded as the PTX rounds: the scale, then each product, to DTYPE
                s16 = scale.to(DTYPE).to(tl.float32)[:, None]
                w = (w * s16).to(DTYPE).to(tl.float32)
                acc = tl.dot(w, x_t.to(tl.float32), acc, input_precision="ieee")
            else:
                p = tl.dot(w, x_t.to(tl.float32), input_precision="ieee")
                acc += scale[:, None] * p
        if X_SUMS:
            x_sum = _x_sums(x_ptr, perm_ptr, offs_m, m_mask, k0, stride_xm, KX,
                            HAS_PERM and not X_ORDERED, EVEN_K and not X_ORDERED)  # fmt: skip
            acc += rest[:, None] * x_sum[None, :]
        if X_AHEAD:
            nxt = k0 + GROUP
            x_t, scale, z, rest = _group_inputs(x_ptr, perm_ptr, s_ptr, o_ptr, offs_m, m_mask,
                                                offs_n, n_mask, nxt, nxt < end, N, stride_xm, K,
                                                X_SUMS, HAS_PERM, EVEN_K, X_ORDERED,
                                                KX)  # fmt: skip
    y = tl.trans(acc)  # [BLOCK_M, BLOCK_N]
    offs = offs_m[:, None] * N + offs_n[None, :]  # into row-major [M, N]
    mask = m_mask[:, None] & n_mask[None, :]
    if SPLIT_K == 1:
        tl.store(out_ptr + offs, y.to(out_ptr.dtype.element_ty), mask=mask)
    else:
        tl.store(out_ptr + split * M * N + offs, y, mask=mask)
        if MERGE:
            merge_splits(out_ptr, merged_ptr, counters_ptr, offs, mask, M, N, SPLIT_K)
