"""A default `x @ W.T` for every quantized layout, on every device.

`quantized_linear` routes by layout and device: an `Int4Weight` on CUDA to the Triton
`int4_matmul` (its default configuration), a `CpuInt4Weight` to torch's CPU int4 GEMM, an
`Fp8Weight` on CUDA to `fp8_matmul` (torch's scaled matmul where it takes the shape, the Triton
GEMM elsewhere); anything else dequantizes and multiplies in x's dtype (correct everywhere, fast
nowhere). `to_serving_layout` puts a converted weight in the form its device serves fastest (on
the CPU: `CpuInt4Weight` for INT4).

This is the route tests, benchmarks and the CPU runtime can rely on; per-shape choices measured on
a GPU (split-K, dequantize + cuBLAS for long prefill chunks) belong to the model's linear
dispatch, which may call the kernels directly.
"""

from __future__ import annotations

import torch

from sitsd.kernels.quant_reference import fp8_matmul_ref
from sitsd.quant.cpu import CpuInt4Weight, int4_cpu_matmul
from sitsd.quant.layout import Fp8Weight, Int4Weight, QuantizedWeight, move_to

__all__ = ["ServingWeight", "quantized_linear", "to_serving_layout"]

ServingWeight = QuantizedWeight | CpuInt4Weight


def to_serving_layout(weight: QuantizedWeight, device: torch.device | str) -> ServingWeight:
    """`weight` on `device`, INT4 in torch's CPU packing when that device is the CPU."""
    device = torch.device(device)
    if isinstance(weight, Int4Weight):
        if device.type == "cpu":
            return CpuInt4Weight.from_int4(weight)
        return move_to(weight, device)
    if isinstance(weight, Fp8Weight):  # one call per layout: move_to keeps the layout's type
        return move_to(weight, device)
    return move_to(weight, device)


def quantized_linear(x: torch.Tensor, weight: ServingWeight) -> torch.Tensor:  # [M, N]
    """`x [M, K] @ W.T` in x's dtype."""
    if isinstance(weight, CpuInt4Weight):
        return int4_cpu_matmul(x, weight)
    if x.device.type == "cuda" and isinstance(weight, Int4Weight):
        from sitsd.kernels.int4_matmul import int4_matmul  # triton: CUDA hosts only

        w = weight
        return int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm)
    if isinstance(weight, Fp8Weight):
        return _fp8_linear(x, weight)
    return x @ weight.dequantize(x.dtype).T


def _fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    if x.device.type != "cuda":
        return fp8_matmul_ref(x, weight.weight, weight.scale)
    from sitsd.kernels.fp8_matmul import fp8_matmul  # triton: CUDA hosts only

    n, k = weight.shape
    fits_scaled_mm = n % 16 == 0 and k % 16 == 0 and x.dtype == torch.bfloat16
    backend = "scaled_mm" if fits_scaled_mm else "triton"
    return fp8_matmul(x, weight.weight, weight.scale, backend=backend)
