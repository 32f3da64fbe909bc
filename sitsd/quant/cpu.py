"""INT4 weights on the CPU: torch's packed-int4 matmul (`aten._weight_int4pack_mm_for_cpu`).

torch 2.13's CPU build has an AVX-512 int4 GEMM behind two private ops:
`_convert_weight_to_int4pack_for_cpu(codes [N, K] int32, inner_k_tiles)` packs the codes into an
opaque `[N, K / 2]` uint8 tile order (N must be a multiple of 16), and
`_weight_int4pack_mm_for_cpu(x, packed, group_size, scales_and_zeros [K / g, N, 2])` multiplies,
with `W = (q - 8) * scale + zero` per group of g consecutive inputs (g in 32, 64, 128, 256
dividing K). Measured on the 2-core development machine (`bench/bench_int4_cpu.py`): with
bfloat16 activations and scales it runs SmolLM2's layers 2.5-3.5x faster than the float32
matmul; with float32 ones it falls back to a path 15x *slower*. So `CpuInt4Weight` holds
bfloat16 scales and zeros and `int4_cpu_matmul` runs in bfloat16 (x rounded to bfloat16 once,
float32 sums inside, the output rounded to bfloat16 and returned in x's dtype).

`CpuInt4Weight.from_int4` converts an `Int4Weight` (the layout every format is converted into)
once, at load: codes unpacked and repacked by torch, rows padded to a multiple of 16 (sliced off
after the matmul), `zero = offset + 8 * scale` (so `(q - 8) * scale + zero = q * scale + offset`),
scales and zeros rounded to bfloat16 (a relative error of at most 2**-9 per scale: bfloat16
rounding of W itself), a group size that does not divide K expressed with a smaller one (each
scale repeated), act-order applied to x's columns before the matmul.

Choosing this path for CPU layers is the model's decision; the Triton kernels serve CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sitsd.kernels.quant_layout import unpack_int4
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Int4Weight

__all__ = ["CPU_GROUP_SIZES", "CpuInt4Weight", "int4_cpu_matmul"]

CPU_GROUP_SIZES = (32, 64, 128, 256)  # what the torch op takes
_ROW_MULTIPLE = 16  # N granularity of torch's CPU packing
_INNER_K_TILES = 2  # the CPU packing ignores it, but the op checks it is 2, 4 or 8


@dataclass(frozen=True)
class CpuInt4Weight:
    """An INT4 weight in torch's CPU packing (see the module docstring)."""

    packed: torch.Tensor  # [N_pad, K // 2] uint8, torch's tile order; N_pad = N rounded up to 16
    scales_and_zeros: torch.Tensor  # [K // group_size, N_pad, 2] bfloat16: (scale, zero)
    group_size: int  # divides K; one of CPU_GROUP_SIZES
    num_rows: int  # N
    perm: torch.Tensor | None  # [K] int64: act-order, x's columns gathered before the matmul
    source_group_size: int  # the group size of the `Int4Weight` it was made from
    symmetric: bool = False  # that weight had no offsets (zero point 8: GPTQ's `sym`)

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of W."""
        return self.num_rows, self.packed.shape[1] * 2

    @property
    def nbytes(self) -> int:
        """Bytes held (the weight memory of this layer on the CPU)."""
        tensors = [self.packed, self.scales_and_zeros]
        if self.perm is not None:
            tensors.append(self.perm)
        return sum(t.numel() * t.element_size() for t in tensors)

    @classmethod
    def from_int4(cls, weight: Int4Weight) -> CpuInt4Weight:
        """Convert an INT4 weight (on any device) into torch's CPU packing, on the CPU."""
        n, k = weight.shape
        group = _cpu_group_size(k, weight.group_size)
        repeat = weight.group_size // group
        scales = weight.scales.float().cpu()  # [G, N]
        offsets = -8.0 * scales if weight.offsets is None else weight.offsets.float().cpu()
        zeros = offsets + 8.0 * scales
        table = torch.stack([scales, zeros], dim=-1)  # [G, N, 2]
        table = table.repeat_interleave(repeat, dim=0)[: k // group]  # [K // group, N, 2]
        n_pad = -(-n // _ROW_MULTIPLE) * _ROW_MULTIPLE
        codes = unpack_int4(weight.qweight.cpu()).to(torch.int32)  # [N, K]
        if n_pad != n:
            codes = torch.cat([codes, torch.full((n_pad - n, k), 8, dtype=torch.int32)])
            table = torch.cat([table, table.new_zeros(table.shape[0], n_pad - n, 2)], dim=1)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, _INNER_K_TILES)
        perm = None if weight.perm is None else weight.perm.cpu().long()
        return cls(packed, table.to(torch.bfloat16).contiguous(), group, n, perm, weight.group_size,
                   weight.offsets is None)  # fmt: skip


def _cpu_group_size(k: int, group_size: int) -> int:
    """The largest group size the torch op takes that divides both `group_size` and K."""
    for group in sorted(CPU_GROUP_SIZES, reverse=True):
        if group <= group_size and group_size % group == 0 and k % group == 0:
            return group
    raise QuantFormatError(
        f"an INT4 weight with K = {k} and group_size {group_size} has no group size the CPU "
        f"int4 matmul takes ({CPU_GROUP_SIZES}, dividing K)"
    )


def int4_cpu_matmul(x: torch.Tensor, weight: CpuInt4Weight) -> torch.Tensor:  # [M, N]
    """`x @ W.T` on the CPU through torch's int4 GEMM, computed in bfloat16, returned in x's
    dtype.

    Args:
        x: `[M, K]` float32/bfloat16/float16 on the CPU.
        weight: The weight in torch's CPU packing.

    Raises:
        ValueError: x's shape or device does not fit the weight.
    """
    n, k = weight.shape
    if x.dim() != 2 or x.shape[1] != k:
        raise ValueError(f"x must have shape [M, K] with K = {k}, got {tuple(x.shape)}")
    if x.device.type != "cpu":
        raise ValueError(f"int4_cpu_matmul runs on the CPU, x is on {x.device}")
    xb = x if weight.perm is None else x.index_select(1, weight.perm)
    xb = xb.to(torch.bfloat16).contiguous()
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(
        xb, weight.packed, weight.group_size, weight.scales_and_zeros
    )  # [M, N_pad] bfloat16
    if y.shape[1] != n:
        y = y[:, :n]
    return y.to(x.dtype)
