"""The quantized weight layouts the kernels read: INT4 group-quantized (`int4_matmul`,
`int4_dequantize`) and FP8 e4m3 with per-output scales (`fp8_matmul`).

INT4. A weight W of a linear layer `y = x @ W.T` (W logically `[N, K]`: N outputs, K inputs) is held
as four tensors:

    qweight  [N, K // 8] int32     8 codes per word along K: the code of layout column 8j + i
                                   sits in bits 4i..4i+3 of word j (unsigned, 0..15)
    scales   [G, N]                G = ceil(K / group_size) groups of consecutive layout columns
                                   (the last one shorter when group_size does not divide K);
                                   float16, bfloat16 or float32
    offsets  [G, N] or None        the zero point folded into the float domain; same dtypes
    perm     [K] int32 or None     act-order: layout column j multiplies input column perm[j]

    W_layout[n, j] = q[n, j] * scales[g, n] + offsets[g, n]    with offsets (g = j // group_size)
    W_layout[n, j] = (q[n, j] - 8) * scales[g, n]               without (symmetric: zero point 8)
    W[:, perm[j]]  = W_layout[:, j]                              (W = W_layout without perm)

evaluated in float32. For the scales of every checkpoint format sitsd reads (at most 17
significant bits) each product `q * scale` is exact there, so the one rounding is the add, as in
the formats' own dequantization (`sitsd.quant` converts each format into this layout and says
why the result is bit-exact).

Why this packing: the rows of W stay contiguous along K, like the 16-bit `[N, K]` weights the
other linear kernels stream, so a program reads whole 16-byte vectors of one row; a group is a
whole number of words (group_size is a multiple of 8), and scales are `[G, N]` so that the scales
of a tile of consecutive output columns are one contiguous load.

FP8. W is `weight` `[N, K]` float8_e4m3fn and `weight_scale` `[N]` float32, W[n, :] =
weight[n, :] * weight_scale[n] in float32 (a per-tensor scale is the same value N times);
activations are quantized per token at run time (`quant_reference.per_token_quant_fp8_ref`).

Slice-major codes. A weight with groups of 128 may hold each block of 128 layout columns in
the order the INT4 kernels multiply them: word `16 b + v` of a block, nibble i, holds the code
of input column `128 b + 16 i + v`, so nibble i of the block's 16 words (the kernels' slice i)
covers 16 consecutive input columns. It is an act-order permutation like any other (`perm` =
`slice_major_perm(K)`, the groups unchanged), so every path that reads `perm` stays right; the
`gemv` and `mma` kernels, told the codes are slice-major, read x in order instead of gathering
it through `perm` or copying it into slice order first. `to_slice_major` reorders the codes.

This module only defines the layouts (constants, packing, argument checks) and imports no
triton; converting checkpoint formats into them is `sitsd.quant`'s job, torch's own packing for
its CPU int4 matmul is `sitsd.quant.cpu`'s.
"""

from __future__ import annotations

import sys

import torch

from sitsd.kernels._utils import check_dtype, check_shape

__all__ = [
    "FP8_DTYPE",
    "FP8_MAX",
    "FP8_MIN_SCALE",
    "GROUP_SIZES",
    "PACK",
    "SCALE_DTYPES",
    "SLICE_MAJOR_BLOCK",
    "check_fp8_layout",
    "check_int4_layout",
    "check_slice_major",
    "num_groups",
    "pack_int4",
    "slice_major_perm",
    "to_slice_major",
    "unpack_int4",
]

GROUP_SIZES = (32, 64, 128)  # the group sizes the kernels are built and tested for
PACK = 8  # 4-bit codes per int32 word
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SLICE_MAJOR_BLOCK = 128  # layout columns a slice-major reordering stays within (a group of 128)
_REORDER_BYTES = 64 * 2**20  # the working memory `to_slice_major` aims at
FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# Floor of a per-token activation scale: an all-zero row gets this one instead of 0 (no 0 / 0),
# the floor vLLM's dynamic FP8 quantization uses.
FP8_MIN_SCALE = 1.0 / (FP8_MAX * 512.0)


