"""Paged attention for one layer, over a cache that already holds the step's K/V (the model
writes them with its rotary embedding, `KernelSet.rotary_and_cache`).

The batch is ragged: decodes (one query token each) come first, then prompt chunks. Decodes go
to the decode kernel, chunks to the prefill kernel; both read every key from the paged cache
(`sitsd.kernels.reference` documents the layout). The runner builds `AttentionMetadata` once
per step on the host and copies it to the device in one go; every layer reuses it.

A *unified* batch (`AttentionMetadata.unified`, the mixed-step CUDA graphs of
`sitsd.runtime.mixed_graphs`) sends every sequence, decodes included, through one prefill-kernel
call over metadata padded to fixed shapes: the launch then depends on shapes alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sitsd.model.ops import KernelSet


@dataclass
class AttentionMetadata:
    """Where each token's K/V goes and what each sequence attends to, for one step."""

    slot_mapping: torch.Tensor  # [num_tokens] int64; -1 = padding, not written
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32, context incl. this step's tokens
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, from the first prefill
    num_decodes: int  # leading sequences with exactly one query token
    num_decode_tokens: int  # == num_decodes
    max_seq_len: int  # host-side hint for kernels that size their grid by it
    # True: one prefill-kernel call over all sequences (`query_start_loc`), decodes included;
    # padding sequences are empty and padding tokens belong to none (their output is unset).
    unified: bool = False


def paged_attention(
    kernels: KernelSet,
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv_cache: tuple[torch.Tensor, torch.Tensor],  # 2 x [num_blocks, block_size, Hkv, D]
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    key_cache, value_cache = kv_cache
    num_tokens = query.shape[0]
    nd = meta.num_decode_tokens
    if nd == num_tokens and not meta.unified:
        return kernels.decode_attention(
            query, key_cache, value_cache, meta.block_tables, meta.seq_lens, scale
        )
    if nd == 0 or meta.unified:  # one prefill-kernel call over every sequence
        return kernels.prefill_attention(
            query,
            key_cache,
            value_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc if meta.unified else meta.prefill_query_start_loc,
            scale,
        )
    out = torch.empty_like(query)
    out[:nd] = kernels.decode_attention(
        query[:nd], key_cache, value_cache, meta.block_tables[:nd], meta.seq_lens[:nd], scale
    )
    out[nd:] = kernels.prefill_attention(
        query[nd:],
        key_cache,
        value_cache,
        meta.block_tables[meta.num_decodes :],
        meta.seq_lens[meta.num_decodes :],
        meta.prefill_query_start_loc,
        scale,
    )
    return out
