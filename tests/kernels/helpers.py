"""Helpers for the kernel tests: paged K/V caches with holes and poison, and error checks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

# Allowed error per dtype: elementwise |out - ref| <= atol + rtol * |ref| (a few ulps of the
# dtype), and ||out - ref|| / ||ref|| <= rel_norm. fp32 leaves room for another summation order;
# fp16/bf16 for one rounding of P before the PV product and for the interpreter truncating
# fp32 -> bf16 casts where the GPU rounds them.
TOLERANCES = {  # dtype: (atol, rtol, rel_norm)
    torch.float32: (1e-5, 1e-4, 2e-5),
    torch.float16: (5e-3, 5e-3, 2e-3),
    torch.bfloat16: (4e-2, 2e-2, 1.6e-2),
}


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, scale: float = 1.0):
    """Assert `out` matches `ref` within `TOLERANCES[dtype]` (times `scale`), NaN-free."""
    assert out.shape == ref.shape, f"shape {tuple(out.shape)} != {tuple(ref.shape)}"
    assert out.dtype == ref.dtype, f"dtype {out.dtype} != {ref.dtype}"
    outf, reff = out.double(), ref.double()
    assert torch.isfinite(outf).all(), f"{(~torch.isfinite(outf)).sum()} non-finite elements"
    atol, rtol, rel_norm_tol = (tol * scale for tol in TOLERANCES[dtype])
    diff = (outf - reff).abs()
    worst = (diff / (atol + rtol * reff.abs())).max().item() if out.numel() else 0.0
    rel_norm = ((outf - reff).norm() / reff.norm().clamp_min(1e-30)).item()
    summary = (
        f"{dtype}: max abs diff {diff.max().item():.3e}, worst element at {worst:.2f}x "
        f"(atol {atol:.1e} + rtol {rtol:.1e} * |ref|), relative norm {rel_norm:.3e} "
        f"(tol {rel_norm_tol:.1e})"
    )
    assert worst <= 1.0, summary
    assert rel_norm <= rel_norm_tol, summary


@dataclass
class PagedKV:
    """A paged K/V cache holding random contexts, with NaN wherever no sequence owns a slot."""

    key_cache: torch.Tensor  # [num_blocks, block_size, num_kv_heads, head_dim], poisoned
    value_cache: torch.Tensor
    clean_key_cache: torch.Tensor  # same values, finite everywhere: for the references
    clean_value_cache: torch.Tensor
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, -1 past each end
    seq_lens: torch.Tensor  # [num_seqs] int32


def make_paged_kv(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    num_spare_blocks: int = 3,
    extra_table_columns: int = 2,
) -> PagedKV:
    """Random contexts of `seq_lens` tokens in shuffled, non-contiguous blocks.

    Block ids are a random permutation (so neighbouring blocks of a sequence are far apart),
    spare blocks belong to no one, table entries past a sequence's last block are -1, and every
    slot no sequence owns (spare blocks, the tail of each last block) holds NaN in the caches
    given to kernels: a kernel that reads past a context's end produces NaN and fails.
    """
    num_blocks_per_seq = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(num_blocks_per_seq) + num_spare_blocks
    width = max(num_blocks_per_seq, default=0) + extra_table_columns
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    clean_k = torch.randn(shape, device=device).to(dtype)
    clean_v = torch.randn(shape, device=device).to(dtype)
    owned = torch.zeros(num_blocks, block_size, dtype=torch.bool, device=device)
    block_tables = torch.full((len(seq_lens), width), -1, dtype=torch.int32)
    block_ids = torch.randperm(num_blocks)
    next_block = 0
    for seq, seq_len in enumerate(seq_lens):
        ids = block_ids[next_block : next_block + num_blocks_per_seq[seq]]
        next_block += len(ids)
        block_tables[seq, : len(ids)] = ids.to(torch.int32)
        slots = (ids[:, None] * block_size + torch.arange(block_size)).view(-1)[:seq_len]
        owned.view(-1)[slots.to(device)] = True
    key_cache = clean_k.masked_fill(~owned[:, :, None, None], float("nan"))
    value_cache = clean_v.masked_fill(~owned[:, :, None, None], float("nan"))
    return PagedKV(
        key_cache=key_cache,
        value_cache=value_cache,
        clean_key_cache=clean_k,
        clean_value_cache=clean_v,
        block_tables=block_tables.to(device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
    )