def num_groups(k: int, group_size: int) -> int:
    """Groups along K (the last one may be shorter)."""
    return -(-k // group_size)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:  # [N, K // 8] int32
    """Pack `[N, K]` integer codes 0..15 (K a multiple of 8) into the layout's int32 words."""
    n, k = codes.shape
    if k % PACK:
        raise ValueError(f"codes must have a multiple of {PACK} columns, got shape {(n, k)}")
    c = codes.to(torch.uint8)
    # Two codes per byte (the even column in the low nibble); four bytes are one little-endian
    # word, so code 8j + i lands in bits 4i..4i+3 of word j.
    pairs = (c[:, 0::2] | (c[:, 1::2] << 4)).contiguous()  # [N, K // 2] uint8
    if sys.byteorder != "little":  # every platform torch ships for is, but say so
        raise RuntimeError("pack_int4 assumes a little-endian host")
    return pairs.view(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:  # [N, K] uint8, codes 0..15
    """The codes of `[N, K // 8]` int32 words, one uint8 per column."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=qweight.device)
    codes = (qweight.unsqueeze(-1) >> shifts) & 0xF  # [N, K // 8, 8]
    return codes.reshape(qweight.shape[0], -1).to(torch.uint8)


def slice_major_perm(k: int, device: torch.device | str = "cpu") -> torch.Tensor:  # [K] int32
    """The act-order permutation of slice-major codes: layout column `8 (16 b + v) + i` holds
    input column `128 b + 16 i + v`. K must be a multiple of `SLICE_MAJOR_BLOCK`."""
    if k % SLICE_MAJOR_BLOCK:
        raise ValueError(f"slice-major codes need K a multiple of {SLICE_MAJOR_BLOCK}, got {k}")
    words = SLICE_MAJOR_BLOCK // PACK
    b = torch.arange(k // SLICE_MAJOR_BLOCK, device=device).view(-1, 1, 1)
    v = torch.arange(words, device=device).view(1, -1, 1)
    i = torch.arange(PACK, device=device).view(1, 1, -1)
    return (SLICE_MAJOR_BLOCK * b + words * i + v).reshape(k).to(torch.int32)


def to_slice_major(qweight: torch.Tensor) -> torch.Tensor:  # [N, K // 8] int32
    """`qweight`'s codes (input columns in order, no act-order) reordered slice-major: the
    layout column j of the result holds the code of column `slice_major_perm(K)[j]`. Done in
    row blocks, so that what it allocates besides the result stays near `_REORDER_BYTES`
    (a swap stages beside serving, in the memory the KV cache left)."""
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    perm = slice_major_perm(k, qweight.device).long()
    out = torch.empty_like(qweight)
    rows = max(1, _REORDER_BYTES // (4 * k))  # unpacking takes 4 bytes a code
    for start in range(0, n, rows):
        part = qweight[start : start + rows]
        out[start : start + rows] = pack_int4(unpack_int4(part).index_select(1, perm))
    return out


def check_slice_major(perm: torch.Tensor | None, group_size: int) -> None:
    """Raise unless a weight said to hold slice-major codes has their permutation and groups of
    `SLICE_MAJOR_BLOCK` (the permutation's values are not read: a host sync)."""
    if perm is None or group_size != SLICE_MAJOR_BLOCK:
        raise ValueError(f"slice-major codes need their perm and group size {SLICE_MAJOR_BLOCK}, "
                         f"got perm {'given' if perm is not None else 'None'} and group size "
                         f"{group_size}")  # fmt: skip


def check_int4_layout(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    offsets: torch.Tensor | None,
    group_size: int,
    perm: torch.Tensor | None,
) -> tuple[int, int]:
    """Raise unless the tensors form an INT4 weight in this layout; return its (N, K).

    Checks dtypes, shapes, contiguity and devices, never values (that would sync the host; the
    loaders validate values once, `sitsd.quant.layout.Int4Weight.validate`).
    """
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size must be one of {GROUP_SIZES}, got {group_size}")
    if qweight.dim() != 2:
        raise ValueError(f"qweight must be [N, K // 8], got shape {tuple(qweight.shape)}")
    check_dtype("qweight", qweight, (torch.int32,))
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    groups = num_groups(k, group_size)
    check_dtype("scales", scales, SCALE_DTYPES)
    check_shape("scales", scales, (groups, n), "[ceil(K / group_size), N]")
    tensors = {"qweight": qweight, "scales": scales}
    if offsets is not None:
        check_dtype("offsets", offsets, SCALE_DTYPES)
        check_shape("offsets", offsets, (groups, n), "[ceil(K / group_size), N]")
        tensors["offsets"] = offsets
    if perm is not None:
        check_dtype("perm", perm, (torch.int32,))
        check_shape("perm", perm, (k,), "[K]")
        tensors["perm"] = perm
    for name, tensor in tensors.items():
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    devices = {t.device for t in tensors.values()}
    if len(devices) > 1:
        raise ValueError(f"qweight, scales, offsets and perm must share one device: {devices}")
    return n, k


def check_fp8_layout(weight: torch.Tensor, weight_scale: torch.Tensor) -> tuple[int, int]:
    """Raise unless `weight` `[N, K]` float8_e4m3fn and `weight_scale` `[N]` float32 form an FP8
    weight (contiguous, one device); return its (N, K). Values are not read."""
    if weight.dim() != 2:
        raise ValueError(f"weight must be [N, K], got shape {tuple(weight.shape)}")
    check_dtype("weight", weight, (FP8_DTYPE,))
    check_dtype("weight_scale", weight_scale, (torch.float32,))
    check_shape("weight_scale", weight_scale, (weight.shape[0],), "[N]")
    for name, tensor in (("weight", weight), ("weight_scale", weight_scale)):
        if not tensor.is_contiguous():
            raise ValueError(f"{name} must be contiguous, got strides {tensor.stride()}")
    if weight.device != weight_scale.device:
        raise ValueError(f"weight is on {weight.device}, weight_scale on {weight_scale.device}")
    return weight.shape[0], weight.shape[1]
