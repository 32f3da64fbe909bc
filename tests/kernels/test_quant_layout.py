"""The INT4 and FP8 layouts the kernels read: packing round trips and the argument checks."""

from __future__ import annotations

import pytest
import torch

from sitsd.kernels.quant_layout import (
    check_fp8_layout,
    check_int4_layout,
    num_groups,
    pack_int4,
    unpack_int4,
)


def test_pack_and_unpack_round_trip_with_code_i_in_bits_4i():
    codes = torch.randint(0, 16, (5, 24), dtype=torch.uint8)
    words = pack_int4(codes)
    assert words.shape == (5, 3)
    assert words.dtype == torch.int32
    assert torch.equal(unpack_int4(words), codes)
    # The layout's bit order, spelled out for one word: code i in bits 4i..4i+3.
    expected = sum(int(c) << (4 * i) for i, c in enumerate(codes[2, 8:16].tolist()))
    assert int(words[2, 1]) & 0xFFFFFFFF == expected


def test_pack_refuses_a_ragged_last_word():
    with pytest.raises(ValueError, match="multiple of 8 columns"):
        pack_int4(torch.zeros(2, 12, dtype=torch.uint8))


def test_num_groups_counts_a_short_last_group():
    assert num_groups(576, 128) == 5
    assert num_groups(512, 128) == 4


def test_int4_check_returns_the_shape_and_names_the_bad_tensor():
    qweight = torch.zeros(6, 8, dtype=torch.int32)
    scales = torch.ones(1, 6, dtype=torch.float16)
    assert check_int4_layout(qweight, scales, None, 64, None) == (6, 64)
    with pytest.raises(ValueError, match="offsets must have shape"):
        check_int4_layout(qweight, scales, torch.ones(2, 6), 64, None)
    with pytest.raises(TypeError, match="scales must have dtype"):
        check_int4_layout(qweight, scales.to(torch.int32), None, 64, None)
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        check_int4_layout(torch.zeros(8, 6, dtype=torch.int32).T, scales, None, 64, None)


def test_fp8_check_names_the_bad_tensor():
    weight = torch.zeros(4, 16).to(torch.float8_e4m3fn)
    assert check_fp8_layout(weight, torch.ones(4)) == (4, 16)
    with pytest.raises(ValueError, match=r"weight_scale must have shape \[N\]"):
        check_fp8_layout(weight, torch.ones(4, 1))
    with pytest.raises(TypeError, match="weight must have dtype in"):
        check_fp8_layout(weight.float(), torch.ones(4))
