"""Plain-PyTorch references for every sitsd kernel.

These define what each Triton kernel in this folder computes (`rotary_embedding_ref` and
`reshape_and_cache_ref` the two halves of `rotary_and_cache`), and they are what the runtime
runs on the CPU. They favour clarity over speed, but stay vectorised where a loop would make the
CPU path unusable (decode attention over a batch).

Paged KV layout, shared by every kernel:
    key_cache, value_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: [num_tokens] int64, slot = block_id * block_size + offset; -1 = do not write
    block_tables: [num_seqs, max_blocks_per_seq] int32; entries past a sequence's last block are
        never read (they may hold anything, including -1)
    seq_lens: [num_seqs] int32, the context length of each sequence *including* the tokens of
        this step (their K/V are written to the cache before attention runs)
    query_start_loc: [num_seqs + 1] int32, prefix sums of the query lengths (ragged batch)

Attention reads every key, the current step's too, from the paged cache, so decode, chunked
prefill and prefill with a cached prefix are one computation: query token j of a sequence with
`q_len` new tokens sits at position `seq_len - q_len + j` and attends to keys 0..that position.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = [
    "compute_cos_sin_cache",
    "decode_attention_ref",
    "fused_add_rms_norm_ref",
    "gemv_ref",
    "norm_gemv_ref",
    "prefill_attention_ref",
    "reshape_and_cache_ref",
    "rms_norm_ref",
    "rotary_and_cache_ref",
    "rotary_embedding_ref",
    "silu_and_mul_ref",
]


# ---------------------------------------------------------------------------------------------
# KV cache write
# ---------------------------------------------------------------------------------------------


def reshape_and_cache_ref(
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> None:
    """Write each token's K/V into its slot of the paged cache, in place."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep]
    num_blocks, block_size = key_cache.shape[:2]
    key_cache.view(num_blocks * block_size, *key_cache.shape[2:])[slots] = key[keep].to(
        key_cache.dtype
    )
    value_cache.view(num_blocks * block_size, *value_cache.shape[2:])[slots] = value[keep].to(
        value_cache.dtype
    )


# ---------------------------------------------------------------------------------------------
# Attention over the paged cache
# ---------------------------------------------------------------------------------------------


