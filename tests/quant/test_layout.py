"""The layouts as a weight slot uses them: views of output rows, fusing, reordering, in-place
copies, value validation, and the structure checks of each dataclass."""

from __future__ import annotations

import pytest
import torch

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    concat_rows,
    copy_weight_,
    empty_like,
    mark_integer_zeros,
    narrow_rows,
    nbytes,
    select_rows,
    to_slice_major_weight,
    validate_weight,
)
from tests.kernels.int4_inputs import random_int4


def int4(n, k, group_size=32, *, offsets=True, perm=False, scale_dtype=torch.float16):
    case = random_int4(n, k, group_size, offsets=offsets, perm=perm, scale_dtype=scale_dtype)
    return Int4Weight(case.qweight, case.scales, case.offsets, case.group_size, case.perm)


def fp8(n, k):
    return Fp8Weight((torch.randn(n, k) * 8).to(torch.float8_e4m3fn), torch.rand(n) + 0.1)


def int8(n, k, group_size=32):
    codes = torch.randint(-128, 128, (n, k), dtype=torch.int8)
    return Int8Weight(codes, torch.rand(-(-k // group_size), n).half() + 0.01, group_size)


LAYOUTS = {"int4": int4, "fp8": fp8, "int8": int8}


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_narrow_concat_and_select_act_on_output_rows(kind):
    parts = [LAYOUTS[kind](n, 64) for n in (16, 8, 8)]  # q, k, v
    fused = concat_rows(parts)
    assert fused.shape == (32, 64)
    dense = torch.cat([p.dequantize() for p in parts])
    assert torch.equal(fused.dequantize(), dense)
    assert torch.equal(narrow_rows(fused, 16, 8).dequantize(), parts[1].dequantize())
    order = torch.randperm(32)
    assert torch.equal(select_rows(fused, order).dequantize(), dense[order])


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_copy_into_a_narrowed_view_fills_the_fused_weight_in_place(kind):
    fused = concat_rows([LAYOUTS[kind](16, 64), LAYOUTS[kind](8, 64)])
    before = [t.data_ptr() for t in vars(fused).values() if isinstance(t, torch.Tensor)]
    new_k = LAYOUTS[kind](8, 64)
    copy_weight_(narrow_rows(fused, 16, 8), new_k)
    assert torch.equal(narrow_rows(fused, 16, 8).dequantize(), new_k.dequantize())
    assert [t.data_ptr() for t in vars(fused).values() if isinstance(t, torch.Tensor)] == before


@pytest.mark.parametrize("kind", sorted(LAYOUTS))
def test_empty_like_gives_a_slot_of_the_same_structure_that_copy_fills(kind):
    weight = LAYOUTS[kind](24, 64)
    slot = empty_like(weight)
    assert type(slot) is type(weight)
    assert copy_weight_(slot, weight) is slot
    assert torch.equal(slot.dequantize(), weight.dequantize())


def test_fusing_int4_parts_of_different_forms_is_exact():
    sym = int4(16, 64, offsets=False, scale_dtype=torch.float16)
    asym = int4(8, 64, offsets=True, scale_dtype=torch.bfloat16)
    fused = concat_rows([sym, asym])
    assert fused.offsets is not None
    assert fused.scales.dtype == torch.float32
    assert torch.equal(fused.dequantize(), torch.cat([sym.dequantize(), asym.dequantize()]))


def test_fusing_refuses_what_cannot_share_one_weight():
    with pytest.raises(QuantFormatError, match="group_size is 64, part 0's 32"):
        concat_rows([int4(8, 128, 32), int4(8, 128, 64)])
    with pytest.raises(QuantFormatError, match="perm differs from part 0's"):
        concat_rows([int4(8, 64, perm=True), int4(8, 64, perm=True)])
    with pytest.raises(QuantFormatError, match="different layouts"):
        concat_rows([int4(8, 64), fp8(8, 64)])
    with pytest.raises(QuantFormatError, match="part 1 has K = 32"):
        concat_rows([fp8(8, 64), fp8(8, 32)])


def test_copy_refuses_another_structure():
    with pytest.raises(QuantFormatError, match="offsets: only the destination has one"):
        copy_weight_(int4(8, 64, offsets=True), int4(8, 64, offsets=False))
    with pytest.raises(QuantFormatError, match=r"qweight: source torch\.int32 \(16, 8\)"):
        copy_weight_(int4(8, 64), int4(16, 64))
    with pytest.raises(QuantFormatError, match="cannot copy a Fp8Weight into a Int4Weight"):
        copy_weight_(int4(8, 64), fp8(8, 64))


def test_validate_names_the_field_that_holds_bad_values():
    good = int4(8, 64)
    validate_weight(good, "model.layers.0.mlp.up_proj")
    bad = good.scales.clone()
    bad[0, 0] = float("inf")
    with pytest.raises(QuantFormatError, match=r"up_proj\.scales holds NaN or Inf"):
        validate_weight(Int4Weight(good.qweight, bad, None, 32), "model.layers.0.mlp.up_proj")
    zero = good.scales.clone()
    zero[1, 2] = 0
    with pytest.raises(QuantFormatError, match=r"x\.scales holds 1 zero scales"):
        validate_weight(Int4Weight(good.qweight, zero, None, 32), "x")
    validate_weight(Int4Weight(good.qweight, zero, None, 32), "x", allow_zero_scales=True)
    not_a_perm = torch.zeros(64, dtype=torch.int32)
    with pytest.raises(QuantFormatError, match=r"x\.perm is not a permutation of 0\.\.63"):
        validate_weight(Int4Weight(good.qweight, good.scales, None, 32, not_a_perm), "x")
    w = fp8(4, 16)
    w.weight.view(torch.uint8)[1, 1] = 0xFF
    with pytest.raises(QuantFormatError, match=r"x\.weight holds NaN codes"):
        validate_weight(w, "x")


def test_the_dataclasses_refuse_tensors_that_do_not_form_the_layout():
    w = int4(8, 64)
    with pytest.raises(QuantFormatError, match="group_size 256 is not one the INT4 kernels"):
        Int4Weight(w.qweight, w.scales, None, 256)
    with pytest.raises(QuantFormatError, match=r"scales must be \[G, N\] = \(2, 8\)"):
        Int4Weight(w.qweight, w.scales[:1], None, 32)
    with pytest.raises(QuantFormatError, match=r"scale must be \[N\] = \(4,\) float32"):
        Fp8Weight(fp8(4, 16).weight, torch.ones(4, dtype=torch.float16))
    with pytest.raises(QuantFormatError, match=r"qweight must be \[N, K\] int8"):
        Int8Weight(torch.zeros(4, 32, dtype=torch.uint8), torch.ones(1, 4), 32)


def test_int4_bytes_are_about_a_quarter_of_bfloat16():
    w = int4(4096, 4096, 128, offsets=False)
    assert nbytes(w) / (4096 * 4096 * 2) == pytest.approx(0.25 + 2 / 128 / 2, rel=1e-6)


def test_integer_zero_points_are_found_from_the_values_and_only_when_exact():
    w = int4(24, 128, 64)  # offsets -z * scale, z in 0..15
    marked = mark_integer_zeros(w)
    assert marked.zeros is not None
    assert marked.zeros.dtype == torch.int32
    assert torch.equal(-marked.zeros.float() * w.scales.float(), w.offsets.float())
    assert torch.equal(marked.dequantize(), w.dequantize())  # the zeros change no value
    # A GGUF-like minimum that is no whole number of scales: no zeros, the offsets serve.
    fractional = w.offsets.clone()
    fractional[1, 3] += w.scales[1, 3].float() * 0.25
    assert mark_integer_zeros(Int4Weight(w.qweight, w.scales, fractional, 64)).zeros is None
    assert mark_integer_zeros(int4(24, 128, 64, offsets=False)).zeros is None
    # Zero points past 127 (a shifted grid) are not kept either: BIAS + z would round in
    # bfloat16, where the kernel unpacks codes.
    for shift in (125, 300):  # z up to 140, and past a byte
        shifted = Int4Weight(w.qweight, w.scales, w.offsets - shift * w.scales.float(), 64)
        assert mark_integer_zeros(shifted).zeros is None
    top = 127 - int(marked.zeros.max())  # the largest z then 127: kept
    shifted = Int4Weight(w.qweight, w.scales, w.offsets - top * w.scales.float(), 64)
    assert torch.equal(mark_integer_zeros(shifted).zeros, marked.zeros + top)


def test_zero_points_are_part_of_a_weight_s_structure_and_fusing_drops_them():
    from sitsd.quant.linear import same_structure

    w = int4(16, 128, 64)
    marked = mark_integer_zeros(w)
    assert not same_structure(marked, w)  # another kernel variant: the slot is rebuilt
    with pytest.raises(QuantFormatError, match="zeros: only the destination has one"):
        copy_weight_(marked, w)
    assert torch.equal(narrow_rows(marked, 4, 8).zeros, marked.zeros[:, 4:12])
    fused = concat_rows([marked, int4(8, 128, 64)])
    assert fused.zeros is None  # found again, for the whole, when its values are read
    assert mark_integer_zeros(fused).zeros is not None
    with pytest.raises(QuantFormatError, match=r"zeros must be \[G, N\] = \(2, 16\) int32"):
        Int4Weight(w.qweight, w.scales, w.offsets, 64, zeros=marked.zeros.to(torch.uint8))


def test_slice_major_codes_are_the_same_weight_and_another_structure():
    from sitsd.quant.linear import same_structure

    w = mark_integer_zeros(int4(24, 384, 128))
    sliced = to_slice_major_weight(w)
    assert sliced.slice_major
    assert sliced.perm is not None
    assert torch.equal(sliced.dequantize(), w.dequantize())  # the same W, every value
    assert torch.equal(sliced.scales, w.scales)
    assert torch.equal(sliced.zeros, w.zeros)
    assert not same_structure(sliced, w)  # another kernel variant: the slot is rebuilt
    assert to_slice_major_weight(sliced) is sliced
    assert same_structure(sliced, to_slice_major_weight(mark_integer_zeros(int4(24, 384, 128))))
    # Output rows keep the reordering (it is along K): fusing and views stay right.
    assert torch.equal(narrow_rows(sliced, 4, 8).dequantize(), w.dequantize()[4:12])
    fused = concat_rows([sliced, to_slice_major_weight(int4(8, 384, 128))])
    assert fused.slice_major
    assert fused.shape == (32, 384)


def test_slice_major_is_left_out_where_the_layout_cannot_take_it():
    for w in (int4(8, 256, 64), int4(8, 576, 128), int4(8, 256, 128, perm=True)):
        assert to_slice_major_weight(w) is w  # groups of 64, K = 576, an act-order of its own
    w = int4(8, 256, 128)
    with pytest.raises(QuantFormatError, match="slice-major codes need groups of 128, K a mult"):
        Int4Weight(w.qweight, w.scales, w.offsets, 128, slice_major=True)
    w64 = int4(8, 256, 64, perm=True)
    with pytest.raises(QuantFormatError, match="got group size 64, K 256, perm given"):
        Int4Weight(w64.qweight, w64.scales, w64.offsets, 64, w64.perm, slice_major=True)
