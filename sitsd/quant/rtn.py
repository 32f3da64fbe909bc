"""Round-to-nearest quantization of a dense weight: INT4 per group, INT8 and FP8 per row.

`quantize_int4(w, group_size)` gives `Int4Codes`: integer codes, float16 scales and (asymmetric,
the default) integer zero points, as AWQ and compressed-tensors store them, so that the same
codes become the serving layout (`to_layout`) or a checkpoint (`sitsd.quant.export`). Per group
of `group_size` consecutive inputs of a row: `scale = (max - min) / 15`, `zero = round(-min /
scale)`, `q = clamp(round(w / scale) + zero, 0, 15)` and `W = (q - zero) * scale`; symmetric:
`scale = max|w| / 7.5` and zero point 8. `clip` shrinks each group's range first (the scale
search of `sitsd.quant.ptq` picks it). `quantize_int8` (symmetric, per row, `scale = max|w| /
127`) and `quantize_fp8` (per row, `scale = max|w| / 448`) give their layouts directly.

Used by the precision map at load (`sitsd serve --quantize`) and by `sitsd quantize`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sitsd.kernels.quant_layout import FP8_DTYPE, FP8_MAX, GROUP_SIZES, pack_int4
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Fp8Weight, Int4Weight, Int8Weight

if TYPE_CHECKING:
    from sitsd.quant.precision import Precision

__all__ = ["Int4Codes", "quantize_fp8", "quantize_int4", "quantize_int4_as", "quantize_int8"]

_TINY = 1e-10  # the smallest scale: an all-zero group quantizes to zeros, never to 0 / 0


@dataclass(frozen=True)
class Int4Codes:
    """INT4 group-quantized W `[N, K]` in integers: `W = (codes - zeros) * scales`."""

    codes: torch.Tensor  # [N, K] uint8, 0..15 (columns in `perm` order when it is set)
    scales: torch.Tensor  # [G, N] float16
    zeros: torch.Tensor | None  # [G, N] uint8, 0..15; None: symmetric (zero point 8)
    group_size: int
    # [K] int32 or None: act-order (GPTQ's), code column j quantizes input column perm[j], so
    # the groups are runs of `group_size` columns in that order (the layout's `perm`)
    perm: torch.Tensor | None = None

    def to_layout(self) -> Int4Weight:
        """The serving layout of the same W (float32 offsets `-zero * scale`: exact)."""
        offsets = None
        if self.zeros is not None:
            offsets = -(self.zeros.float() * self.scales.float())
        return Int4Weight(
            pack_int4(self.codes), self.scales.contiguous(), offsets, self.group_size, self.perm
        )

    def natural_codes(self) -> torch.Tensor:  # [N, K] uint8
        """The codes with columns in the inputs' order (act-order undone)."""
        if self.perm is None:
            return self.codes
        natural = torch.empty_like(self.codes)
        natural[:, self.perm.long()] = self.codes
        return natural

    def group_index(self) -> torch.Tensor:  # [K] int32
        """The group of each input column (GPTQ's and compressed-tensors' `g_idx`)."""
        k = self.codes.shape[1]
        groups = torch.arange(k, dtype=torch.int32) // self.group_size
        if self.perm is None:
            return groups
        natural = torch.empty_like(groups)
        natural[self.perm.long()] = groups
        return natural

    def dequantize(self) -> torch.Tensor:  # [N, K] float32
        """W in float32 (exact), input columns in x's order."""
        return self.to_layout().dequantize()


def _groups(w: torch.Tensor, group_size: int, name: str) -> torch.Tensor:  # [N, G, g]
    if group_size not in GROUP_SIZES:
        raise QuantFormatError(
            f"{name}: group size {group_size} is not one the INT4 kernels take {GROUP_SIZES}"
        )
    n, k = w.shape
    if k % group_size:
        raise QuantFormatError(f"{name}: K = {k} is not a multiple of the group size {group_size}")
    return w.float().reshape(n, k // group_size, group_size)


def quantize_int4(
    w: torch.Tensor,
    group_size: int = 128,
    *,
    symmetric: bool = False,
    clip: torch.Tensor | None = None,
    name: str = "weight",
) -> Int4Codes:
    """Round-to-nearest INT4 codes of `w` `[N, K]`, `group_size` inputs per scale.

    Args:
        w: The dense weight (any float dtype, any device).
        group_size: 32, 64 or 128; must divide K.
        symmetric: zero point 8 (`W = (q - 8) * scale`) instead of a zero point per group.
        clip: `[N, G]` (or broadcastable) factors in (0, 1] that shrink each group's range
            before it is quantized; None keeps the full range.
        name: For errors.
    """
    g = _groups(w, group_size, name)  # [N, G, g]
    if symmetric:
        amax = g.abs().amax(dim=-1)  # [N, G]
        if clip is not None:
            amax = amax * clip
        scales = (amax / 7.5).clamp_min(_TINY).half()  # 8 * scale reaches the largest magnitude
        s = scales.float()[..., None]
        codes = (torch.round(g / s) + 8).clamp(0, 15)
        zeros = None
    else:
        lo, hi = g.amin(dim=-1).clamp(max=0.0), g.amax(dim=-1).clamp(min=0.0)  # [N, G]
        if clip is not None:
            lo, hi = lo * clip, hi * clip
        scales = ((hi - lo) / 15).clamp_min(_TINY).half()
        s = scales.float()
        zero = torch.round(-lo / s).clamp(0, 15)  # [N, G]
        codes = (torch.round(g / s[..., None]) + zero[..., None]).clamp(0, 15)
        zeros = zero.to(torch.uint8).T.contiguous()
    codes = codes.reshape(w.shape).to(torch.uint8)
    return Int4Codes(codes, scales.T.contiguous(), zeros, group_size)


def quantize_int4_as(w: torch.Tensor, precision: Precision, name: str = "weight") -> Int4Codes:
    """`w` rounded as an INT4 `precision` of a map asks at load (`sitsd serve --quantize`): its
    group size, symmetric or with zero points, the full range."""
    return quantize_int4(w, precision.group_size, symmetric=precision.symmetric, name=name)


def quantize_int8(w: torch.Tensor) -> Int8Weight:
    """Symmetric per-row INT8: `scale = max|w| / 127` (float32), `W = q * scale`."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / 127).clamp_min(_TINY)  # [N]
    codes = torch.round(wf / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return Int8Weight(codes, scale[None, :].contiguous(), w.shape[1])


def quantize_fp8(w: torch.Tensor) -> Fp8Weight:
    """Per-row FP8 e4m3: `scale = max|w| / 448` (float32), `W = e4m3(w / scale) * scale`."""
    wf = w.float()
    scale = (wf.abs().amax(dim=1) / FP8_MAX).clamp_min(_TINY)  # [N]
    codes = (wf / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return Fp8Weight(codes, scale.contiguous())
