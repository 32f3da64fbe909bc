"""GGUF tensors kept quantized: Q4_0, Q4_1, Q4_K -> `Int4Weight`, Q8_0 -> `Int8Weight`.

A GGUF tensor of torch shape `[N, K]` is N rows of K / block elements' blocks (llama.cpp's
ggml-common.h, `gguf.quants`); the bytes of one row are its blocks in order:

    Q4_0  18 B / 32:  d fp16, 16 B of nibbles   W = (q - 8) * d
    Q4_1  20 B / 32:  d fp16, m fp16, 16 B      W = q * d + m
    Q8_0  34 B / 32:  d fp16, 32 int8           W = q * d
    Q4_K  144 B / 256: d fp16, dmin fp16, 12 B of eight 6-bit scales and eight 6-bit mins, 128 B
          of nibbles; eight sub-blocks of 32: W = q * (d * sc) - dmin * m

with element j (< 16) of a 32-block in the low nibble of byte j and element j + 16 in its high
nibble (Q4_K: per 64 elements, 32 low nibbles then 32 high ones). `gguf.quants.dequantize`
computes these in float32 in that order; so does the layout: Q4_0 has no offsets (the scale is
d), Q4_1 has the float16 scale d and offset m, Q4_K the float32 scale `d * sc` and offset
`-(dmin * m)` (each exact in float32: at most 17 significant bits), groups of 32. Every product
`q * scale` is exact, and the one rounding is the same add: the layout's W equals `gguf.quants`'
bit for bit. A zero d is legal (llama.cpp writes it for an all-zero block); NaN or Inf is not.

Other types are not kept quantized here (`GGUF_KEPT` lists the ones that are): the loader
dequantizes those. Runs on the tensors' device; little-endian bytes, as GGUF stores them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

from sitsd.kernels.quant_layout import pack_int4
from sitsd.quant.checks import check_scales, check_tensor
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.layout import Int4Weight, Int8Weight

__all__ = ["GGUF_KEPT", "from_gguf", "llama_cpp_row_order"]

GGUF_KEPT = (
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q4_K,
    GGMLQuantizationType.Q8_0,
)


def _f16(raw: torch.Tensor) -> torch.Tensor:
    """`[..., 2]` little-endian bytes -> `[...]` float16."""
    return raw.contiguous().view(torch.float16).squeeze(-1)


def _nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """`[..., 16]` bytes of a 32-block -> `[..., 32]` codes: low nibbles, then high ones."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(blocks: torch.Tensor, n: int, k: int) -> Int4Weight:  # blocks [N, K / 32, 18]
    d = _f16(blocks[..., 0:2])  # [N, K / 32]
    codes = _nibbles_32(blocks[..., 2:]).reshape(n, k)
    return Int4Weight(pack_int4(codes), d.T.contiguous(), None, 32)


def _q4_1(blocks: torch.Tensor, n: int, k: int) -> Int4Weight:  # blocks [N, K / 32, 20]
    d, m = _f16(blocks[..., 0:2]), _f16(blocks[..., 2:4])
    codes = _nibbles_32(blocks[..., 4:]).reshape(n, k)
    return Int4Weight(pack_int4(codes), d.T.contiguous(), m.T.contiguous(), 32)


def _q4_k_scales_mins(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`[..., 12]` bytes -> the eight 6-bit scales and mins `[..., 8]` (gguf's get_scale_min)."""
    d, m, m_d = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    scales = torch.cat([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mins = torch.cat([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return scales, mins


def _q4_k(blocks: torch.Tensor, n: int, k: int) -> Int4Weight:  # blocks [N, K / 256, 144]
    d, dmin = _f16(blocks[..., 0:2]).float(), _f16(blocks[..., 2:4]).float()
    sc, mins = _q4_k_scales_mins(blocks[..., 4:16])  # [N, K / 256, 8]
    scale = d[..., None] * sc.float()  # exact: 11 x 6 significant bits
    offset = -(dmin[..., None] * mins.float())
    qs = blocks[..., 16:].reshape(n, -1, 4, 32)  # 4 chunks of 64 elements
    codes = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(n, k)
    scale, offset = scale.reshape(n, -1), offset.reshape(n, -1)  # [N, K / 32]
    return Int4Weight(pack_int4(codes), scale.T.contiguous(), offset.T.contiguous(), 32)


def _q8_0(blocks: torch.Tensor, n: int, k: int) -> Int8Weight:  # blocks [N, K / 32, 34]
    d = _f16(blocks[..., 0:2])
    codes = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
    return Int8Weight(codes, d.T.contiguous(), 32)


_CONVERTERS: dict[
    GGMLQuantizationType, Callable[[torch.Tensor, int, int], Int4Weight | Int8Weight]
] = {
    GGMLQuantizationType.Q4_0: _q4_0,
    GGMLQuantizationType.Q4_1: _q4_1,
    GGMLQuantizationType.Q4_K: _q4_k,
    GGMLQuantizationType.Q8_0: _q8_0,
}


def from_gguf(
    raw: torch.Tensor, ggml_type: int, *, shape: tuple[int, int], name: str
) -> Int4Weight | Int8Weight:
    """The layout of one GGUF tensor named `name`, torch shape `shape` (N, K), from its bytes.

    Args:
        raw: The tensor's bytes, uint8, `[N, bytes per row]` (or flat).
        ggml_type: Its GGML type (one of `GGUF_KEPT`).
        shape: (N, K), torch order (the reverse of the GGUF header's).
        name: The tensor's name, for errors.

    Raises:
        QuantFormatError: A type not in `GGUF_KEPT`, bytes that do not fit the shape, or block
            scales that are NaN or Inf.
    """
    try:
        qtype = GGMLQuantizationType(ggml_type)
    except ValueError:
        raise QuantFormatError(f"{name} has unknown GGML type {ggml_type}") from None
    if qtype not in _CONVERTERS:
        kept = ", ".join(t.name for t in GGUF_KEPT)
        raise QuantFormatError(f"{name} is {qtype.name}: kept quantized are {kept}")
    n, k = shape
    block, block_bytes = GGML_QUANT_SIZES[qtype]
    if k % block:
        raise QuantFormatError(f"{name}: K = {k} is not a whole number of {block}-element blocks")
    raw = check_tensor(name, raw.reshape(n, -1), (n, k // block * block_bytes), (torch.uint8,),
                       f"[N, K / {block} * {block_bytes}] bytes")  # fmt: skip
    blocks = raw.reshape(n, k // block, block_bytes)
    weight = _CONVERTERS[qtype](blocks, n, k)
    check_scales(f"{name} (block scales d)", _f16(blocks[..., 0:2]), allow_zero=True)
    if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q4_K):
        check_scales(f"{name} (block mins)", _f16(blocks[..., 2:4]), allow_zero=True)
    return weight


def llama_cpp_row_order(num_rows: int, num_heads: int) -> torch.Tensor:  # [num_rows] int64
    """The row order that undoes llama.cpp's permutation of a Q or K projection: row i of the
    Hugging Face weight is row `order[i]` of the GGUF one (for `select_rows`).

    llama.cpp's converter regroups each head's rows from rotate-half halves into interleaved
    pairs (`[heads, 2, rows / heads / 2] -> [heads, rows / heads / 2, 2]`); this is its inverse.
    """
    if num_rows % (2 * num_heads):
        raise QuantFormatError(f"{num_rows} rows do not split into {num_heads} heads of pairs")
    pairs = torch.arange(num_rows).reshape(num_heads, num_rows // num_heads // 2, 2)
    return pairs.transpose(1, 2).reshape(-1)
