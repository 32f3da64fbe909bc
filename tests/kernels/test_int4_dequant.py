"""int4_dequantize (Triton) against dequantize_int4_ref: exact in float32, one rounding in 16 bits,
act-order scattered back to x's column order, argument checks; model shapes on the GPU."""

from __future__ import annotations

import pytest
import torch
import triton  # noqa: F401  make test installs it: no kernel test may skip for want of it

from sitsd.kernels.int4_dequant import int4_dequantize
from sitsd.kernels.quant_layout import slice_major_perm, to_slice_major
from sitsd.kernels.quant_reference import dequantize_int4_ref
from tests.kernels.int4_inputs import LLAMA3_8B_SHAPES, SMOLLM2_SHAPES, random_int4


def _assert_one_rounding(out: torch.Tensor, exact: torch.Tensor) -> None:
    """out is exact (float32) rounded once to out's dtype: equal on the GPU; in the interpreter,
    whose fp32 -> bf16 casts truncate (kernels/NOTES.md), at most one ulp away."""
    ref = exact.to(out.dtype)
    if out.device.type == "cuda" or out.dtype != torch.bfloat16:
        assert torch.equal(out, ref)
        return
    ulp = (ref.float().abs() * 2.0**-7).clamp_min(2.0**-133)
    assert ((out.float() - ref.float()).abs() <= ulp).all()
    assert ((out.float() - exact).abs() < ulp).all()  # truncation: strictly within an ulp


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("perm", [False, True])
def test_float32_output_is_the_reference_bit_for_bit(group_size, offsets, perm, device):
    # N = 37 and K = 2 * group + 32: partial tiles and a short last group.
    k = 2 * group_size + 32
    weight = random_int4(37, k, group_size, offsets=offsets, perm=perm, device=device)
    out = int4_dequantize(*weight.args, dtype=torch.float32, block_n=16, block_k=64)
    assert torch.equal(out, dequantize_int4_ref(*weight.args))


@pytest.mark.parametrize(("block_n", "block_k"), [(16, 128), (32, 256), (16, 64)])
@pytest.mark.parametrize("offsets", [False, True])
def test_slice_major_codes_dequantize_to_the_same_weight(block_n, block_k, offsets, device):
    # Tiles of whole blocks turn each block back to column order in registers; 64-column
    # tiles scatter through the permutation. N = 37: a partial tile; K = 3 blocks.
    weight = random_int4(37, 384, 128, offsets=offsets, device=device)
    sliced = (to_slice_major(weight.qweight), weight.scales, weight.offsets, 128,
              slice_major_perm(384, device))  # fmt: skip
    out = int4_dequantize(*sliced, dtype=torch.float32, block_n=block_n, block_k=block_k,
                          slice_major=True)  # fmt: skip
    assert torch.equal(out, dequantize_int4_ref(*weight.args))
    with pytest.raises(ValueError, match="slice-major codes need their perm and group size 128"):
        int4_dequantize(*weight.args, slice_major=True)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_16_bit_output_is_the_float32_value_rounded_once(dtype, device):
    weight = random_int4(40, 256, 64, offsets=True, perm=True, device=device)
    out = int4_dequantize(*weight.args, dtype=dtype)
    _assert_one_rounding(out, dequantize_int4_ref(*weight.args))


def test_writes_into_a_workspace_and_multiplies_like_the_weight(device):
    weight = random_int4(48, 128, 32, offsets=False, device=device)
    workspace = torch.full((48, 128), float("nan"), device=device)
    assert int4_dequantize(*weight.args, out=workspace) is workspace
    x = torch.randn(3, 128, device=device)
    expected = x @ dequantize_int4_ref(*weight.args).T
    torch.testing.assert_close(x @ workspace.T, expected)


def test_rejects_bad_arguments_with_messages(device):
    weight = random_int4(32, 64, 32, offsets=True, device=device)
    with pytest.raises(ValueError, match=r"out must be a torch.float32 tensor of shape \(32, 64\)"):
        int4_dequantize(*weight.args, out=torch.empty(32, 65, device=device))
    with pytest.raises(TypeError, match="dtype must be float32, float16 or bfloat16"):
        int4_dequantize(*weight.args, dtype=torch.int32)
    with pytest.raises(ValueError, match="block_k must be a power of two >= 8"):
        int4_dequantize(*weight.args, block_k=4)
    with pytest.raises(ValueError, match="scales must have shape"):
        int4_dequantize(weight.qweight, weight.scales.T.contiguous(), None, 32)


@pytest.mark.gpu
@pytest.mark.parametrize("shape", sorted([*LLAMA3_8B_SHAPES.values(), *SMOLLM2_SHAPES.values()]))
@pytest.mark.parametrize("group_size", [32, 64, 128])
def test_gpu_model_shapes_round_once(shape, group_size, device):
    n, k = shape
    weight = random_int4(n, k, group_size, offsets=True, perm=group_size == 128, device=device)
    exact = dequantize_int4_ref(*weight.args)
    for dtype in (torch.bfloat16, torch.float16):
        _assert_one_rounding(int4_dequantize(*weight.args, dtype=dtype), exact)
