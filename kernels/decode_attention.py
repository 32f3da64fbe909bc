"""Triton kernel: decode attention over the paged KV cache (GQA, split-K flash-decoding).

One query token per sequence attends to its whole context, read through its block table
(`reference.decode_attention_ref` defines the result). Decode is memory bound, so the kernel is
built around reading each K/V byte once:

* one program per (sequence, kv head, split): the `group = num_heads // num_kv_heads` query heads
  that share a kv head are stacked into the rows of one `tl.dot`, so every K/V tile is loaded once
  for the whole group (rows padded to 16, the smallest `tl.dot` tile);
* K/V tiles of `BLOCK_N` tokens are gathered through the block table token by token, so a tile may
  span several cache blocks; block-table entries past a sequence's end are never read (masked);
* split-K: when batch x kv heads is too small to fill the GPU, each sequence's context is cut
  into `num_splits` equal, `BLOCK_N`-aligned ranges. Each split writes a partial result (its
  normalised output and log-sum-exp), and `_decode_reduce_kernel` merges them. The number of
  splits is fixed per launch (so a CUDA graph can capture it) while the split length follows each
  sequence's own `seq_len` on the device;
* with `split_counters` (caller-owned zeros) the merge needs no second launch: each split counts
  itself in with an atomic (release after its partial stores, acquire for the last), and the
  last split of a (sequence, kv head) merges the group's partials and zeroes its counter.

With one split the first kernel writes the final output and no reduce runs. A sequence with
`seq_len == 0` (CUDA-graph padding) gets zeros. Choosing which blocks a sequence owns is the KV
cache manager's job; writing the new token's K/V first is `rotary_and_cache`'s.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from sitsd.kernels._pdl import pdl_enter
from sitsd.kernels._utils import (
    cdiv,
    check_contiguous,
    check_dtype,
    check_out,
    check_paged_attention,
    check_pdl,
    check_same_device,
    next_power_of_2,
    num_sms,
    runs_in_interpreter,
)

__all__ = ["choose_num_splits", "decode_attention"]

_LOG2E = 1.4426950408889634
# Split-K tuning: at most this many programs per SM (one wave: on an H200, 768 programs ran 15%
# slower than 512 or 1024, see kernels/NOTES.md), never cut a context into pieces shorter than
# _MIN_SPLIT_TOKENS (a split also costs a partial write and a share of the reduce).
_PROGRAMS_PER_SM = 4
_MIN_SPLIT_TOKENS = 256
_MAX_SPLITS = 64


# Split counts change with the batch: one compiled variant for all of them, so a first long
# context never stops serving for a compile (Triton specializes ints equal to 1 or % 16 == 0).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_attention_kernel(
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    out_ptr,
    part_out_ptr,
    part_lse_ptr,
    counters_ptr,  # FUSED_REDUCE: [num_seqs * num_kv_heads] int32, zeros (left zero)
    qk_scale,  # softmax scale * log2(e): the kernel works in base 2
    num_splits,
    stride_qs,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_vb,
    stride_vt,
    stride_vh,
    stride_bts,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WRITE_PARTIALS: tl.constexpr,
    FUSED_REDUCE: tl.constexpr,  # the last split of each (seq, kv head) merges the partials
    GROUP_P2: tl.constexpr,  # the merge's rows: GROUP rounded up to a power of two
    SPLIT_CHUNK: tl.constexpr,  # splits the merge loads at once
    UPCAST: tl.constexpr,  # feed tl.dot fp32 (the interpreter's bf16 dot is wrong)
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    head_ids = kv_head * GROUP + offs_g  # [BLOCK_G]
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    q = tl.load(
        q_ptr + seq * stride_qs + head_ids[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_G, BLOCK_D]
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], tl.float32)
    table = block_tables_ptr + seq * stride_bts
    for tile_start in range(start, end, BLOCK_N):
        offs_n = tile_start + tl.arange(0, BLOCK_N)
        n_mask = offs_n < end
        # Masked: entries past the sequence's last block may be -1 and are never dereferenced.
        block_ids = tl.load(table + offs_n // BLOCK_SIZE, mask=n_mask, other=0).to(tl.int64)
        slots = offs_n % BLOCK_SIZE  # [BLOCK_N]
        k = tl.load(
            k_cache_ptr
            + block_ids[None, :] * stride_kb
            + slots[None, :] * stride_kt
            + kv_head * stride_kh
            + offs_d[:, None],
            mask=d_mask[:, None] & n_mask[None, :],
            other=0.0,
        )  # [BLOCK_D, BLOCK_N], K^T
        if UPCAST:
            k = k.to(tl.float32)
        scores = tl.dot(q, k, input_precision="ieee") * qk_scale  # [BLOCK_G, BLOCK_N]
        scores = tl.where(n_mask[None, :], scores, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(scores, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(scores - m_new[:, None])  # [BLOCK_G, BLOCK_N]
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_cache_ptr
            + block_ids[:, None] * stride_vb
            + slots[:, None] * stride_vt
            + kv_head * stride_vh
            + offs_d[None, :],
            mask=n_mask[:, None] & d_mask[None, :],
            other=0.0,
        )  # [BLOCK_N, BLOCK_D]
        if UPCAST:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
        m_i = m_new

    # An empty split (or a seq_len of 0) has l_i == 0: write zeros and a log-sum-exp of -inf.
    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]  # [BLOCK_G, BLOCK_D]
    out_mask = g_mask[:, None] & d_mask[None, :]
    if WRITE_PARTIALS:
        row = (seq * NUM_HEADS + head_ids) * num_splits + split  # [BLOCK_G]
        tl.store(part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=out_mask)
        # l_i is 0 (empty split, m_i = -inf) or >= 1 (the row maximum adds exp2(0) = 1), so
        # the clamp only keeps log2 away from 0 and the log-sum-exp stays exact.
        lse = m_i + tl.log2(tl.maximum(l_i, 1.0))  # [BLOCK_G]
        tl.store(part_lse_ptr + row, lse, mask=g_mask)
        if FUSED_REDUCE:
            # Every thread's partial stores are done (barrier) before one thread's release
            # increment; the split that counts last acquires them all and merges.
            tl.debug_barrier()
            counter = counters_ptr + seq * (NUM_HEADS // GROUP) + kv_head
            arrived = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if arrived == num_splits - 1:
                tl.debug_barrier()
                tl.store(counter, 0)  # zero for the next launch (stream-ordered after this one)
                _merge_splits(part_out_ptr, part_lse_ptr, out_ptr,
                              seq * NUM_HEADS + kv_head * GROUP, num_splits,
                              seq * stride_os + kv_head * GROUP * stride_oh, stride_oh, GROUP,
                              GROUP_P2, HEAD_DIM, BLOCK_D, SPLIT_CHUNK)  # fmt: skip
    else:
        tl.store(
            out_ptr + seq * stride_os + head_ids[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )


@triton.jit
def _merge_splits(part_out_ptr, part_lse_ptr, out_ptr, first_row, num_splits, out_base,
                  stride_oh, GROUP: tl.constexpr, GROUP_P2: tl.constexpr, HEAD_DIM: tl.constexpr,
                  BLOCK_D: tl.constexpr, SPLIT_CHUNK: tl.constexpr):  # fmt: skip
    """Merge the `num_splits` partials of the GQA group's heads (rows `first_row + g`, g <
    GROUP) into the output with log-sum-exp weights, as `_decode_reduce_kernel` does per head:
    `SPLIT_CHUNK` splits per load, with a running maximum, so that up to that many splits
    take one round trip to L2. L1 is bypassed (`.cg`): other programs wrote the partials."""
    offs_g = tl.arange(0, GROUP_P2)
    offs_c = tl.arange(0, SPLIT_CHUNK)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < GROUP
    d_mask = offs_d < HEAD_DIM
    rows = (first_row + offs_g) * num_splits  # [GROUP_P2]: each head's first partial
    m_i = tl.full([GROUP_P2], float("-inf"), tl.float32)
    total = tl.zeros([GROUP_P2], tl.float32)
    acc = tl.zeros([GROUP_P2, BLOCK_D], tl.float32)
    for chunk in range(0, num_splits, SPLIT_CHUNK):
        c_mask = chunk + offs_c < num_splits
        idx = rows[:, None] + chunk + offs_c[None, :]  # [GROUP_P2, SPLIT_CHUNK]
        gc_mask = g_mask[:, None] & c_mask[None, :]
        lse = tl.load(part_lse_ptr + idx, mask=gc_mask, other=float("-inf"), cache_modifier=".cg")
        parts = tl.load(
            part_out_ptr + idx[:, :, None] * HEAD_DIM + offs_d[None, None, :],
            mask=gc_mask[:, :, None] & d_mask[None, None, :],
            other=0.0,
            cache_modifier=".cg",
        )  # [GROUP_P2, SPLIT_CHUNK, BLOCK_D]
        m_new = tl.maximum(m_i, tl.max(lse, 1))
        # Empty splits (seq_len 0) keep -inf: exp2 stays finite, their weights 0.
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        rescale = tl.exp2(m_i - m_safe)  # [GROUP_P2]
        weights = tl.exp2(lse - m_safe[:, None])  # [GROUP_P2, SPLIT_CHUNK]
        total = total * rescale + tl.sum(weights, 1)
        acc = acc * rescale[:, None] + tl.sum(parts * weights[:, :, None], 1)
        m_i = m_new
    out = acc / tl.where(total > 0.0, total, 1.0)[:, None]
    tl.store(out_ptr + out_base + offs_g[:, None] * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=g_mask[:, None] & d_mask[None, :])  # fmt: skip


@triton.jit(do_not_specialize=["num_splits"])
def _decode_reduce_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    num_splits,
    stride_os,
    stride_oh,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_enter(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    s_mask = offs_s < num_splits
    row = (seq * NUM_HEADS + head) * num_splits + offs_s  # [BLOCK_S]
    lse = tl.load(part_lse_ptr + row, mask=s_mask, other=float("-inf"))  # [BLOCK_S], base 2
    lse_max = tl.max(lse, 0)
    # All splits empty (seq_len 0): keep exp2 finite; every weight is then 0 and the output 0.
    lse_max = tl.where(lse_max == float("-inf"), 0.0, lse_max)
    weights = tl.exp2(lse - lse_max)  # [BLOCK_S]
    parts = tl.load(
        part_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=s_mask[:, None] & (offs_d[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    total = tl.sum(weights, 0)
    out = tl.sum(parts * weights[:, None], 0) / tl.where(total > 0.0, total, 1.0)  # [BLOCK_D]
    tl.store(
        out_ptr + seq * stride_os + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=offs_d < HEAD_DIM,
    )


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_context: int, num_sms: int) -> int:
    """Number of split-K partitions for one decode launch.

    As many (sequence, kv head, split) programs as fit `_PROGRAMS_PER_SM` per SM, rounded down
    so that the launch is one wave rather than one and a fraction; no split shorter than
    `_MIN_SPLIT_TOKENS` tokens of `max_context`, and at most `_MAX_SPLITS`. Batches that
    already fill the GPU get 1 (no partials, no reduce).

    Args:
        num_seqs: Sequences in the batch.
        num_kv_heads: KV heads (programs per sequence before splitting).
        max_context: Upper bound on any sequence's context length in tokens.
        num_sms: Streaming multiprocessors of the device (132 on an H200).
    """
    num_programs = max(num_seqs * num_kv_heads, 1)
    wanted = _PROGRAMS_PER_SM * num_sms // num_programs
    useful = cdiv(max(max_context, 1), _MIN_SPLIT_TOKENS)
    return max(1, min(wanted, useful, _MAX_SPLITS))


def _check_args(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
) -> None:
    check_paged_attention(
        query,
        "[num_seqs, num_heads, head_dim]",
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        num_seqs=query.shape[0],
    )


def _launch(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor,
    num_splits: int,
    block_n: int,
    num_warps: int,
    num_stages: int,
    pdl: bool,
    split_counters: torch.Tensor | None,
) -> None:
    """Allocate the split-K partials (if any) and launch the split kernel, and the reduce
    kernel unless the splits merge their partials themselves (`split_counters`)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    # The interpreter multiplies bf16 bit patterns in tl.dot (triton#11584): upcast there.
    upcast = runs_in_interpreter(query) and query.dtype == torch.bfloat16
    write_partials = num_splits > 1
    if write_partials:
        part_out = torch.empty(
            (num_seqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device
        )  # [S, H, splits, D]
        part_lse = torch.empty(
            (num_seqs, num_heads, num_splits), dtype=torch.float32, device=query.device
        )  # [S, H, splits]
    else:
        part_out = part_lse = out  # unused: the kernel writes `out` directly
    fused = write_partials and split_counters is not None
    counters = split_counters if fused else seq_lens  # unused without the fused merge
    block_d = max(next_power_of_2(head_dim), 16)
    _decode_attention_kernel[(num_seqs, num_kv_heads, num_splits)](
        query, key_cache, value_cache, block_tables, seq_lens, out, part_out, part_lse,
        counters, scale * _LOG2E, num_splits,
        query.stride(0), query.stride(1),
        *key_cache.stride()[:3], *value_cache.stride()[:3],
        block_tables.stride(0), out.stride(0), out.stride(1),
        NUM_HEADS=num_heads, GROUP=group, BLOCK_G=max(next_power_of_2(group), 16),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_SIZE=block_size, BLOCK_N=block_n,
        WRITE_PARTIALS=write_partials, FUSED_REDUCE=fused, GROUP_P2=next_power_of_2(group),
        SPLIT_CHUNK=min(8, next_power_of_2(num_splits)), UPCAST=upcast, PDL=pdl,
        num_warps=num_warps, num_stages=num_stages, launch_pdl=pdl,
    )  # fmt: skip
    if write_partials and not fused:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_out, part_lse, out, num_splits, out.stride(0), out.stride(1),
            NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=block_d,
            BLOCK_S=next_power_of_2(num_splits), PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip


def decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
    *,
    num_splits: int | None = None,
    max_seq_len: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    out: torch.Tensor | None = None,
    pdl: bool = False,
    split_counters: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new token per sequence over its paged context (see `decode_attention_ref`).

    Host-sync free and shape-deterministic (same launches and allocations for the same shapes and
    hints), so it can be captured in a CUDA graph.

    Args:
        query: One query token per sequence, fp32/fp16/bf16; last dimension contiguous.
        key_cache: Paged keys, same dtype as `query`.
        value_cache: Paged values, same dtype and shape as `key_cache`.
        block_tables: Cache block ids of each sequence; entries past its end are never read.
        seq_lens: Context length of each sequence, including the new token (whose K/V must
            already be in the cache). 0 marks a padding row, whose output is zeros.
        scale: Softmax scale, usually `head_dim ** -0.5`.
        num_splits: Split-K partitions (keyword-only). None picks them with `choose_num_splits`
            from the batch, the SM count and the context bound.
        max_seq_len: Optional host-side upper bound on `seq_lens` (a Python int, never read from
            the device), only used to pick `num_splits`; defaults to the block-table capacity.
        block_n: Tokens per K/V tile (power of two >= 16); None picks one per dtype.
        num_warps: Warps per program of the split kernel; None picks 4.
        num_stages: Software-pipelining depth of the K/V loads; None picks one per dtype.
        out: Optional preallocated contiguous output, `query`'s shape and dtype.
        pdl: Launch with programmatic dependent launch (`kernels/_pdl.py`; sm_90+).
        split_counters: int32 zeros, contiguous, at least `num_seqs * num_kv_heads` of them,
            owned by the caller and left zero by every call; with them the last split of each
            (sequence, kv head) to finish merges the partials (an atomic count), and the reduce
            kernel is not launched. Calls sharing them must not overlap (one stream).

    Returns:
        The attention output, `query`'s shape and dtype (`out` when given).
    """
    _check_args(query, key_cache, value_cache, block_tables, seq_lens)
    num_seqs = query.shape[0]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    if out is None:
        out = torch.empty_like(query, memory_format=torch.contiguous_format)
    check_out("out", out, tuple(query.shape), query.dtype, query.device)
    if block_n is None:
        block_n = 32 if query.dtype == torch.float32 else 64
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"block_n must be a power of two >= 16, got {block_n}")
    if num_splits is None:
        max_context = max_seq_len or block_tables.shape[1] * block_size
        num_splits = choose_num_splits(num_seqs, num_kv_heads, max_context, num_sms(query.device))
    if not 1 <= num_splits <= 1024:
        raise ValueError(f"num_splits must be in [1, 1024], got {num_splits}")
    check_pdl(pdl, query)
    if split_counters is not None:
        check_dtype("split_counters", split_counters, (torch.int32,))
        check_contiguous("split_counters", split_counters)
        check_same_device(query=query, split_counters=split_counters)
        if split_counters.numel() < num_seqs * num_kv_heads:
            raise ValueError(
                f"split_counters holds {split_counters.numel()} counters; "
                f"{num_seqs} sequences x {num_kv_heads} kv heads need {num_seqs * num_kv_heads}"
            )
    if num_seqs == 0:
        return out

    num_stages = num_stages or (2 if query.dtype == torch.float32 else 3)
    _launch(query, key_cache, value_cache, block_tables, seq_lens, scale, out, num_splits, block_n,
            num_warps or 4, num_stages, pdl, split_counters)  # fmt: skip
    return out
