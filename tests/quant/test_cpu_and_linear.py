"""The CPU int4 path (torch's packed-int4 GEMM behind `CpuInt4Weight`) against the reference,
the default route of every layout, and `convert_linear` picking each format's tensors."""

from __future__ import annotations

import pytest
import torch

from sitsd.kernels.quant_reference import fp8_matmul_ref, int4_matmul_ref
from sitsd.quant.config import QuantScheme
from sitsd.quant.convert import convert_linear
from sitsd.quant.cpu import CpuInt4Weight, int4_cpu_matmul
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Fp8Weight, Int4Weight, Int8Weight, nbytes
from sitsd.quant.linear import quantized_linear, to_serving_layout
from sitsd.quant.rtn import quantize_int8
from tests.kernels.helpers import assert_close
from tests.quant.format_code import awq_pack, gptq_pack
from tests.quant.test_layout import int4, int8


def _ref(x, w: Int4Weight) -> torch.Tensor:
    return int4_matmul_ref(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm)


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("offsets", [False, True])
@pytest.mark.parametrize("num_rows", [1, 16])
def test_cpu_int4_matches_the_reference_within_bfloat16(group_size, offsets, num_rows):
    weight = int4(48, 4 * group_size, group_size, offsets=offsets)
    x = torch.randn(num_rows, 4 * group_size)
    out = int4_cpu_matmul(x, CpuInt4Weight.from_int4(weight))
    assert out.dtype == torch.float32
    # bfloat16 inside (x, scales and zeros rounded once each, then the output): bf16 bounds.
    assert_close(out, _ref(x, weight), torch.bfloat16)


def test_cpu_int4_pads_odd_rows_splits_a_short_last_group_and_applies_act_order():
    # N = 37 (not a multiple of 16), K = 576 with groups of 128 (SmolLM2, GPTQ): the CPU op
    # takes groups of 64 there, each scale repeated; act-order gathers x's columns first.
    weight = int4(37, 576, 128, offsets=True, perm=True)
    cpu = CpuInt4Weight.from_int4(weight)
    assert cpu.group_size == 64
    assert cpu.shape == (37, 576)
    x = torch.randn(3, 576)
    assert_close(int4_cpu_matmul(x, cpu), _ref(x, weight), torch.bfloat16)


def test_cpu_int4_holds_about_a_quarter_of_bfloat16_and_an_eighth_of_float32():
    weight = int4(576, 1536, 64, offsets=True)
    cpu = CpuInt4Weight.from_int4(weight)
    per_weight = cpu.nbytes / (576 * 1536)
    assert per_weight == pytest.approx(0.5 + 4 / 64)  # codes + a bf16 (scale, zero) per group
    assert nbytes(weight) / (576 * 1536) == pytest.approx(0.5 + 6 / 64)  # fp16 + fp32 offsets


def test_cpu_int4_refuses_what_the_op_cannot_take():
    weight = int4(16, 8 * 13, 32, offsets=False)  # K = 104: no CPU group size divides it
    with pytest.raises(QuantFormatError, match="no group size the CPU int4 matmul takes"):
        CpuInt4Weight.from_int4(weight)
    cpu = CpuInt4Weight.from_int4(int4(16, 64))
    with pytest.raises(ValueError, match=r"x must have shape \[M, K\] with K = 64"):
        int4_cpu_matmul(torch.randn(2, 32), cpu)


def _bf16_ref(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """`x @ W.T` with x rounded to bfloat16 first, as the CPU routes do, then exact (float64):
    what is left between a route and this is the output's rounding and the order of the sums,
    both relative to |y|, so bfloat16's bounds hold whatever the seed."""
    return (x.to(torch.bfloat16).double() @ w.double().T).to(x.dtype)


def test_every_layout_has_a_route_on_the_cpu():
    x = torch.randn(4, 128)
    w4 = int4(24, 128, 32)
    served = to_serving_layout(w4, "cpu")
    assert isinstance(served, CpuInt4Weight)
    assert_close(quantized_linear(x, served), _ref(x, w4), torch.bfloat16)
    assert_close(quantized_linear(x, w4), _ref(x, w4), torch.float32)  # dequantize + matmul
    w8 = int8(24, 128)  # groups of 32 (GGUF Q8_0): bfloat16 W for the call
    w8 = Int8Weight(w8.qweight, w8.scales / 128, 32)  # outputs of order 1
    assert_close(
        quantized_linear(x, w8), _bf16_ref(x, w8.dequantize(torch.bfloat16)), torch.bfloat16
    )
    per_row = quantize_int8(torch.randn(24, 128) / 8)  # torch's CPU int8 GEMM, outputs of order 1
    bf16_scales = per_row.scales[0].to(torch.bfloat16).double()  # the op takes bfloat16 scales
    w_op = per_row.qweight.double() * bf16_scales[:, None]
    assert_close(quantized_linear(x, per_row), _bf16_ref(x, w_op), torch.bfloat16)
    fp8 = Fp8Weight((torch.randn(24, 128) * 8).to(torch.float8_e4m3fn), torch.rand(24) / 90 + 1e-3)
    # No FP8 GEMM on a CPU: weight-only, so x is not quantized (unlike W8A8 on CUDA).
    assert_close(
        quantized_linear(x, fp8), _bf16_ref(x, fp8.dequantize(torch.bfloat16)), torch.bfloat16
    )
    assert not torch.equal(quantized_linear(x, fp8), fp8_matmul_ref(x, fp8.weight, fp8.scale))


def test_convert_linear_picks_each_formats_tensors_and_names_a_missing_one():
    n, k, g = 32, 128, 64
    codes, zeros = torch.randint(0, 16, (k, n)), torch.randint(1, 16, (k // g, n))
    scales = (torch.rand(k // g, n) * 0.01 + 1e-3).half()
    module = "model.layers.0.self_attn.o_proj"
    qweight, qzeros = awq_pack(codes, zeros)
    awq = {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales}
    scheme = QuantScheme(method="awq", group_size=g, symmetric=False)
    assert convert_linear(scheme, awq, module, (n, k)).shape == (n, k)
    qweight, qzeros = gptq_pack(codes, zeros, minus_one=True)
    gptq = {f"{module}.qweight": qweight, f"{module}.qzeros": qzeros, f"{module}.scales": scales}
    scheme = QuantScheme(method="gptq", group_size=g, symmetric=False, zeros_minus_one=True)
    expected = (
        (codes - zeros.repeat_interleave(g, 0)).double() * scales.double().repeat_interleave(g, 0)
    ).T
    assert torch.equal(convert_linear(scheme, gptq, module, (n, k)).dequantize().double(), expected)
    del gptq[f"{module}.scales"]
    with pytest.raises(QuantFormatError, match=r"o_proj\.scales is missing"):
        convert_linear(scheme, gptq, module, (n, k))
    fp8 = {f"{module}.weight": torch.randn(n, k).to(torch.float8_e4m3fn),
           f"{module}.weight_scale": torch.tensor(0.02)}  # fmt: skip
    fp8_scheme = QuantScheme(method="fp8", layout="fp8", group_size=None)
    assert isinstance(convert_linear(fp8_scheme, fp8, module, (n, k)), Fp8Weight)
