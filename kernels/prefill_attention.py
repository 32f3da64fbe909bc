"""Triton kernel: causal prefill attention for a ragged batch of prompt chunks over the paged cache.

Each sequence contributes `q_len` query tokens (a whole prompt, a chunk of one, or a suffix
after a prefix-cache hit) that sit at positions `seq_len - q_len .. seq_len - 1` and attend to
every cached key up to their own position; `reference.prefill_attention_ref` defines the result.
All K/V, the chunk's own included, are read through the block table (the chunk's K/V were
written there first by `rotary_and_cache`), so a cached prefix costs nothing special.

Work split (the layout of vLLM's unified Triton attention):

* the grid's first axis walks query blocks over the ragged batch: sequence `i` owns blocks
  `query_start_loc[i] // BLOCK_Q + i ..`, so the grid (`num_tokens // BLOCK_Q + num_seqs`) is
  known from shapes alone, without reading the query lengths back to the host; each program
  finds its sequence by binary search and exits at once if its block is past the sequence's end;
* the second axis is the kv head; the `group` query heads that share it are stacked with
  `BLOCK_Q` tokens into `BLOCK_M = BLOCK_Q * group` rows, so each K/V tile, gathered through the
  block table, is loaded once per group (GQA);
* online softmax in base 2, fp32 accumulators, `tl.dot` for QK^T and PV; key tiles that every
  row of a block may see run unmasked, only the tiles on the causal diagonal are masked.

Padded batches (CUDA graphs of mixed steps, `sitsd.runtime.mixed_graphs`): the grid depends on
the shapes only, so a step padded to fixed shapes launches the same grid every time. `query` may
hold more rows than `query_start_loc[-1]` (padding tokens: no sequence owns them, their output
rows are left unwritten) and trailing sequences may be empty (`query_start_loc` repeats its last
value, their programs exit at once): the binary search still finds every real sequence, because
`query_start_loc[i] // BLOCK_Q + i` grows strictly with `i` whatever the lengths are. A decode is
a sequence with one query token, so decodes and prompt chunks go through one launch.

What the chunk boundaries are is the scheduler's business; rotary embedding is applied before.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._utils import (
    check_ndim,
    check_out,
    check_paged_attention,
    check_shape,
    next_power_of_2,
    runs_in_interpreter,
)

__all__ = ["prefill_attention"]

_LOG2E = 1.4426950408889634


@triton.jit
def _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q: tl.constexpr):
    """Largest sequence i with `query_start_loc[i] // BLOCK_Q + i <= q_block` (binary search)."""
    lo: tl.int32 = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_block = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_block <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _attend_keys(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    k_base,
    v_base,
    table,
    stride_kb,
    stride_kt,
    stride_vb,
    stride_vt,
    qk_scale,
    kv_start,
    kv_end,
    BLOCK_D: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """Online-softmax update of (acc, l_i, m_i) with keys kv_start .. kv_end - 1.

    MASKED tiles apply the causal mask and the end of the range; unmasked tiles (every key
    visible to every row, all before the sequence's end) skip both, as in Triton's tutorial.
    """
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM
    for tile_start in range(kv_start, kv_end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < kv_end
        # Block-table entries past the sequence's end may be -1: only masked tiles reach them,
        # and there they are never dereferenced.
        if MASKED:
            block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
            k_mask = d_mask[:, None] & n_mask[None, :]  # [BLOCK_D, BLOCK_N]
        else:
            block_ids = tl.load(table + offs_n // BLOCK_SIZE).to(tl.int64)
            k_mask = tl.broadcast_to(d_mask[:, None], (BLOCK_D, BLOCK_N))
        slots = offs_n % BLOCK_SIZE  # [BLOCK_N]
        k = tl.load(
            k_base + block_ids[None, :] * stride_kb + slots[None, :] * stride_kt + offs_d[:, None],
            mask=k_mask,
            other=0.0,
        )  # [BLOCK_D, BLOCK_N], K^T
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision="ieee") * qk_scale  # [BLOCK_M, BLOCK_N]
        if MASKED:
            visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            scores = tl.where(visible, scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_M, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_base + block_ids[:, None] * stride_vb + slots[:, None] * stride_vt + offs_d[None, :],
            mask=tl.trans(k_mask),
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new
    return acc, l_i, m_i


# The sequence count changes every step: one compiled variant for all counts, so no step ever
# waits for a compile (Triton specializes ints equal to 1 or % 16 == 0).
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_loc_ptr,
    out_ptr,
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_seqs,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_ot,
    stride_oh,
    GROUP: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,  # feed tl.dot fp32 (the interpreter's bf16 dot is wrong)
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    seq = _find_seq(query_start_loc_ptr, q_block, num_seqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    q_block_local = q_block - (q_start // BLOCK_Q + seq)
    if q_block_local * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    prefix_len = seq_len - q_len

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    tokens = q_block_local * BLOCK_Q + offs_m // GROUP  # [BLOCK_M], index within the chunk
    head_ids = kv_head * GROUP + offs_m % GROUP  # [BLOCK_M]
    # BLOCK_M may exceed BLOCK_Q * GROUP when GROUP is not a power of two: those rows idle.
    m_mask = (offs_m < BLOCK_Q * GROUP) & (tokens < q_len)
    d_mask = offs_d < HEAD_DIM
    q_offsets = (q_start + tokens)[:, None] * stride_qt + head_ids[:, None] * stride_qh
    q = tl.load(
        q_ptr + q_offsets + offs_d[None, :], mask=m_mask[:, None] & d_mask[None, :], other=0.0
    )  # [BLOCK_M, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix_len + tokens  # [BLOCK_M], absolute position of each row's token

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    k_base = k_cache_ptr + kv_head * stride_kh
    v_base = v_cache_ptr + kv_head * stride_vh
    # Keys up to the block's first position are visible to every row: whole tiles of them run
    # unmasked. Keys past its last position are visible to none: stop there. Every row sees
    # key 0 in the first tile either way, so m_i is finite from then on (no NaN).
    first_pos = prefix_len + q_block_local * BLOCK_Q
    full_end = (first_pos + 1) // BLOCK_N * BLOCK_N
    kv_end = prefix_len + tl.minimum((q_block_local + 1) * BLOCK_Q, q_len)
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, 0, full_end,
        BLOCK_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N, False, UPCAST,
    )  # fmt: skip
    acc, l_i, m_i = _attend_keys(
        acc, l_i, m_i, q, q_pos, k_base, v_base, table,
        stride_kb, stride_kt, stride_vb, stride_vt, qk_scale, full_end, kv_end,
        BLOCK_D, HEAD_DIM, BLOCK_SIZE, BLOCK_N, True, UPCAST,
    )  # fmt: skip

    out = acc / l_i[:, None]  # [BLOCK_M, BLOCK_D]
    o_offsets = (q_start + tokens)[:, None] * stride_ot + head_ids[:, None] * stride_oh
    tl.store(
        out_ptr + o_offsets + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def _check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
) -> None:
    check_ndim("seq_lens", seq_lens, 1, "[num_seqs]")
    num_seqs = seq_lens.shape[0]
    check_paged_attention(
        query,
        "[num_tokens, num_heads, head_dim]",
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        num_seqs=num_seqs,
        query_start_loc=query_start_loc,
    )
    check_shape("query_start_loc", query_start_loc, (num_seqs + 1,), "[num_seqs + 1]")


def _default_tiles(query: torch.Tensor, head_dim: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) for this dtype and device."""
    if runs_in_interpreter(query):
        return 32, 32, 4, 1  # tiny tiles: the interpreter pays for every masked element
    if query.dtype == torch.float32:
        return 64, 32, 4, 2  # fp32 tiles are twice the bytes and run on the FMA units
    if head_dim > 64:
        return 128, 128, 8, 3  # measured best on an H200 for head_dim 128 (kernels/NOTES.md)
    return 128, 64, 4, 3


def prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a ragged batch of prompt chunks over the paged cache.

    See `prefill_attention_ref`. Host-sync free: the grid comes from `num_tokens` and `num_seqs`.

    Args:
        query: Query tokens of all chunks back to back, fp32/fp16/bf16; may be a strided view
            (e.g. of a fused QKV output) with a contiguous last dimension.
        key_cache: Paged keys, same dtype as `query`; the chunk's own K/V already written.
        value_cache: Paged values, same dtype and shape as `key_cache`.
        block_tables: Cache block ids of each sequence; entries past its end are never read.
        seq_lens: Context length of each sequence including its chunk (>= its query length).
        query_start_loc: Prefix sums of the chunk lengths. `query_start_loc[-1]` may be less
            than `num_tokens`: the rows past it are padding, and their output is not written.
        scale: Softmax scale, usually `head_dim ** -0.5`.
        block_m: Rows (tokens x group heads) per program, a power of two >= 16 (keyword-only).
        block_n: Keys per tile, a power of two >= 16.
        num_warps: Warps per program; None picks one per tile and head_dim.
        num_stages: Software-pipelining depth of the K/V loads; None picks one per dtype.
        out: Optional preallocated contiguous output, `query`'s shape and dtype.

    Returns:
        The attention output, `query`'s shape and dtype (`out` when given).
    """
    _check_args(query, key_cache, value_cache, block_tables, seq_lens, query_start_loc)
    num_tokens, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    num_seqs = seq_lens.shape[0]
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_out("out", out, tuple(query.shape), query.dtype, query.device)
    default_m, default_n, default_warps, default_stages = _default_tiles(query, head_dim)
    num_warps = num_warps or default_warps
    num_stages = num_stages or default_stages
    block_m = max(block_m or default_m, next_power_of_2(group))
    block_n = block_n or default_n
    for name, value in (("block_m", block_m), ("block_n", block_n)):
        if value < 16 or value & (value - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    if num_tokens == 0 or num_seqs == 0:
        return out

    block_q = block_m // group
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
    upcast = runs_in_interpreter(query) and query.dtype == torch.bfloat16
    num_q_blocks = num_tokens // block_q + num_seqs
    _prefill_attention_kernel[(num_q_blocks, num_kv_heads)](
        query, key_cache, value_cache, block_tables, seq_lens, query_start_loc, out,
        scale * _LOG2E, num_seqs,
        query.stride(0), query.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        GROUP=group, BLOCK_Q=block_q, BLOCK_M=block_m,
        HEAD_DIM=head_dim, BLOCK_D=max(next_power_of_2(head_dim), 16),
        BLOCK_SIZE=block_size, BLOCK_N=block_n, UPCAST=upcast,
        num_warps=num_warps, num_stages=num_stages,
    )  # fmt: skip
    return out
