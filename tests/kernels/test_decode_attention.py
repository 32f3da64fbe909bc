"""decode_attention (Triton) against decode_attention_ref: GQA, paged holes, split-K, checks."""

from __future__ import annotations

import random

import pytest
import torch
import triton  # noqa: F401  (make test installs it: no kernel test may skip for want of it)

from sitsd.kernels.decode_attention import choose_num_splits, decode_attention
from sitsd.kernels.reference import decode_attention_ref
from tests.kernels.helpers import assert_close, make_paged_kv


def _run_and_check(
    seq_lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    head_dim: int,
    dtype: torch.dtype,
    device: torch.device,
    block_size: int = 16,
    **kwargs,
) -> torch.Tensor:
    kv = make_paged_kv(
        seq_lens,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        block_size=block_size,
        dtype=dtype,
        device=device,
    )
    query = torch.randn(len(seq_lens), num_kv_heads * group, head_dim, device=device).to(dtype)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    result = decode_attention(
        query,
        kv.key_cache,
        kv.value_cache,
        kv.block_tables,
        kv.seq_lens,
        scale,
        out=out,
        **kwargs,
    )
    assert result is out
    ref = decode_attention_ref(
        query, kv.clean_key_cache, kv.clean_value_cache, kv.block_tables, kv.seq_lens, scale
    )
    assert_close(out, ref, dtype)
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_matches_reference_over_gqa_and_head_dims(dtype, group, head_dim, device):
    # 1 token, under one block, several blocks, and a length that ends mid-block.
    seq_lens = [1, 7, 33, random.randint(40, 90)]
    _run_and_check(
        seq_lens,
        num_kv_heads=2,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        num_splits=1,
    )


@pytest.mark.parametrize("num_splits", [2, 3, 8])
def test_split_k_matches_reference_for_long_contexts(num_splits, device):
    # Splits shorter than a tile, uneven splits, and splits left empty for the short sequences.
    seq_lens = [random.randint(600, 700), 1, 20]
    _run_and_check(
        seq_lens,
        num_kv_heads=1,
        group=4,
        head_dim=64,
        dtype=torch.float16,
        device=device,
        num_splits=num_splits,
    )


@pytest.mark.parametrize(("num_splits", "group"), [(2, 4), (3, 4), (8, 1), (12, 3)])
def test_fused_split_merge_matches_reference_and_leaves_its_counters_zero(
    num_splits, group, device
):
    # The last split of each (sequence, kv head) merges the partials: no reduce launch; 12
    # splits take two chunks of the merge's loads.
    counters = torch.zeros(3 * 2 + 5, dtype=torch.int32, device=device)  # room to spare
    for _ in range(2):  # the counters serve the next call as they were left
        _run_and_check(
            [random.randint(600, 700), 1, 20],
            num_kv_heads=2,
            group=group,
            head_dim=64,
            dtype=torch.float16,
            device=device,
            num_splits=num_splits,
            split_counters=counters,
        )
        assert not counters.any()


def test_split_counters_are_checked(device):
    kv = make_paged_kv([40, 9], num_kv_heads=2, head_dim=64, block_size=16,
                       dtype=torch.float32, device=device)  # fmt: skip
    query = torch.randn(2, 4, 64, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125)
    with pytest.raises(ValueError, match="2 sequences x 2 kv heads need 4"):
        decode_attention(
            *args, num_splits=2, split_counters=torch.zeros(3, dtype=torch.int32, device=device)
        )
    with pytest.raises(TypeError, match="split_counters must have dtype"):
        decode_attention(*args, num_splits=2, split_counters=torch.zeros(4, device=device))


def test_automatic_split_count_matches_reference(device):
    _run_and_check(
        [random.randint(300, 400)],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        max_seq_len=400,
    )


def test_bf16_matches_reference(device):
    _run_and_check(
        [1, 30, 77],
        num_kv_heads=2,
        group=4,
        head_dim=64,
        dtype=torch.bfloat16,
        device=device,
        num_splits=2,
    )


@pytest.mark.parametrize("block_size", [1, 8, 32])
def test_other_block_sizes_match_reference(block_size, device):
    _run_and_check(
        [1, 5, 70],
        num_kv_heads=2,
        group=2,
        head_dim=64,
        dtype=torch.float32,
        device=device,
        block_size=block_size,
        num_splits=2,
    )