def _gather_context(
    cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks_used] int32
    seq_len: int,
) -> torch.Tensor:  # [seq_len, num_kv_heads, head_dim]
    num_blocks_used = -(-seq_len // cache.shape[1])
    blocks = cache[block_table[:num_blocks_used].long()]
    return blocks.reshape(-1, *cache.shape[2:])[:seq_len]


def decode_attention_ref(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one token per sequence
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one new token per sequence over its whole paged context (GQA aware)."""
    num_seqs, num_heads, head_dim = query.shape
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    group = num_heads // num_kv_heads
    max_len = int(seq_lens.max())
    num_blocks_used = -(-max_len // block_size)
    # Entries past a sequence's length may hold garbage ids: clamp so the gather stays in
    # bounds, then mask those positions out below.
    table = block_tables[:, :num_blocks_used].long().clamp(0, key_cache.shape[0] - 1)
    keys = key_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    values = value_cache[table].reshape(num_seqs, -1, num_kv_heads, head_dim)[:, :max_len]
    q = query.float().view(num_seqs, num_kv_heads, group, head_dim)  # [S, Hkv, G, D]
    scores = torch.einsum("skgd,slkd->skgl", q, keys.float()) * scale  # [S, Hkv, G, L]
    positions = torch.arange(max_len, device=query.device)
    masked = positions[None, :] >= seq_lens[:, None].to(positions.device)  # [S, L]
    scores.masked_fill_(masked[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("skgl,slkd->skgd", probs, values.float())
    return out.reshape(num_seqs, num_heads, head_dim).to(query.dtype)


def prefill_attention_ref(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim], ragged over sequences
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [num_seqs, max_blocks_per_seq] int32
    seq_lens: torch.Tensor,  # [num_seqs] int32, context incl. this chunk
    query_start_loc: torch.Tensor,  # [num_seqs + 1] int32
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """Causal attention of a ragged batch of prompt chunks, each over its cached prefix too."""
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    lens = seq_lens.tolist()
    for i, seq_len in enumerate(lens):
        q_start, q_end = starts[i], starts[i + 1]
        q_len = q_end - q_start
        if q_len == 0:
            continue
        keys = _gather_context(key_cache, block_tables[i], seq_len)  # [L, Hkv, D]
        values = _gather_context(value_cache, block_tables[i], seq_len)
        q = query[q_start:q_end].float().transpose(0, 1)  # [H, q_len, D]
        k = keys.float().transpose(0, 1)  # [Hkv, L, D]
        v = values.float().transpose(0, 1)
        q_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)
        k_pos = torch.arange(seq_len, device=query.device)
        mask = k_pos[None, :] <= q_pos[:, None]  # [q_len, L]
        o = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, scale=scale, enable_gqa=True
        )  # [H, q_len, D]
        out[q_start:q_end] = o.transpose(0, 1).to(query.dtype)
    return out


# ---------------------------------------------------------------------------------------------
# Norms, rotary embedding, activation
# ---------------------------------------------------------------------------------------------


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm in float32, cast back to the input dtype (as Hugging Face's LlamaRMSNorm)."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def fused_add_rms_norm_ref(
    x: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor,  # [num_tokens, hidden]
    weight: torch.Tensor,  # [hidden]
    eps: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`residual = x + residual; return rms_norm(residual), residual`."""
    residual = x + residual
    return rms_norm_ref(residual, weight, eps), residual


def norm_gemv_ref(
    hidden: torch.Tensor,  # [num_tokens, hidden]
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,  # [hidden]
    eps: float,
    weight: torch.Tensor,  # [N, hidden]
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm linear layer: `fused_add_rms_norm_ref` (`rms_norm_ref` without a residual,
    which is then `hidden` itself), then `x @ weight.T` in float32 rounded to the dtype;
    returns `(out, residual)`."""
    if residual is None:
        x, residual = rms_norm_ref(hidden, norm_weight, eps), hidden
    else:
        x, residual = fused_add_rms_norm_ref(hidden, residual, norm_weight, eps)
    return (x.float() @ weight.float().T).to(hidden.dtype), residual


def compute_cos_sin_cache(
    head_dim: int,
    max_position: int,
    theta: float,
    rope_scaling: dict | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:  # [max_position, head_dim]: cos in the first half, sin in the second
    """Rotary tables; Llama-3 or linear frequency scaling as `rope_scaling['rope_type']` says."""
    # float32 throughout, as Hugging Face computes it, so logits match transformers bit for bit.
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "llama3":
        inv_freq = _llama3_scale(inv_freq, rope_scaling)
    elif rope_scaling and rope_scaling.get("rope_type", rope_scaling.get("type")) == "linear":
        inv_freq = inv_freq / float(rope_scaling["factor"])
    t = torch.arange(max_position, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq)  # [max_position, head_dim / 2]
    return torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(dtype)


def _llama3_scale(inv_freq: torch.Tensor, cfg: dict) -> torch.Tensor:
    factor = float(cfg["factor"])
    low_freq_factor = float(cfg.get("low_freq_factor", 1.0))
    high_freq_factor = float(cfg.get("high_freq_factor", 4.0))
    old_context_len = float(cfg.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def rotary_embedding_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate-half (GPT-NeoX / Hugging Face Llama) rotary embedding; returns new tensors."""
    half = cos_sin_cache.shape[-1] // 2
    cos_sin = cos_sin_cache[positions]  # [num_tokens, head_dim]
    cos = cos_sin[:, None, :half].float()
    sin = cos_sin[:, None, half:].float()

    def rotate(x: torch.Tensor) -> torch.Tensor:
        x1, x2 = x[..., :half].float(), x[..., half:].float()
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)

    return rotate(query), rotate(key)


def rotary_and_cache_ref(
    positions: torch.Tensor,  # [num_tokens] int64
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    cos_sin_cache: torch.Tensor,  # [max_position, head_dim]
    key_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,  # [num_tokens] int64, -1 = skip
) -> tuple[torch.Tensor, torch.Tensor]:
    """`rotary_embedding_ref`, then `reshape_and_cache_ref` of the rotated keys and the values;
    returns the rotated (new) query and key tensors."""
    query, key = rotary_embedding_ref(positions, query, key, cos_sin_cache)
    reshape_and_cache_ref(key, value, key_cache, value_cache, slot_mapping)
    return query, key


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`silu(x[..., :d]) * x[..., d:]` for the fused gate/up projection output of width 2d."""
    d = x.shape[-1] // 2
    return F.silu(x[..., :d]) * x[..., d:]


# ---------------------------------------------------------------------------------------------
# Linear layers at decode batch sizes
# ---------------------------------------------------------------------------------------------


def gemv_ref(
    x: torch.Tensor,  # [M, K], or [M, 2K] (fused gate | up) with swiglu
    weight: torch.Tensor,  # [N, K]
    *,
    swiglu: bool = False,
) -> torch.Tensor:  # [M, N]
    """`x @ weight.T` in float32, rounded to x's dtype; with `swiglu`, on `silu_and_mul_ref(x)`."""
    if swiglu:
        x = silu_and_mul_ref(x)
    return (x.float() @ weight.float().T).to(x.dtype)
