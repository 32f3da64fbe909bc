"""The internal layouts of quantized linear weights: one per kernel, whatever the checkpoint format.

A linear layer computes `y = x @ W.T` with W logically `[N, K]` (N outputs, K inputs). A
quantized W is held as one of three frozen dataclasses of tensors, on the device that serves it:

* `Int4Weight`, what `sitsd.kernels.int4_matmul` / `int4_dequantize` read: int32 words of eight
  4-bit codes along K (`qweight [N, K // 8]`), per-group `scales [G, N]` (groups of 32, 64 or 128
  consecutive inputs), optional `offsets [G, N]` (the zero point folded into the float domain,
  `W = q * scale + offset`; without offsets `W = (q - 8) * scale`), and an optional act-order
  permutation `perm [K]` (layout column j multiplies input column perm[j]). The exact definition
  is `sitsd.kernels.quant_layout`'s. `zeros [G, N]` int32, derived from offsets and scales, holds
  the integer zero points z when every offset is `-z * scale` exactly (found from the values by
  `mark_integer_zeros` at load and staging: AWQ, GPTQ, compressed-tensors and RTN weights, not
  GGUF's Q4_1 and Q4_K minima); the INT4 kernel then subtracts z from each code as it unpacks
  them instead of summing x per group. On CUDA, weights with groups of 128 hold their codes
  slice-major (`to_slice_major_weight`: an act-order permutation the INT4 kernels know, so they
  read x in order). On the CPU torch's int4 matmul wants its own packing:
  `sitsd.quant.cpu.CpuInt4Weight` is made from an `Int4Weight` once.
* `Fp8Weight`, what `sitsd.kernels.fp8_matmul` reads: `weight [N, K]` float8_e4m3fn and one
  float32 scale per output row (`scale [N]`; a per-tensor scale is the same value N times).
* `Int8Weight`: `qweight [N, K]` int8 codes and `scales [G, N]`, `W = q * scale` (GGUF Q8_0, group
  32; per-channel when the group is K). No kernel reads it yet: it is dequantized where used.

Each layout can be dequantized (`dequantize`, float32 arithmetic as the formats define it, then one
cast), and the functions below treat all three alike, as a weight slot needs: `narrow_rows` (a view
of some output rows, to copy a q/k/v part of a fused weight in place), `concat_rows` (fusing q/k/v
and gate/up), `select_rows` (reordering rows, e.g. undoing llama.cpp's Q/K permutation),
`empty_like` and `copy_weight_` (a standby slot allocated once, filled in place at staging), and
`validate_weight` (finite, non-zero scales: a host sync, for load and staging).

Converting checkpoint formats into these layouts is the job of the `sitsd.quant` format modules;
choosing a kernel for a layout is the model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar, cast

import torch

from sitsd.kernels.quant_layout import (
    FP8_DTYPE,
    GROUP_SIZES,
    PACK,
    SCALE_DTYPES,
    SLICE_MAJOR_BLOCK,
    num_groups,
    slice_major_perm,
    to_slice_major,
)
from sitsd.kernels.quant_reference import dequantize_int4_ref, dequantize_int8_ref
from sitsd.quant.errors import QuantFormatError

__all__ = [
    "Fp8Weight",
    "Int4Weight",
    "Int8Weight",
    "QuantizedWeight",
    "concat_rows",
    "copy_weight_",
    "empty_like",
    "mark_integer_zeros",
    "move_to",
    "narrow_rows",
    "nbytes",
    "select_rows",
    "to_slice_major_weight",
    "validate_weight",
    "with_tensors",
]

# Field metadata: the axis along which a tensor field runs over W's output rows (None: it does
# not, like an act-order permutation, which all rows share).
_ROWS = "row_axis"


def _rows(axis: int | None) -> dict[str, int | None]:
    return {_ROWS: axis}


def _check(condition: bool, message: str) -> None:
    if not condition:
        raise QuantFormatError(message)


@dataclass(frozen=True)
class Int4Weight:
    """An INT4 group-quantized weight in the layout `int4_matmul` reads."""

    qweight: torch.Tensor = field(metadata=_rows(0))  # [N, K // 8] int32, 8 codes per word
    scales: torch.Tensor = field(metadata=_rows(1))  # [G, N] float16/bfloat16/float32
    offsets: torch.Tensor | None = field(metadata=_rows(1))  # [G, N]; None: zero point 8
    group_size: int  # 32, 64 or 128 consecutive inputs per scale
    perm: torch.Tensor | None = field(default=None, metadata=_rows(None))  # [K] int32
    # [G, N] int32 zero points z in 0..127 with offsets == -z * scale exactly, or None (derived
    # from the values by `mark_integer_zeros`; None is always correct). int32, not a byte: the
    # INT4 kernel's loads of 32 bits are copied ahead asynchronously (`kernels/_int4_mma.py`).
    # Part of the slot's structure: the kernel variant, and so the captured CUDA graphs, depend
    # on it.
    zeros: torch.Tensor | None = field(default=None, metadata=_rows(1))
    # The codes are slice-major (`sitsd.kernels.quant_layout`: perm is `slice_major_perm(K)`),
    # so the INT4 kernels read x in order; set by `to_slice_major_weight`. Part of the slot's
    # structure, as zeros is.
    slice_major: bool = False

    def __post_init__(self) -> None:
        _check(
            self.group_size in GROUP_SIZES,
            f"group_size {self.group_size} is not one the INT4 kernels support {GROUP_SIZES}",
        )
        _check(
            self.qweight.dim() == 2 and self.qweight.dtype == torch.int32,
            f"qweight must be [N, K // 8] int32, got {self.qweight.dtype} "
            f"{tuple(self.qweight.shape)}",
        )
        n, k = self.shape
        groups = (num_groups(k, self.group_size), n)
        for name in ("scales", "offsets"):
            t = getattr(self, name)
            if t is not None:
                _check(
                    t.dtype in SCALE_DTYPES and tuple(t.shape) == groups,
                    f"{name} must be [G, N] = {groups} in float16/bfloat16/float32, got "
                    f"{t.dtype} {tuple(t.shape)}",
                )
        if self.zeros is not None:
            _check(
                self.offsets is not None
                and self.zeros.dtype == torch.int32
                and tuple(self.zeros.shape) == groups,
                f"zeros must be [G, N] = {groups} int32 beside offsets, got {self.zeros.dtype} "
                f"{tuple(self.zeros.shape)}",
            )
        if self.perm is not None:
            _check(
                self.perm.dtype == torch.int32 and tuple(self.perm.shape) == (k,),
                f"perm must be [K] = ({k},) int32, got {self.perm.dtype} {tuple(self.perm.shape)}",
            )
        if self.slice_major:
            _check(
                self.perm is not None
                and self.group_size == SLICE_MAJOR_BLOCK
                and k % SLICE_MAJOR_BLOCK == 0,
                f"slice-major codes need groups of {SLICE_MAJOR_BLOCK}, K a multiple of it and "
                f"their perm; got group size {self.group_size}, K {k}, perm "
                f"{'given' if self.perm is not None else 'None'}",
            )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of W."""
        return self.qweight.shape[0], self.qweight.shape[1] * PACK

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        """W, input columns in x's order (act-order undone)."""
        return dequantize_int4_ref(
            self.qweight, self.scales, self.offsets, self.group_size, self.perm, dtype=dtype
        )

    def with_dtypes(self, scale_dtype: torch.dtype, offset_dtype: torch.dtype) -> Int4Weight:
        """The same W with scales in `scale_dtype` and offsets (made `-8 * scale` when there were
        none) in `offset_dtype`: exact when each dtype holds the values it is given (a wider one
        always does)."""
        offsets = self.scales * -8.0 if self.offsets is None else self.offsets
        return dataclasses.replace(
            self, scales=self.scales.to(scale_dtype), offsets=offsets.to(offset_dtype)
        )


