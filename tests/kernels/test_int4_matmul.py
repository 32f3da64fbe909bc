"""int4_matmul (Triton) against int4_matmul_ref: every mode, group size, zero points or none,
act-order, split-K, ragged N and K, SmolLM2's GQA shapes, argument checks; the Llama-3-8B grid,
M = 1..512, and CUDA-graph replay on the GPU."""

from __future__ import annotations

import itertools

import pytest
import torch
import triton  # make test installs it: no kernel test may skip for want of it

from sitsd.kernels import quant_layout
from sitsd.kernels.int4_matmul import (
    MMA_WIDE_REGISTERS,
    Int4MatmulConfig,
    choose_int4_config,
    int4_matmul,
)
from sitsd.kernels.quant_layout import slice_major_perm, to_slice_major, unpack_int4
from sitsd.kernels.quant_reference import dequantize_int4_ref, int4_matmul_ref
from tests.kernels.helpers import assert_close
from tests.kernels.int4_inputs import LLAMA3_8B_SHAPES, SMOLLM2_SHAPES, random_int4

# Small tilings per mode, so that the odd shapes below leave partial tiles everywhere.
CONFIGS = {
    "fma": Int4MatmulConfig("fma", block_m=2, block_n=8, block_k=64),
    "dot_swapped": Int4MatmulConfig("dot_swapped", block_m=16, block_n=16, block_k=32),
    # capped registers (ptxas's maxnreg on the GPU; the interpreter takes and ignores it)
    "dot": Int4MatmulConfig("dot", block_m=16, block_n=32, block_k=128, max_registers=128),
    "gemv": Int4MatmulConfig("gemv", block_m=4, block_n=16, block_k=64),  # 2 or 1/2 groups
}


def _x(num_rows, k, dtype, device):
    return torch.randn(num_rows, k, device=device).to(dtype)


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("offsets", [False, True])
def test_matches_reference_with_ragged_tiles_and_a_short_last_group(
    mode, group_size, offsets, device
):
    # N = 37: the last tile's rows are masked; K = 2 * group + 32: the last chunk is partial and
    # the last group short (for 64 and 128), as GPTQ writes K % group != 0.
    k = 2 * group_size + 32
    weight = random_int4(37, k, group_size, offsets=offsets, device=device)
    num_rows = 2 if mode == "fma" else 5
    x = _x(num_rows, k, torch.bfloat16, device)
    out = int4_matmul(x, *weight.args, config=CONFIGS[mode])
    assert_close(out, int4_matmul_ref(x, *weight.args), torch.bfloat16)


