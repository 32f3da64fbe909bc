"""A linear layer's weight as the model holds it, whatever its precision, and the default way to
multiply it.

`LinearWeight` is a 16-bit (or float32) tensor `[N, K]` or a `ServingWeight`: a quantized layout
in the form its device's kernels read (`to_serving_layout`: INT4 in torch's CPU packing on a
CPU; on CUDA the layouts as they are, INT4 codes in groups of 128 made slice-major). The
helpers below treat every form alike, as the model's weight table and the weight slots need:
`weight_tensors` / `weight_nbytes` (what a slot holds), `empty_weight_like` and
`copy_weight_into` (a standby slot allocated once, filled in place), `same_structure` (whether
a new version fits a slot's tensors as they are) and `precision_of` (the name an operator
reads: `int4-g128`, `fp8`, `bf16`, ...).

`quantized_linear(x, weight)` is the plain route of every layout on every device (torch's CPU
int4 GEMM, `int4_matmul`, `fp8_matmul` (W8A8) on CUDA and FP8 weight-only on a CPU, torch's
CPU int8 GEMM, a dequantized INT8 weight elsewhere); which kernel runs a layer at
which row count (e.g. dequantize + cuBLAS for long prefill chunks) is the model's linear dispatch,
which may call the kernels directly.
"""

from __future__ import annotations

import dataclasses

import torch

from sitsd.quant.cpu import CpuInt4Weight, int4_cpu_matmul
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import (
    Fp8Weight,
    Int4Weight,
    Int8Weight,
    QuantizedWeight,
    mark_integer_zeros,
    move_to,
    to_slice_major_weight,
)

__all__ = [
    "LinearWeight",
    "ServingWeight",
    "copy_weight_into",
    "empty_weight_like",
    "precision_of",
    "quantized_linear",
    "same_structure",
    "to_serving_layout",
    "weight_nbytes",
    "weight_tensors",
]

ServingWeight = QuantizedWeight | CpuInt4Weight
LinearWeight = torch.Tensor | ServingWeight
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def to_serving_layout(weight: QuantizedWeight, device: torch.device | str) -> ServingWeight:
    """`weight` on `device`, INT4 in torch's CPU packing when that device is the CPU."""
    device = torch.device(device)
    if isinstance(weight, Int4Weight):
        if device.type == "cpu":
            return CpuInt4Weight.from_int4(weight)
        return mark_integer_zeros(to_slice_major_weight(move_to(weight, device)))
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
        return int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm,
                           zeros=w.zeros, slice_major=w.slice_major)  # fmt: skip
    if isinstance(weight, Fp8Weight):
        return _fp8_linear(x, weight)
    if isinstance(weight, Int8Weight) and x.device.type == "cpu":
        return _int8_cpu_linear(x, weight)
    return x @ weight.dequantize(x.dtype).T


def _fp8_linear(x: torch.Tensor, weight: Fp8Weight) -> torch.Tensor:
    if x.device.type != "cuda":
        # No FP8 matmul on a CPU: weight-only, W dequantized to bfloat16 for the call (W8A16).
        return (x.to(torch.bfloat16) @ weight.dequantize(torch.bfloat16).T).to(x.dtype)
    from sitsd.kernels.fp8_matmul import fp8_matmul  # triton: CUDA hosts only

    n, k = weight.shape
    fits_scaled_mm = n % 16 == 0 and k % 16 == 0 and x.dtype == torch.bfloat16
    backend = "scaled_mm" if fits_scaled_mm else "triton"
    return fp8_matmul(x, weight.weight, weight.scale, backend=backend)


def _int8_cpu_linear(x: torch.Tensor, weight: Int8Weight) -> torch.Tensor:
    """INT8 on the CPU in bfloat16: torch's int8 GEMM for one scale per row, else W dequantized
    to bfloat16 for the call (GGUF Q8_0's groups of 32: no CPU kernel reads them)."""
    xb = x.to(torch.bfloat16)
    if weight.group_size == weight.shape[1]:
        scales = weight.scales[0].to(torch.bfloat16)  # [N]
        y = torch.ops.aten._weight_int8pack_mm(xb, weight.qweight, scales)
    else:
        y = xb @ weight.dequantize(torch.bfloat16).T
    return y.to(x.dtype)


# ----------------------------------------------------------------- every form of a weight


def _fields(weight: ServingWeight) -> list[tuple[str, torch.Tensor | None]]:
    """(name, tensor or None) of every tensor-valued field (None: an absent optional one)."""
    out: list[tuple[str, torch.Tensor | None]] = []
    for f in dataclasses.fields(weight):
        value = getattr(weight, f.name)
        if value is None or isinstance(value, torch.Tensor):
            out.append((f.name, value))
    return out


def weight_tensors(weight: LinearWeight) -> list[tuple[str, torch.Tensor]]:
    """(suffix, tensor) of what the weight holds: `("", W)` for a dense one, the layout's fields
    (`qweight`, `scales`, ...) otherwise."""
    if isinstance(weight, torch.Tensor):
        return [("", weight)]
    return [(name, t) for name, t in _fields(weight) if t is not None]


def weight_nbytes(weight: LinearWeight) -> int:
    """Bytes the weight holds (what one pass over it reads)."""
    return sum(t.numel() * t.element_size() for _, t in weight_tensors(weight))


def empty_weight_like(weight: LinearWeight, *, zero: bool = False) -> LinearWeight:
    """Fresh tensors of the same form, shapes and dtypes (uninitialized, or zeros)."""
    make = torch.zeros_like if zero else torch.empty_like
    if isinstance(weight, torch.Tensor):
        return make(weight)
    fresh = {name: make(t) for name, t in _fields(weight) if t is not None}
    return dataclasses.replace(weight, **fresh)  # type: ignore[arg-type]


def same_structure(a: LinearWeight, b: LinearWeight) -> bool:
    """Whether `b` can be copied into `a`'s tensors: one form, the same optional tensors, shapes,
    dtypes and other fields (group size, rows)."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.shape == b.shape
            and a.dtype == b.dtype
        )
    if type(a) is not type(b):
        return False
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (
                isinstance(x, torch.Tensor)
                and isinstance(y, torch.Tensor)
                and x.shape == y.shape
                and x.dtype == y.dtype
            ):
                return False
        elif x != y:
            return False
    return True


def copy_weight_into(dst: LinearWeight, src: LinearWeight) -> None:
    """Copy `src` into `dst`'s tensors in place (`same_structure` must hold)."""
    if not same_structure(dst, src):
        raise QuantFormatError(
            f"cannot copy a {precision_of(src)} weight into a {precision_of(dst)} slot of another "
            "structure"
        )
    for (_, d), (_, s) in zip(weight_tensors(dst), weight_tensors(src), strict=True):
        d.copy_(s, non_blocking=True)


def precision_of(weight: LinearWeight) -> str:
    """`int4-g<group>` (`int4-g<group>-sym` without zero points), `int8`, `fp8`, or the dense
    dtype's name (`bf16`, `fp16`, `fp32`)."""
    if isinstance(weight, torch.Tensor):
        return _DTYPE_NAMES.get(weight.dtype, str(weight.dtype).removeprefix("torch."))
    if isinstance(weight, Int4Weight):
        return f"int4-g{weight.group_size}" + ("-sym" if weight.offsets is None else "")
    if isinstance(weight, CpuInt4Weight):
        return f"int4-g{weight.source_group_size}" + ("-sym" if weight.symmetric else "")
    if isinstance(weight, Int8Weight):
        return "int8"
    return "fp8"