def to_slice_major_weight(weight: Int4Weight) -> Int4Weight:
    """`weight` with its codes slice-major (the same W; see `sitsd.kernels.quant_layout`) where
    it can be: groups of 128, K a multiple of 128, no act-order of its own. Otherwise, or when
    already so, `weight` itself."""
    k = weight.shape[1]
    if (
        weight.slice_major
        or weight.perm is not None
        or weight.group_size != SLICE_MAJOR_BLOCK
        or k % SLICE_MAJOR_BLOCK
    ):
        return weight
    device = weight.qweight.device
    return dataclasses.replace(
        weight,
        qweight=to_slice_major(weight.qweight),
        perm=slice_major_perm(k, device),
        slice_major=True,
    )


def mark_integer_zeros(weight: Int4Weight) -> Int4Weight:
    """`weight` with `zeros` found from its values: the z = `round(-offset / scale)` (float32,
    halves away from zero) when every one gives `offset + z * scale == 0` exactly and lies in
    0..127 (BIAS + z exact in bfloat16, as the kernel unpacks: `kernels/_int4_mma.py`; 4-bit
    formats' zero points are 0..16), else None. Reads values: a host sync, for load and
    staging."""
    if weight.offsets is None:
        return dataclasses.replace(weight, zeros=None)
    offsets, scales = weight.offsets.float(), weight.scales.float()
    z = -offsets / scales
    z = torch.where(z < 0, -torch.floor(0.5 - z), torch.floor(z + 0.5))
    exact = bool(((offsets + z * scales == 0) & (z >= 0) & (z <= 127)).all())
    return dataclasses.replace(weight, zeros=z.to(torch.int32).contiguous() if exact else None)