@pytest.mark.parametrize("mode", sorted(CONFIGS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_act_order_gathers_x_through_the_permutation(mode, dtype, device):
    weight = random_int4(24, 160, 32, offsets=True, perm=True, device=device)
    x = _x(3, 160, dtype, device)
    out = int4_matmul(x, *weight.args, config=CONFIGS[mode])
    assert_close(out, int4_matmul_ref(x, *weight.args), dtype)
    # The same weight without perm gives another product: perm is really applied.
    unpermuted = int4_matmul_ref(x, weight.qweight, weight.scales, weight.offsets, 32)
    assert not torch.allclose(out.float(), unpermuted.float(), atol=1e-2)


@pytest.mark.parametrize("offsets", [False, True])
def test_gemv_keeps_float32_precision_over_a_wide_range_of_x(offsets, device):
    # gemv multiplies `256 + q` and `16 + q` and takes the biases off per word from x's sums:
    # that must leave a float32 x its precision, outliers of 3e4 and columns of 1e-2 included.
    k = 1024
    weight = random_int4(64, k, 128, offsets=offsets, device=device)
    x = _x(2, k, torch.float32, device) * 100
    x[:, 7], x[:, 300] = 3e4, -2e4
    x[:, 500:600] *= 1e-4
    config = Int4MatmulConfig("gemv", 2, 32, 128, split_k=2, num_warps=2)
    out = int4_matmul(x, *weight.args, config=config).double()
    ref = int4_matmul_ref(x, *weight.args).double()
    # Against the size of the terms summed (|x| @ |W|^T), not of each sum: some outputs cancel
    # to near zero, and any order of summation misses those by more than float32's elementwise
    # tolerance (the kernel before `256 + q` too). Exact products stayed within 6.2e-7 of it
    # over 40 seeds (CPU interpreter); products of `256 + q` reached 4.8e-6.
    terms = x.double().abs() @ dequantize_int4_ref(*weight.args).double().abs().T
    assert ((out - ref).abs() / terms).max().item() < 2e-6


@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_scales_and_offsets_of_any_float_dtype(scale_dtype, device):
    weight = random_int4(40, 128, 64, offsets=True, scale_dtype=scale_dtype, device=device)
    x = _x(4, 128, torch.float16, device)
    out = int4_matmul(x, *weight.args, config=CONFIGS["dot"])
    assert_close(out, int4_matmul_ref(x, *weight.args), torch.float16)


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_sums_the_same_bits_each_time(split_k, device):
    weight = random_int4(48, 256, 32, offsets=True, device=device)
    x = _x(6, 256, torch.float16, device)
    config = Int4MatmulConfig("dot_swapped", 16, 16, 32, split_k=split_k)
    first = int4_matmul(x, *weight.args, config=config)
    assert torch.equal(int4_matmul(x, *weight.args, config=config), first)
    assert_close(first, int4_matmul_ref(x, *weight.args), torch.float16)


# Mode mma with the scale multiplied into the codes, on a 16-row tile split in two and on a
# 64-row tile (x ordered).
SCALED_16 = Int4MatmulConfig("mma", 16, 32, 128, 2, scaled=True)
SCALED_64 = Int4MatmulConfig("mma", 64, 16, 128, 2, scaled=True)
# x put in slice-major order by each program (a 64-row tile; by default a copy orders it) and
# by a copy (a 16-row tile; by default each program does)
IN_PLACE_64 = Int4MatmulConfig("mma", 64, 16, 128, 2, order_x=False)
ORDERED_16 = Int4MatmulConfig("mma", 16, 32, 128, 2, order_x=True)
# x loaded where each group uses it (Triton's pipeliner copies it into shared memory), not one
# group ahead: in place (a 16-row tile) and ordered by a copy (64 rows, scaled too)
IN_LOOP_16 = Int4MatmulConfig("mma", 16, 32, 128, 2, x_ahead=False)
IN_LOOP_64 = Int4MatmulConfig("mma", 64, 16, 128, 2, x_ahead=False)
IN_LOOP_64_SCALED = Int4MatmulConfig("mma", 64, 16, 128, 2, scaled=True, x_ahead=False)

# Split-K tilings whose tiles are ragged along N and (where a tile holds rows) along M.
MERGE_CONFIGS = {
    "fma": Int4MatmulConfig("fma", 2, 8, 64, split_k=2),
    "dot_swapped": Int4MatmulConfig("dot_swapped", 16, 16, 32, split_k=4),
    "dot": Int4MatmulConfig("dot", 16, 32, 64, split_k=2),
    "gemv": Int4MatmulConfig("gemv", 2, 16, 64, split_k=2, num_warps=2),
    "mma": Int4MatmulConfig("mma", 16, 16, 128, split_k=2),
    "mma x ordered": Int4MatmulConfig("mma", 64, 16, 128, split_k=2),
    "mma scaled": Int4MatmulConfig("mma", 16, 16, 128, split_k=2, scaled=True),
    "mma x in loop": Int4MatmulConfig("mma", 64, 16, 128, split_k=2, x_ahead=False),
}


def _merge_case(device):
    """N = 37 (ragged tiles), K = 2 * 128 + 64: the splits take whole groups of 128 and mma's
    second split runs past K; 3 rows: ragged row tiles in fma and gemv (2 rows a program)."""
    k = 2 * 128 + 64
    return random_int4(37, k, 128, offsets=True, device=device), _x(3, k, torch.bfloat16, device)


@pytest.mark.parametrize("name", sorted(MERGE_CONFIGS))
def test_split_counters_merge_in_the_kernel_to_the_same_bits_and_are_left_zero(name, device):
    config = MERGE_CONFIGS[name]
    weight, x = _merge_case(device)
    two_kernels = int4_matmul(x, *weight.args, config=config)
    counters = torch.zeros(64, dtype=torch.int32, device=device)
    for _ in range(2):  # the counters the first call left serve the second
        out = torch.full_like(two_kernels, float("nan"))
        int4_matmul(x, *weight.args, config=config, out=out, split_counters=counters)
        assert torch.equal(out, two_kernels)
        assert not counters.any()
    assert_close(out, int4_matmul_ref(x, *weight.args), torch.bfloat16)


@pytest.mark.parametrize("name", sorted(MERGE_CONFIGS))
def test_each_tile_counts_on_its_own_counter(name, device):
    # A counter primed to SPLIT_K never reads SPLIT_K - 1: its tile is never merged (left NaN)
    # and every other tile is. The interpreter runs the programs one after another, so a tile
    # counting on another's counter would not show in the test above; here it would.
    config = MERGE_CONFIGS[name]
    weight, x = _merge_case(device)
    two_kernels = int4_matmul(x, *weight.args, config=config)
    n_tiles, m_tiles = triton.cdiv(37, config.block_n), triton.cdiv(3, config.block_m)
    for n_tile, m_tile in ((0, 0), (n_tiles - 1, m_tiles - 1)):
        counters = torch.zeros(64, dtype=torch.int32, device=device)
        tile = m_tile * n_tiles + n_tile
        counters[tile] = config.split_k
        out = torch.full_like(two_kernels, float("nan"))
        int4_matmul(x, *weight.args, config=config, out=out, split_counters=counters)
        unmerged = torch.zeros_like(out, dtype=torch.bool)
        unmerged[m_tile * config.block_m : (m_tile + 1) * config.block_m,
                 n_tile * config.block_n : (n_tile + 1) * config.block_n] = True  # fmt: skip
        assert torch.equal(out.isnan(), unmerged)
        assert torch.equal(out[~unmerged], two_kernels[~unmerged])
        assert counters[tile] == 2 * config.split_k
        assert counters.count_nonzero() == 1


def test_split_counters_are_checked_and_unused_without_splits(device):
    weight = random_int4(40, 256, 64, offsets=False, device=device)
    x = _x(2, 256, torch.float16, device)
    config = Int4MatmulConfig("dot_swapped", 16, 16, 64, split_k=2)  # 3 tiles
    with pytest.raises(ValueError, match=r"split_counters holds 2 counters; 3 x 1 tiles need 3"):
        int4_matmul(x, *weight.args, config=config,
                    split_counters=torch.zeros(2, dtype=torch.int32, device=device))  # fmt: skip
    with pytest.raises(TypeError, match="split_counters must have dtype"):
        int4_matmul(x, *weight.args, config=config,
                    split_counters=torch.zeros(3, device=device))  # fmt: skip
    one_split = Int4MatmulConfig("dot_swapped", 16, 16, 64)
    counters = torch.zeros(1, dtype=torch.int32, device=device)  # too few, but not needed
    out = int4_matmul(x, *weight.args, config=one_split, split_counters=counters)
    assert torch.equal(out, int4_matmul(x, *weight.args, config=one_split))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("perm", [False, True])
def test_mma_mode_matches_reference_with_ragged_tiles_a_short_last_group_and_split_k(
    dtype, offsets, perm, device
):
    # Mode mma takes group 128 only. N = 37: masked weight rows; K = 2 * 128 + 32: a short last
    # group (and, split in two, a second split that runs past K); 5 rows of a 16-row tile.
    k = 2 * 128 + 32
    weight = random_int4(37, k, 128, offsets=offsets, perm=perm, device=device)
    x = _x(5, k, dtype, device)
    ref = int4_matmul_ref(x, *weight.args)
    # 64-row tiles take x in slice-major order from one copy (slice_major_x): through perm,
    # padded past K. Scaled: the scale multiplied into the 16-bit codes before the MMA.
    for config in (Int4MatmulConfig("mma", 16, 16, 128), Int4MatmulConfig("mma", 16, 32, 128, 2),
                   Int4MatmulConfig("mma", 64, 16, 128, 2), SCALED_16,
                   SCALED_64, IN_PLACE_64, ORDERED_16, IN_LOOP_16, IN_LOOP_64,
                   IN_LOOP_64_SCALED):  # fmt: skip
        out = torch.full((5, 37), float("nan"), device=device, dtype=dtype)
        assert_close(int4_matmul(x, *weight.args, config=config, out=out), ref, dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mma_mode_subtracts_integer_zero_points_found_at_load(dtype, device):
    # Offsets -z * scale (AWQ, GPTQ, RTN): mark_integer_zeros finds z, and mode mma subtracts
    # it from the codes; the product is the offsets' product. Ragged N and K, a split past K.
    from sitsd.quant.layout import Int4Weight, mark_integer_zeros

    k = 2 * 128 + 32
    case = random_int4(37, k, 128, offsets=True, scale_dtype=torch.float16, device=device)
    weight = mark_integer_zeros(Int4Weight(case.qweight, case.scales, case.offsets, 128))
    assert weight.zeros is not None
    z = -(case.offsets.float() / case.scales.float())
    assert torch.equal(weight.zeros, z.round().to(torch.int32))
    x = _x(5, k, dtype, device)
    ref = int4_matmul_ref(x, *case.args)
    for config in (Int4MatmulConfig("mma", 16, 16, 128), Int4MatmulConfig("mma", 16, 32, 128, 2),
                   Int4MatmulConfig("mma", 16, 128, 128, 2),
                   Int4MatmulConfig("mma", 64, 16, 128, 2), SCALED_16, SCALED_64,
                   IN_PLACE_64, ORDERED_16, IN_LOOP_16, IN_LOOP_64):  # fmt: skip
        out = int4_matmul(x, *case.args, config=config, zeros=weight.zeros)
        assert_close(out, ref, dtype)


def test_mma_mode_takes_offsets_that_are_no_whole_number_of_scales(device):
    # GGUF-like minima: the zero point taken is the nearest (clamped to 0..15), and the
    # remainder, times each group's sum of x, carries the rest.
    case = random_int4(40, 256, 128, offsets=True, scale_dtype=torch.float32, device=device)
    shift = torch.empty_like(case.offsets).uniform_(-40.0, 40.0) * case.scales
    case.offsets = case.offsets + shift
    x = _x(3, 256, torch.bfloat16, device)
    for config in (Int4MatmulConfig("mma", 16, 32, 128, 2), Int4MatmulConfig("mma", 64, 32, 128),
                   SCALED_16):  # fmt: skip
        out = int4_matmul(x, *case.args, config=config)
        assert_close(out, int4_matmul_ref(x, *case.args), torch.bfloat16)


def test_mma_mode_on_even_tiles_and_more_rows_than_one_tile(device):
    weight = random_int4(64, 256, 128, offsets=True, device=device)
    x = _x(20, 256, torch.bfloat16, device)
    out = int4_matmul(x, *weight.args, config=Int4MatmulConfig("mma", 16, 32, 128))
    assert_close(out, int4_matmul_ref(x, *weight.args), torch.bfloat16)


def test_mma_mode_refuses_other_groups_float32_x_and_other_chunks(device):
    w64 = random_int4(32, 128, 64, offsets=True, device=device)
    w128 = random_int4(32, 128, 128, offsets=True, device=device)
    mma = Int4MatmulConfig("mma", 16, 32, 128)
    with pytest.raises(ValueError, match="mode 'mma' takes group size 128 and float16 or bf"):
        int4_matmul(_x(2, 128, torch.bfloat16, device), *w64.args, config=mma)
    with pytest.raises(ValueError, match=r"got group size 128 and torch\.float32"):
        int4_matmul(_x(2, 128, torch.float32, device), *w128.args, config=mma)
    with pytest.raises(ValueError, match=r"block_k must be 128 \(the group\) in mode 'mma'"):
        int4_matmul(_x(2, 128, torch.bfloat16, device), *w128.args,
                    config=Int4MatmulConfig("mma", 16, 32, 64))  # fmt: skip


def _slice_major(case):
    """The same W with its codes slice-major: (qweight, scales, offsets, group, perm)."""
    k = case.qweight.shape[1] * 8
    return (to_slice_major(case.qweight), case.scales, case.offsets, case.group_size,
            slice_major_perm(k, case.qweight.device))  # fmt: skip


# Every mode on slice-major codes: gemv on chunks of whole blocks reads x's runs (128 and 256
# columns) or gathers it (64), mma takes x as it is at 16- and 64-row tiles, the dot modes and
# fma gather x through the permutation.
SLICE_MAJOR_CONFIGS = {
    "gemv k128": Int4MatmulConfig("gemv", block_m=2, block_n=16, block_k=128),
    "gemv k256": Int4MatmulConfig("gemv", block_m=4, block_n=32, block_k=256),
    "gemv k64": Int4MatmulConfig("gemv", block_m=1, block_n=16, block_k=64, split_k=2),
    "mma m16": Int4MatmulConfig("mma", 16, 32, 128, 2),
    "mma m64": Int4MatmulConfig("mma", 64, 16, 128),
    "mma m16 x in loop": Int4MatmulConfig("mma", 16, 32, 128, 2, x_ahead=False),
    "dot": CONFIGS["dot"],
    "dot_swapped": CONFIGS["dot_swapped"],
    "fma": CONFIGS["fma"],
}


@pytest.mark.parametrize("name", sorted(SLICE_MAJOR_CONFIGS))
@pytest.mark.parametrize("offsets", [False, True])
def test_slice_major_codes_give_the_product_of_the_same_weight(name, offsets, device):
    # N = 37 (masked weight rows), K = 3 blocks of 128; the codes reordered slice-major with
    # their permutation, told so or not, give the reference's product of the original W.
    config = SLICE_MAJOR_CONFIGS[name]
    case = random_int4(37, 384, 128, offsets=offsets, device=device)
    num_rows = 2 if config.mode == "fma" else 5 if config.mode != "gemv" else config.block_m
    x = _x(num_rows, 384, torch.bfloat16, device)
    ref = int4_matmul_ref(x, *case.args)
    sliced = _slice_major(case)
    assert_close(int4_matmul(x, *sliced, config=config, slice_major=True), ref, torch.bfloat16)
    assert_close(int4_matmul(x, *sliced, config=config), ref, torch.bfloat16)
    # The codes alone, without their permutation, are another W.
    assert not torch.allclose(int4_matmul(x, *sliced[:4], None, config=config).float(),
                              ref.float(), atol=1e-2)  # fmt: skip


def test_slice_major_needs_its_permutation_and_groups_of_128(device):
    case = random_int4(16, 256, 128, offsets=False, device=device)
    x = _x(2, 256, torch.bfloat16, device)
    with pytest.raises(ValueError, match="slice-major codes need their perm and group size 128"):
        int4_matmul(x, *case.args, slice_major=True)
    w64 = random_int4(16, 256, 64, offsets=False, perm=True, device=device)
    with pytest.raises(ValueError, match="got perm given and group size 64"):
        int4_matmul(x, *w64.args, slice_major=True)


def test_slice_major_permutation_keeps_each_block_and_matches_the_reordered_codes(monkeypatch):
    perm = slice_major_perm(256)
    assert sorted(perm.tolist()) == list(range(256))
    assert perm[:10].tolist() == [0, 16, 32, 48, 64, 80, 96, 112, 1, 17]
    assert (perm[128:] // 128 == 1).all()  # a block's columns stay in the block (its group)
    qweight = torch.randint(-(2**31), 2**31 - 1, (11, 32), dtype=torch.int32)
    expected = unpack_int4(qweight)[:, perm.long()]
    assert torch.equal(unpack_int4(to_slice_major(qweight)), expected)
    # In blocks of 3 rows (11 = 3 + 3 + 3 + 2), as a large weight is reordered.
    monkeypatch.setattr(quant_layout, "_REORDER_BYTES", 3 * 4 * 256)
    assert torch.equal(unpack_int4(to_slice_major(qweight)), expected)
    with pytest.raises(ValueError, match="need K a multiple of 128, got 576"):
        slice_major_perm(576)


@pytest.mark.parametrize(("name", "num_rows"), [("kv", 1), ("o", 5)])
def test_smollm2_shapes_with_the_default_config(name, num_rows, device):
    n, k = SMOLLM2_SHAPES[name]
    weight = random_int4(n, k, 64, offsets=True, device=device)
    x = _x(num_rows, k, torch.bfloat16, device)
    assert_close(int4_matmul(x, *weight.args), int4_matmul_ref(x, *weight.args), torch.bfloat16)


def test_writes_into_a_given_out_takes_strided_rows_and_empty_inputs(device):
    weight = random_int4(32, 64, 32, offsets=False, device=device)
    x = _x(6, 128, torch.float32, device)[::2, :64]  # row stride 256, last dimension contiguous
    out = torch.full((3, 32), float("nan"), device=device)
    assert int4_matmul(x, *weight.args, config=CONFIGS["dot"], out=out) is out
    assert_close(out, int4_matmul_ref(x, *weight.args), torch.float32)
    assert int4_matmul(x[:0], *weight.args).shape == (0, 32)


def test_rejects_bad_arguments_with_messages(device):
    w = random_int4(32, 64, 32, offsets=True, device=device)
    x = _x(2, 64, torch.float32, device)
    with pytest.raises(ValueError, match="group_size must be one of"):
        int4_matmul(x, w.qweight, w.scales, w.offsets, 16)
    with pytest.raises(ValueError, match=r"scales must have shape \[ceil\(K / group_size\), N\]"):
        int4_matmul(x, w.qweight, w.scales, w.offsets, 64)
    with pytest.raises(TypeError, match="qweight must have dtype in"):
        int4_matmul(x, w.qweight.to(torch.int64), w.scales, w.offsets, 32)
    with pytest.raises(ValueError, match=r"x must have shape \[M, K\] with K = 64"):
        int4_matmul(_x(2, 72, torch.float32, device), *w.args)
    with pytest.raises(ValueError, match="offsets must have shape"):
        int4_matmul(x, w.qweight, w.scales, w.offsets[:1], 32)
    with pytest.raises(ValueError, match=r"perm must have shape \[K\]"):
        int4_matmul(x, *w.args[:4], torch.arange(8, dtype=torch.int32, device=device))
    with pytest.raises(ValueError, match="block_n must be a power of two >= 16 in mode 'dot'"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("dot", 16, 8, 32))
    with pytest.raises(ValueError, match="block_m must be a power of two >= 16 in mode 'dot_sw"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("dot_swapped", 48, 64, 128))
    with pytest.raises(ValueError, match="block_m must be at most 4 in mode 'gemv'"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("gemv", 8, 16, 128))
    with pytest.raises(ValueError, match="mode must be one of"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("wmma"))
    with pytest.raises(ValueError, match="split_k must be a power of two"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("dot", split_k=3))
    with pytest.raises(ValueError, match="scaled applies to mode 'mma' only, got mode 'gemv'"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("gemv", 2, 16, 128, scaled=True))
    with pytest.raises(ValueError, match="order_x applies to mode 'mma' only, got mode 'dot'"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("dot", 16, 16, 64, order_x=False))
    with pytest.raises(ValueError, match="x_ahead applies to mode 'mma' only, got mode 'gemv'"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("gemv", 1, 16, 64, x_ahead=False))
    with pytest.raises(ValueError, match="max_registers must be 32 to 255 \\(or None\\), got 256"):
        int4_matmul(x, *w.args, config=Int4MatmulConfig("gemv", 1, 16, 64, max_registers=256))


@pytest.mark.parametrize("name", sorted(LLAMA3_8B_SHAPES))
@pytest.mark.parametrize("num_rows", [1, 8, 32, 128, 256, 512])
@pytest.mark.parametrize("offsets", [None, "zeros", "sums"])
def test_default_config_fits_the_shape_and_fills_an_h200(name, num_rows, offsets):
    n, k = LLAMA3_8B_SHAPES[name]
    config = choose_int4_config(num_rows, n, k, 128, num_sms=132, has_offsets=offsets is not None,
                                has_zeros=offsets == "zeros")  # fmt: skip
    assert k % (config.split_k * config.block_k) == 0
    programs = triton.cdiv(n, config.block_n) * triton.cdiv(num_rows, config.block_m)
    # gemv for 1-2 rows, mma from 3 (group 128, bf16 x): at 256 and 512 rows too, where a
    # model without the dequantize's workspace runs its INT4 layers.
    assert config.mode == ("gemv" if num_rows <= 2 else "mma")
    if config.mode == "mma":  # a program per SM; two with x in the loop on 32-row tiles
        least = 2 * 132 if not config.x_ahead and config.block_m <= 32 else 132
        assert programs * config.split_k >= least or config.split_k == 16
        # x in the loop on 32-row tiles and for gate_up past them, one group ahead otherwise
        assert config.x_ahead == (num_rows < 17 or (num_rows > 32 and name != "gate_up"))
        # gate_up with x in the loop fills the SMs unsplit (no partials for a second kernel),
        # but with offsets that need x's sums past 32 rows (173 registers: one program an SM)
        unsplit = (name == "gate_up" and not config.x_ahead
                   and (num_rows <= 32 or offsets != "sums"))  # fmt: skip
        assert (config.split_k == 1) == unsplit
        # 8-warp tiles capped so that two programs share an SM's 64K registers (but those
        # of offsets with sums, which would spill)
        capped = config.num_warps == 8 and offsets != "sums"
        assert config.max_registers == (MMA_WIDE_REGISTERS if capped else None)
        if capped:
            assert 2 * config.num_warps * 32 * MMA_WIDE_REGISTERS <= 65536
    else:
        assert programs * config.split_k >= 2 * 132 or config.split_k == 8


@pytest.mark.parametrize("num_rows", [8, 32, 128])
def test_zero_points_take_the_symmetric_tiles_but_on_a_layer_as_small_as_o(num_rows):
    # Integer zero points (AWQ, GPTQ, RTN) sum no x: they take the tiles of symmetric codes (64
    # weight rows), but on o (4096 x 4096), where 128 rows measured faster on an H100; offsets
    # that need x's sums (GGUF's minima) keep 128 rows wherever x is loaded ahead.
    for name, (n, k) in LLAMA3_8B_SHAPES.items():
        sym = choose_int4_config(num_rows, n, k, 128)
        zeros = choose_int4_config(num_rows, n, k, 128, has_offsets=True, has_zeros=True)
        sums = choose_int4_config(num_rows, n, k, 128, has_offsets=True)
        if name == "o" and zeros.x_ahead:
            assert zeros.block_n == 128
            assert zeros == sums
        else:
            assert (zeros.block_m, zeros.block_n) == (sym.block_m, sym.block_n), name
        if sums.x_ahead:  # (x in the loop: the tile is the same whatever the format)
            assert sums.block_n == 128, name


def _other_modes(num_rows: int, group_size: int) -> list[Int4MatmulConfig]:
    """A tiling of each mode that can serve `num_rows` besides the default's."""
    configs = [Int4MatmulConfig("dot", 64, 128, 64)]
    if group_size == 128:
        block_m = max(16, min(64, triton.next_power_of_2(num_rows)))
        configs.append(Int4MatmulConfig("mma", block_m, 128, 128, split_k=2))
        configs.append(Int4MatmulConfig("mma", block_m, 64, 128, split_k=2, scaled=True))
    if num_rows <= 64:
        block_m = max(16, triton.next_power_of_2(num_rows))
        configs.append(Int4MatmulConfig("dot_swapped", block_m, 64, 128, split_k=2))
    if num_rows <= 4:
        configs.append(Int4MatmulConfig("fma", triton.next_power_of_2(num_rows), 4, 1024))
        configs.append(Int4MatmulConfig("gemv", triton.next_power_of_2(num_rows), 64, 512,
                                        split_k=2))  # fmt: skip
    return configs


# Llama-3-8B's layers, SmolLM2's (K = 576: a short last group of 128), and odd N with a K that
# is no power of two.
GPU_SHAPES = {**LLAMA3_8B_SHAPES, "smollm2_qkv": SMOLLM2_SHAPES["qkv"],
              "smollm2_down": SMOLLM2_SHAPES["down"], "odd": (4099, 4128)}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(GPU_SHAPES))
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("offsets", [False, True])
def test_gpu_model_shapes_match_reference_from_1_to_512_rows(name, group_size, offsets, device):
    # Every row count with the default configuration; the other modes at a few (each distinct
    # configuration is a compile per K: the grid is kept to what the H200 run can afford).
    n, k = GPU_SHAPES[name]
    weight = random_int4(n, k, group_size, offsets=offsets, device=device)
    for num_rows in (1, 2, 3, 8, 17, 32, 64, 65, 128, 200, 512):
        x = _x(num_rows, k, torch.bfloat16, device)
        ref = int4_matmul_ref(x, *weight.args)
        assert_close(int4_matmul(x, *weight.args), ref, torch.bfloat16)
        for config in _other_modes(num_rows, group_size) if num_rows in (1, 17, 200) else []:
            assert_close(int4_matmul(x, *weight.args, config=config), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_act_order_and_split_k_on_llama_down(dtype, device):
    n, k = LLAMA3_8B_SHAPES["down"]
    weight = random_int4(n, k, 128, offsets=True, perm=True, device=device)
    for num_rows in (1, 16, 48):
        x = _x(num_rows, k, dtype, device)
        ref = int4_matmul_ref(x, *weight.args)
        for split_k in (1, 2, 4, 8):
            block_m = max(16, 1 << (num_rows - 1).bit_length())  # a power of two
            for mode, block_n in (("dot_swapped", 64), ("mma", 256)):
                config = Int4MatmulConfig(mode, block_m, block_n, 128, split_k)
                assert_close(int4_matmul(x, *weight.args, config=config), ref, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qkv", "gate_up", "down"])
def test_gpu_merged_splits_give_the_same_bits_over_many_graph_replays(name, device):
    # The default configurations (gemv split K 8 ways at 1-2 rows, mma 4-8 ways at 8-32), each
    # tile's last program merging, with PDL, inside a graph: the two-kernel bits.
    n, k = LLAMA3_8B_SHAPES[name]
    weight = random_int4(n, k, 128, offsets=False, device=device)
    counters = torch.zeros(triton.cdiv(n, 16) * 2, dtype=torch.int32, device=device)
    for num_rows in (1, 2, 8, 32):
        x = _x(num_rows, k, torch.bfloat16, device)
        expected = int4_matmul(x, *weight.args)
        out = torch.empty_like(expected)
        int4_matmul(x, *weight.args, out=out, split_counters=counters, pdl=True)  # compile
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            int4_matmul(x, *weight.args, out=out, split_counters=counters, pdl=True)
        for _ in range(50):
            out.fill_(float("nan"))
            graph.replay()
            assert torch.equal(out, expected)
        assert not counters.any()


@pytest.mark.gpu
def test_gpu_replays_in_a_cuda_graph(device):
    n, k = LLAMA3_8B_SHAPES["o"]
    weight = random_int4(n, k, 128, offsets=True, device=device)
    for num_rows in (1, 24):
        x = _x(num_rows, k, torch.bfloat16, device)
        out = torch.empty(num_rows, n, device=device, dtype=torch.bfloat16)
        int4_matmul(x, *weight.args, out=out)  # compile outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            int4_matmul(x, *weight.args, out=out)
        for _ in range(2):
            x.copy_(torch.randn_like(x))
            graph.replay()
            assert_close(out, int4_matmul_ref(x, *weight.args), torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [False, True])
def test_gpu_slice_major_codes_on_llama_layers_from_1_to_512_rows(offsets, device):
    # How CUDA serves INT4 weights with groups of 128 (`to_serving_layout`): the defaults at
    # every row count the model runs `int4_matmul` at, against the reference's product.
    for name in ("qkv", "down"):
        n, k = LLAMA3_8B_SHAPES[name]
        case = random_int4(n, k, 128, offsets=offsets, device=device)
        sliced = _slice_major(case)
        for num_rows in (1, 2, 3, 8, 32, 64, 65, 128, 256):
            x = _x(num_rows, k, torch.bfloat16, device)
            assert_close(int4_matmul(x, *sliced, slice_major=True), int4_matmul_ref(x, *case.args),
                         torch.bfloat16)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("offsets", [False, True])
def test_gpu_mma_with_x_in_the_loop_on_llama_layers(offsets, device):
    # `x_ahead=False`: x copied into shared memory by Triton's pipeliner, 2-4 stages deep, on
    # the tiles the sweeps at 32 and 128 rows try, slice-major codes as CUDA serves them; with
    # offsets both ways the kernel takes them: summed x per group, and integer zero points.
    from sitsd.quant.layout import Int4Weight, mark_integer_zeros

    for name in ("qkv", "gate_up", "down"):
        n, k = LLAMA3_8B_SHAPES[name]
        case = random_int4(n, k, 128, offsets=offsets, device=device)
        sliced = _slice_major(case)
        zeros = [None]
        if offsets:
            zeros.append(mark_integer_zeros(Int4Weight(*case.args[:4])).zeros)
            assert zeros[-1] is not None
        tiles = ((5, 16, 64, 4), (32, 32, 64, 4), (100, 64, 64, 4), (128, 128, 128, 8),
                 (128, 64, 128, 8))  # fmt: skip
        for num_rows, block_m, block_n, warps in tiles:
            x = _x(num_rows, k, torch.bfloat16, device)
            ref = int4_matmul_ref(x, *case.args)
            for stages, z in itertools.product((2, 4), zeros):
                config = Int4MatmulConfig("mma", block_m, block_n, 128, 2, warps, stages,
                                          x_ahead=False)  # fmt: skip
                out = int4_matmul(x, *sliced, slice_major=True, config=config, zeros=z)
                assert_close(out, ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.parametrize("zero_points", [False, True])
def test_gpu_gate_up_unsplit_under_the_register_cap(zero_points, device):
    # gate_up past 32 rows as served: one 64 x 128 tile of 8 warps over the whole K, capped at
    # MMA_WIDE_REGISTERS (with zero points it took 135 registers uncapped), slice-major codes.
    from sitsd.quant.layout import Int4Weight, mark_integer_zeros

    n, k = LLAMA3_8B_SHAPES["gate_up"]
    case = random_int4(n, k, 128, offsets=zero_points, device=device)
    zeros = None
    if zero_points:
        zeros = mark_integer_zeros(Int4Weight(*case.args[:4])).zeros
        assert zeros is not None
    sliced = _slice_major(case)
    for num_rows in (33, 64, 128, 256):
        config = choose_int4_config(num_rows, n, k, 128, has_offsets=zero_points,
                                    has_zeros=zero_points)  # fmt: skip
        assert (config.split_k, config.num_warps) == (1, 8)
        assert config.max_registers == MMA_WIDE_REGISTERS
        x = _x(num_rows, k, torch.bfloat16, device)
        out = int4_matmul(x, *sliced, slice_major=True, zeros=zeros)
        assert_close(out, int4_matmul_ref(x, *case.args), torch.bfloat16)
