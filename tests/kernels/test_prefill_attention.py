"""prefill_attention (Triton) against prefill_attention_ref: ragged chunks, cached prefixes, GQA."""

from __future__ import annotations

import random

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.prefill_attention import prefill_attention
from sitsd.kernels.reference import prefill_attention_ref
from tests.kernels.helpers import assert_close, make_paged_kv


def _run_and_check(
    chunks: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
    **kwargs,
) -> None:
    """`chunks` holds (query length, cached prefix length) per sequence."""
    seq_lens = [q_len + prefix_len for q_len, prefix_len in chunks]
    kv = make_paged_kv(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    q_lens = torch.tensor([0] + [q_len for q_len, _ in chunks])
    query_start_loc = q_lens.cumsum(0).to(torch.int32).to(device)
    num_tokens = int(q_lens.sum())
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    result = prefill_attention(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.seq_lens,
        query_start_loc,
        scale,
        out=out,
        **kwargs,
    )
    assert result is out
    ref = prefill_attention_ref(
        query,
        kv.clean_key_cache,
        kv.clean_value_cache,
        kv.block_tables,
        kv.seq_lens,
        query_start_loc,
        scale,
    )
    assert_close(out, ref, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference_over_gqa_and_head_dims(dtype, group, head_dim, device):
    # Odd chunk sizes 1, 7, 33; fresh prompts and chunks after a cached prefix, ragged.
    chunks = [(1, 0), (7, random.randint(1, 40)), (33, 0), (1, random.randint(1, 30))]
    random.shuffle(chunks)
    _run_and_check(
        chunks, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, device=device
    )


def test_bf16_matches_reference(device):
    _run_and_check(
        [(9, 20), (33, 0)],
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.bfloat16,
        device=device,
    )


def test_empty_chunks_in_the_batch_are_skipped(device):
    # A sequence with no query tokens this step (e.g. a finished prefill) owns no rows.
    _run_and_check(
        [(0, 12), (5, 3), (0, 40), (11, 0)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
    )


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 16), (64, 32), (32, 64)])
def test_tile_shapes_match_reference(block_m, block_n, device):
    # Long enough to span several query blocks and key tiles (diagonal and full tiles).
    _run_and_check(
        [(random.randint(40, 70), random.randint(0, 50)), (17, 0)],
        num_kv_heads=1,
        group=4,
        head_dim=64,
        dtype=torch.float16,
        device=device,
        block_m=block_m,
        block_n=block_n,
    )


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes_match_reference(block_size, device):
    _run_and_check(
        [(13, 21), (6, 0)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        block_size=block_size,
    )


def test_group_and_head_dim_not_powers_of_two_match_reference(device):
    # SmolLM2-135M: 9 query heads over 3 kv heads (rows of a block not filling BLOCK_M).
    _run_and_check(
        [(20, 5), (3, 0)],
        num_kv_heads=3,
        group=3,
        head_dim=80,
        dtype=torch.float16,
        device=device,
    )


def test_strided_query_view_matches_reference(device):
    kv = make_paged_kv(
        [9, 4], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    qkv = torch.randn(13, 4 + 2 * 2, 64, device=device).half()  # [T, H + 2 Hkv, D]
    query = qkv[:, :4]
    qsl = torch.tensor([0, 9, 13], dtype=torch.int32, device=device)
    args = (kv.block_tables, kv.seq_lens, qsl, 0.125)
    out = prefill_attention(query, kv.key_cache, kv.value_cache, *args)
    ref = prefill_attention_ref(query, kv.clean_key_cache, kv.clean_value_cache, *args)
    assert_close(out, ref, torch.float16)


def _run_padded_and_check(
    chunks: list[tuple[int, int]],
    *,
    num_tokens: int,
    num_seqs: int,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
) -> None:
    """`chunks` laid out as a mixed-step CUDA graph lays them out: `num_tokens` query rows and
    `num_seqs` sequences, the real ones first; then checked on the real rows only."""
    seq_lens = [q_len + prefix_len for q_len, prefix_len in chunks]
    kv = make_paged_kv(
        seq_lens, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=16, dtype=dtype,
        device=device,
    )  # fmt: skip
    q_lens = torch.tensor([0] + [q_len for q_len, _ in chunks])
    qsl = q_lens.cumsum(0).to(torch.int32)
    real_tokens, real_seqs = int(qsl[-1]), len(chunks)
    assert real_tokens <= num_tokens
    assert real_seqs <= num_seqs
    query = torch.randn(num_tokens, num_kv_heads * group, head_dim, device=device).to(dtype)
    # Padding: empty sequences (query_start_loc repeats the real total), seq_len 0, and a
    # block-table row of -1 (no kernel may read it).
    padded_qsl = torch.full((num_seqs + 1,), real_tokens, dtype=torch.int32)
    padded_qsl[: real_seqs + 1] = qsl
    padded_lens = torch.zeros(num_seqs, dtype=torch.int32, device=device)
    padded_lens[:real_seqs] = kv.seq_lens
    padded_tables = torch.full(
        (num_seqs, kv.block_tables.shape[1]), -1, dtype=torch.int32, device=device
    )
    padded_tables[:real_seqs] = kv.block_tables
    out = torch.full_like(query, float("nan"))
    scale = head_dim**-0.5
    prefill_attention(
        query, kv.key_cache, kv.value_cache, padded_tables, padded_lens,
        padded_qsl.to(device), scale, out=out,
    )  # fmt: skip
    ref = prefill_attention_ref(
        query[:real_tokens], kv.clean_key_cache, kv.clean_value_cache, kv.block_tables,
        kv.seq_lens, qsl.to(device), scale,
    )  # fmt: skip
    assert_close(out[:real_tokens], ref, dtype)
    assert out[real_tokens:].isnan().all(), "a padding row was written"


@pytest.mark.parametrize("group", [1, 4])
def test_a_batch_padded_to_a_fixed_grid_matches_reference_on_its_real_tokens(group, device):
    # Decodes (one query token over a context) and prompt chunks (fresh, after a cached
    # prefix) in one launch, padded with empty sequences and padding tokens; the real total
    # lands below, at, or one under the padded token count.
    chunks = [(1, random.randint(1, 40)) for _ in range(random.randint(1, 3))]
    chunks += [(random.randint(2, 20), random.randint(0, 30)), (random.randint(1, 9), 0)]
    random.shuffle(chunks)
    real_tokens = sum(q for q, _ in chunks)
    for num_tokens in (real_tokens, real_tokens + 1, 2 * real_tokens + 5):
        _run_padded_and_check(
            chunks, num_tokens=num_tokens, num_seqs=len(chunks) + random.randint(0, 4),
            num_kv_heads=2, group=group, head_dim=32, dtype=torch.float32, device=device,
        )  # fmt: skip


def test_a_single_sequence_padded_to_many_empty_ones_matches_reference(device):
    _run_padded_and_check(
        [(random.randint(1, 30), random.randint(0, 20))], num_tokens=32, num_seqs=8,
        num_kv_heads=1, group=4, head_dim=32, dtype=torch.float16, device=device,
    )  # fmt: skip


def _valid_inputs(device):
    kv = make_paged_kv(
        [3, 9], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    query = torch.randn(5, 4, 64, device=device).half()
    qsl = torch.tensor([0, 3, 5], dtype=torch.int32, device=device)
    return [query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, qsl, 0.125]


@pytest.mark.parametrize(
    ("index", "bad", "error", "match"),
    [
        (0, lambda q: q.bfloat16(), TypeError, "dtypes must match"),
        (0, lambda q: q[:, :3], ValueError, "not a multiple of num_kv_heads"),
        (0, lambda q: q[:, :, :16], ValueError, "head_dim differs"),
        (1, lambda k: k[0], ValueError, r"key_cache must be \[num_blocks"),
        (3, lambda t: t[:1], ValueError, "block_tables has 1 rows for 2 seqs"),
        (4, lambda s: s.long(), TypeError, "seq_lens must have dtype"),
        (5, lambda s: s[:2], ValueError, r"query_start_loc must have shape \[num_seqs \+ 1\]"),
        (5, lambda s: s.long(), TypeError, "query_start_loc must have dtype"),
    ],
)
def test_wrapper_rejects_bad_arguments_with_clear_errors(index, bad, error, match, device):
    args = _valid_inputs(device)
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        prefill_attention(*args)


def test_wrapper_rejects_bad_tiles_and_out(device):
    args = _valid_inputs(device)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        prefill_attention(*args, block_n=48)
    with pytest.raises(ValueError, match="out must be"):
        prefill_attention(*args, out=torch.empty(4, 4, 64, device=device).half())


# --------------------------------------------------------------------------------------------
# GPU grid
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_grid_matches_reference(dtype, group, head_dim, device):
    # Whole prompts, chunks after long cached prefixes (to 8k context), decode-like 1-token
    # chunks, odd sizes, and a batch of 64 short ragged chunks.
    chunks = [(1, 0), (7, 0), (33, 4000), (1000, 0), (511, 7681), (1, 8191), (2048, 1024)]
    _run_and_check(
        chunks, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, device=device
    )
    many = [(random.randint(0, 100), random.randint(0, 300)) for _ in range(64)]
    _run_and_check(many, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, device=device)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_gpu_padded_mixed_batches_match_reference(dtype, group, device):
    # Mixed-step graph buckets at Llama-3-8B-like sizes: 32 decodes + one 480-token chunk in
    # the 512 bucket with 256 sequence slots; a 512-token prompt alone; a tiny step in 16.
    decodes = [(1, random.randint(1, 4000)) for _ in range(32)]
    cases = [
        ([*decodes, (480, random.randint(0, 2000))], 512, 256),
        ([(512, 0)], 512, 256),
        ([(1, 100), (9, 7), (3, 0)], 16, 256),
        ([(random.randint(1, 50), random.randint(0, 500)) for _ in range(40)], 2048, 64),
    ]
    for chunks, num_tokens, num_seqs in cases:
        _run_padded_and_check(
            chunks, num_tokens=num_tokens, num_seqs=num_seqs, num_kv_heads=8, group=group,
            head_dim=128, dtype=dtype, device=device,
        )  # fmt: skip