def test_group_and_head_dim_not_powers_of_two_match_reference(device):
    # SmolLM2-135M: 9 query heads over 3 kv heads; head_dim 80 exercises the masked tail.
    _run_and_check(
        [3, 45],
        num_kv_heads=3,
        group=3,
        head_dim=80,
        dtype=torch.float16,
        device=device,
        num_splits=2,
    )


def test_padding_rows_with_zero_length_give_zeros(device):
    kv = make_paged_kv(
        [19, 0], num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32, device=device
    )
    query = torch.randn(2, 2, 64, device=device)
    for num_splits in (1, 3):
        out = decode_attention(
            query,
            kv.key_cache,
            kv.value_cache,
            kv.block_tables,
            kv.seq_lens,
            0.125,
            num_splits=num_splits,
        )
        ref = decode_attention_ref(
            query[:1],
            kv.clean_key_cache,
            kv.clean_value_cache,
            kv.block_tables[:1],
            kv.seq_lens[:1],
            0.125,
        )
        assert_close(out[:1], ref, torch.float32)
        assert torch.equal(out[1], torch.zeros_like(out[1]))


def test_strided_query_view_matches_reference(device):
    kv = make_paged_kv(
        [5, 40], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    qkv = torch.randn(2, 8 + 2 * 2, 64, device=device).half()  # [S, H + 2 Hkv, D]
    query = qkv[:, :8]  # non-contiguous rows, as sliced from a fused projection
    out = decode_attention(query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.1)
    ref = decode_attention_ref(
        query, kv.clean_key_cache, kv.clean_value_cache, kv.block_tables, kv.seq_lens, 0.1
    )
    assert_close(out, ref, torch.float16)


def test_choose_num_splits_fills_the_gpu_only_when_the_batch_does_not():
    assert choose_num_splits(1, 8, 8192, num_sms=132) > 16  # batch 1, long: many splits
    assert choose_num_splits(128, 8, 8192, num_sms=132) == 1  # 1024 programs fill 132 SMs
    assert choose_num_splits(1, 8, 100, num_sms=132) == 1  # too short to split
    splits = choose_num_splits(4, 8, 2048, num_sms=132)
    assert 1 < splits <= 2048 // 256  # never below 256 tokens per split
    assert choose_num_splits(1, 1, 10**6, num_sms=10**4) == 64  # capped


@pytest.mark.parametrize("num_seqs", [1, 3, 8, 17, 32, 50])
def test_choose_num_splits_launches_at_most_one_wave_of_four_programs_per_sm(num_seqs):
    # 768 programs (1.45 waves) ran 15% slower than 512 or 1024 on an H200 (kernels/NOTES.md).
    splits = choose_num_splits(num_seqs, 8, 8192, num_sms=132)
    assert num_seqs * 8 * splits <= 4 * 132 or splits == 1
    assert num_seqs * 8 * (splits + 1) > 4 * 132 or splits == 8192 // 256


def _valid_inputs(device):
    kv = make_paged_kv(
        [3, 9], num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float16, device=device
    )
    query = torch.randn(2, 4, 64, device=device).half()
    return [query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 0.125]


@pytest.mark.parametrize(
    ("index", "bad", "error", "match"),
    [
        (0, lambda q: q.float(), TypeError, "dtypes must match"),
        (0, lambda q: q.to(torch.int32), TypeError, "query must have dtype"),
        (0, lambda q: q[:, :3], ValueError, "not a multiple of num_kv_heads"),
        (0, lambda q: q[:, :, :32], ValueError, "head_dim differs"),
        (0, lambda q: q[0], ValueError, r"query must be \[num_seqs, num_heads, head_dim\]"),
        (
            0,
            lambda q: q.transpose(1, 2).contiguous().transpose(1, 2),
            ValueError,
            "contiguous in its last dimension",
        ),
        (2, lambda v: v[:-1], ValueError, "value_cache must have shape"),
        (3, lambda t: t.long(), TypeError, "block_tables must have dtype"),
        (3, lambda t: t[:1], ValueError, "block_tables has 1 rows for 2 seqs"),
        (4, lambda s: s.long(), TypeError, "seq_lens must have dtype"),
        (4, lambda s: s[:1], ValueError, "seq_lens must have shape"),
    ],
)
def test_wrapper_rejects_bad_arguments_with_clear_errors(index, bad, error, match, device):
    args = _valid_inputs(device)
    args[index] = bad(args[index])
    with pytest.raises(error, match=match):
        decode_attention(*args)


def test_wrapper_rejects_a_wrong_out_buffer_and_bad_tuning(device):
    args = _valid_inputs(device)
    with pytest.raises(ValueError, match="out must be"):
        decode_attention(*args, out=torch.empty(2, 4, 64, device=device))
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        decode_attention(*args, block_n=24)
    with pytest.raises(ValueError, match="num_splits must be in"):
        decode_attention(*args, num_splits=0)


# --------------------------------------------------------------------------------------------
# GPU grid
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_gpu_grid_matches_reference(dtype, group, head_dim, device):
    # A batch of 64 mixed lengths (odd ones, block edges, up to 4k), then one 8k context
    # alone (the split-K path chosen automatically), then a forced split count.
    seq_lens = [1, 15, 16, 17, 511, 4096, *(random.randint(1, 4096) for _ in range(58))]
    _run_and_check(
        seq_lens, num_kv_heads=2, group=group, head_dim=head_dim, dtype=dtype, device=device
    )
    _run_and_check(
        [8192],
        num_kv_heads=8,
        group=group,
        head_dim=head_dim,
        dtype=dtype,
        device=device,
        max_seq_len=8192,
    )
    counters = torch.zeros(64 * 8, dtype=torch.int32, device=device)
    for split_counters in (None, counters):  # the reduce kernel, then the fused merge
        _run_and_check(
            [8192, 3000, 1, 77],
            num_kv_heads=2,
            group=group,
            head_dim=head_dim,
            dtype=dtype,
            device=device,
            num_splits=7,
            split_counters=split_counters,
        )
    _run_and_check(
        seq_lens, num_kv_heads=8, group=group, head_dim=head_dim, dtype=dtype, device=device,
        num_splits=3, split_counters=counters,
    )  # fmt: skip
    assert not counters.any()


@pytest.mark.gpu
def test_gpu_is_captured_and_replayed_by_a_cuda_graph(device):
    kv = make_paged_kv(
        [100, 3000],
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        dtype=torch.bfloat16,
        device=device,
    )
    query = torch.randn(2, 32, 128, device=device).bfloat16()
    out = torch.empty_like(query)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 128**-0.5)
    decode_attention(*args, out=out, num_splits=4)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        decode_attention(*args, out=out, num_splits=4)
    query.copy_(torch.randn_like(query))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    ref = decode_attention_ref(
        query, kv.clean_key_cache, kv.clean_value_cache, kv.block_tables, kv.seq_lens, 128**-0.5
    )
    assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("num_splits", [2, 8])
def test_gpu_fused_merge_gives_the_same_output_over_many_graph_replays(num_splits, device):
    """A merge that read a partial before its split had stored it would show as a difference
    between replays (the programs' order varies from launch to launch)."""
    lens = [random.randint(1, 2048) for _ in range(32)]
    kv = make_paged_kv(lens, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16,
                       device=device)  # fmt: skip
    query = torch.randn(32, 32, 128, device=device).bfloat16()
    out = torch.empty_like(query)
    counters = torch.zeros(32 * 8, dtype=torch.int32, device=device)
    args = (query, kv.key_cache, kv.value_cache, kv.block_tables, kv.seq_lens, 128**-0.5)

    def run():
        decode_attention(*args, out=out, num_splits=num_splits, split_counters=counters)

    run()  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run()
    graph.replay()
    first = out.clone()
    ref = decode_attention_ref(
        query, kv.clean_key_cache, kv.clean_value_cache, kv.block_tables, kv.seq_lens, 128**-0.5
    )
    assert_close(first, ref, torch.bfloat16)
    for _ in range(200):
        out.fill_(float("nan"))
        graph.replay()
        assert torch.equal(out, first)
    assert not counters.any()