@dataclass(frozen=True)
class Fp8Weight:
    """An FP8 e4m3 weight with one float32 scale per output row, as `fp8_matmul` reads it."""

    weight: torch.Tensor = field(metadata=_rows(0))  # [N, K] float8_e4m3fn
    scale: torch.Tensor = field(metadata=_rows(0))  # [N] float32

    def __post_init__(self) -> None:
        _check(
            self.weight.dim() == 2 and self.weight.dtype == FP8_DTYPE,
            f"weight must be [N, K] float8_e4m3fn, got {self.weight.dtype} "
            f"{tuple(self.weight.shape)}",
        )
        n = self.weight.shape[0]
        _check(
            self.scale.dtype == torch.float32 and tuple(self.scale.shape) == (n,),
            f"scale must be [N] = ({n},) float32, got {self.scale.dtype} {tuple(self.scale.shape)}",
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of W."""
        return self.weight.shape[0], self.weight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        """W: `weight * scale` in float32 (exact: e4m3 has 4 significant bits), then `dtype`."""
        return (self.weight.float() * self.scale[:, None]).to(dtype)


@dataclass(frozen=True)
class Int8Weight:
    """An INT8 group-quantized weight (`W = q * scale`); dequantized where used, for now."""

    qweight: torch.Tensor = field(metadata=_rows(0))  # [N, K] int8
    scales: torch.Tensor = field(metadata=_rows(1))  # [G, N] float16/bfloat16/float32
    group_size: int  # consecutive inputs per scale; K for one scale per output row

    def __post_init__(self) -> None:
        _check(
            self.qweight.dim() == 2 and self.qweight.dtype == torch.int8,
            f"qweight must be [N, K] int8, got {self.qweight.dtype} {tuple(self.qweight.shape)}",
        )
        n, k = self.shape
        _check(self.group_size > 0, f"group_size must be positive, got {self.group_size}")
        groups = (num_groups(k, self.group_size), n)
        _check(
            self.scales.dtype in SCALE_DTYPES and tuple(self.scales.shape) == groups,
            f"scales must be [G, N] = {groups} in float16/bfloat16/float32, got "
            f"{self.scales.dtype} {tuple(self.scales.shape)}",
        )

    @property
    def shape(self) -> tuple[int, int]:
        """(N, K) of W."""
        return self.qweight.shape[0], self.qweight.shape[1]

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:  # [N, K]
        """W: `q * scale` in float32 (exact), then `dtype`."""
        return dequantize_int8_ref(self.qweight, self.scales, self.group_size, dtype=dtype)


QuantizedWeight = Int4Weight | Fp8Weight | Int8Weight
W = TypeVar("W", bound=QuantizedWeight)


def with_tensors(weight: W, tensors: Mapping[str, torch.Tensor]) -> W:
    """`weight` with the tensor fields named in `tensors` replaced, every other field kept."""
    # dataclasses.replace's signature cannot say that only tensor fields are replaced.
    return dataclasses.replace(weight, **tensors)  # type: ignore[arg-type]


def _tensor_fields(weight: QuantizedWeight) -> list[tuple[str, int | None, torch.Tensor]]:
    """(name, row axis, tensor) of every tensor the weight holds."""
    out = []
    for f in dataclasses.fields(weight):
        value = getattr(weight, f.name)
        if isinstance(value, torch.Tensor):
            out.append((f.name, f.metadata[_ROWS], value))
    return out


def nbytes(weight: QuantizedWeight) -> int:
    """Bytes the weight's tensors hold (what one pass over it reads)."""
    return sum(t.numel() * t.element_size() for _, _, t in _tensor_fields(weight))


def narrow_rows(weight: W, start: int, length: int) -> W:
    """Output rows `start : start + length` of W, as views of the weight's tensors (writing into
    them writes into `weight`; they may be non-contiguous, so no kernel takes them as they are)."""
    parts = {
        name: t.narrow(axis, start, length)
        for name, axis, t in _tensor_fields(weight)
        if axis is not None
    }
    return with_tensors(weight, parts)


def select_rows(weight: W, index: torch.Tensor) -> W:
    """W with its output rows reordered: row i of the result is row `index[i]` of `weight`."""
    index = index.to(device=_device(weight), dtype=torch.long)
    parts = {
        name: t.index_select(axis, index).contiguous()
        for name, axis, t in _tensor_fields(weight)
        if axis is not None
    }
    return with_tensors(weight, parts)


def _device(weight: QuantizedWeight) -> torch.device:
    return _tensor_fields(weight)[0][2].device


def _one_dtype(dtypes: set[torch.dtype]) -> torch.dtype:
    return next(iter(dtypes)) if len(dtypes) == 1 else torch.float32


def _harmonize(parts: Sequence[QuantizedWeight]) -> list[QuantizedWeight]:
    """INT4 parts in one form, exactly: one scale dtype (float32 when they differ), and offsets
    for all when any part has them (`-8 * scale` for the others: exact in the scale's dtype).
    Other layouts as they are."""
    int4 = [p for p in parts if isinstance(p, Int4Weight)]
    if len(int4) != len(parts):
        return list(parts)
    scale_dtype = _one_dtype({p.scales.dtype for p in int4})
    out: list[QuantizedWeight] = []
    if all(p.offsets is None for p in int4):
        out += [dataclasses.replace(p, scales=p.scales.to(scale_dtype)) for p in int4]
        return out
    offset_dtype = _one_dtype(
        {p.scales.dtype if p.offsets is None else p.offsets.dtype for p in int4}
    )
    out += [p.with_dtypes(scale_dtype, offset_dtype) for p in int4]
    return out


def concat_rows(parts: Sequence[W]) -> W:
    """One weight whose output rows are those of `parts` in order (q/k/v, gate/up).

    INT4 parts may differ in scale dtype and in having offsets (`_harmonize` brings them to one
    form, exactly); group size, act-order permutation and K must agree.
    """
    _check(len(parts) > 0, "concat_rows needs at least one weight")
    kinds = {type(p) for p in parts}
    _check(
        len(kinds) == 1,
        f"cannot fuse weights of different layouts: {sorted(k.__name__ for k in kinds)}",
    )
    parts = cast(Sequence[W], _harmonize(parts))  # one layout in, the same layout out
    first = parts[0]
    for i, p in enumerate(parts[1:], start=1):
        _check(
            p.shape[1] == first.shape[1],
            f"part {i} has K = {p.shape[1]}, part 0 K = {first.shape[1]}",
        )
        for f in dataclasses.fields(first):
            if f.name == "zeros":  # derived: found again for the fused weight (below)
                continue
            a, b = getattr(first, f.name), getattr(p, f.name)
            if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
                if f.metadata[_ROWS] is None:  # shared by all rows: must be equal
                    same = (a is None) == (b is None) and (a is None or torch.equal(a, b))
                    _check(same, f"part {i}'s {f.name} differs from part 0's: cannot fuse")
                else:
                    _check(
                        a.dtype == b.dtype, f"part {i}'s {f.name} is {b.dtype}, part 0's {a.dtype}"
                    )
            else:
                _check(a == b, f"part {i}'s {f.name} is {b}, part 0's {a}: cannot fuse")
    fused = {
        name: torch.cat([getattr(p, name) for p in parts], dim=axis).contiguous()
        for name, axis, _ in _tensor_fields(first)
        if axis is not None and name != "zeros"
    }
    if isinstance(first, Int4Weight):  # found for the whole when its values are read again
        return cast(W, dataclasses.replace(first, **fused, zeros=None))  # type: ignore[arg-type]
    return with_tensors(first, fused)


def empty_like(weight: W) -> W:
    """A weight of the same layout and structure with fresh, uninitialized tensors (a standby
    weight slot, filled later by `copy_weight_`)."""
    fresh = {name: torch.empty_like(t) for name, _, t in _tensor_fields(weight)}
    return with_tensors(weight, fresh)


def move_to(weight: W, device: torch.device | str) -> W:
    """`weight` with its tensors on `device`."""
    return with_tensors(weight, {name: t.to(device) for name, _, t in _tensor_fields(weight)})


def copy_weight_(dst: W, src: W) -> W:
    """Copy `src` into `dst`'s tensors in place (a weight slot filled at staging); returns dst.

    Both must have one layout and one structure: the same shapes and dtypes, the same optional
    tensors, the same group size."""
    _check(
        type(dst) is type(src), f"cannot copy a {type(src).__name__} into a {type(dst).__name__}"
    )
    for f in dataclasses.fields(dst):
        a, b = getattr(dst, f.name), getattr(src, f.name)
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            _check(
                a.shape == b.shape and a.dtype == b.dtype,
                f"{f.name}: source {b.dtype} {tuple(b.shape)} does not fit destination "
                f"{a.dtype} {tuple(a.shape)}",
            )
        elif isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
            have = "destination" if isinstance(a, torch.Tensor) else "source"
            raise QuantFormatError(f"{f.name}: only the {have} has one")
        else:
            _check(a == b, f"{f.name}: source {b!r}, destination {a!r}")
    for name, _, t in _tensor_fields(dst):
        t.copy_(getattr(src, name), non_blocking=True)
    return dst


def validate_weight(weight: QuantizedWeight, name: str, *, allow_zero_scales: bool = False) -> None:
    """Raise `QuantFormatError` naming `name.<field>` when scales or offsets hold NaN or Inf, a
    scale is zero (unless `allow_zero_scales`), FP8 codes are NaN, or `perm` is no permutation.

    Reads values: a host sync, for load and staging, never for the step loop.
    """
    if isinstance(weight, Fp8Weight):
        nan_codes = (weight.weight.view(torch.uint8) & 0x7F) == 0x7F  # e4m3fn's only NaN codes
        _check(not bool(nan_codes.any()), f"{name}.weight holds NaN codes")
    for field_name, _, t in _tensor_fields(weight):
        if not t.dtype.is_floating_point or t.dtype == FP8_DTYPE:
            continue
        _check(bool(torch.isfinite(t).all()), f"{name}.{field_name} holds NaN or Inf values")
        if field_name in ("scales", "scale") and not allow_zero_scales:
            zeros = int((t == 0).sum())
            _check(zeros == 0, f"{name}.{field_name} holds {zeros} zero scales")
    perm = getattr(weight, "perm", None)
    if perm is not None:
        k = perm.numel()
        seen = torch.zeros(k, dtype=torch.bool, device=perm.device)
        in_range = bool(((perm >= 0) & (perm < k)).all())
        if in_range:
            seen[perm.long()] = True
        _check(in_range and bool(seen.all()), f"{name}.perm is not a permutation of 0..{k - 1}")
