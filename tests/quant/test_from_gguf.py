"""GGUF Q4_0, Q4_1, Q4_K and Q8_0 tensors -> layouts, bit for bit against `gguf.quants.dequantize`
(random blocks, `gguf.quants`' own quantizer, the embedded SmolLM2 file); bad input refused."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.from_gguf import from_gguf
from sitsd.quant.layout import Int4Weight, Int8Weight, select_rows
from sitsd.weights.gguf_file import unpermute_qk

Q = GGMLQuantizationType


def random_blocks(qtype: GGMLQuantizationType, n: int, k: int) -> np.ndarray:
    """`[n, bytes per row]` random blocks of `qtype` with finite float16 scales (and mins)."""
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = np.random.randint(0, 256, (n, k // block, size), dtype=np.uint8)
    halves = 2 if qtype in (Q.Q4_1, Q.Q4_K) else 1  # d (and m / dmin) lead the block
    values = np.random.uniform(-0.05, 0.05, (n, k // block, halves)).astype(np.float16)
    blocks[..., : 2 * halves] = values.view(np.uint8).reshape(n, k // block, 2 * halves)
    return blocks.reshape(n, -1)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32)


@pytest.mark.parametrize(
    ("qtype", "layout"),
    [(Q.Q4_0, Int4Weight), (Q.Q4_1, Int4Weight), (Q.Q4_K, Int4Weight), (Q.Q8_0, Int8Weight)],
)
def test_random_blocks_dequantize_like_gguf_bit_for_bit(qtype, layout):
    n, k = 7, 512
    raw = random_blocks(qtype, n, k)
    weight = from_gguf(torch.from_numpy(raw), qtype, shape=(n, k), name="blk.0.ffn_up.weight")
    assert isinstance(weight, layout)
    assert weight.shape == (n, k)
    expected = torch.from_numpy(np.array(dequantize(raw, qtype)))
    assert torch.equal(_bits(weight.dequantize()), _bits(expected))


@pytest.mark.parametrize("qtype", [Q.Q4_0, Q.Q4_1, Q.Q8_0])
def test_weights_quantized_by_gguf_itself_round_trip(qtype):
    w = np.random.standard_normal((24, 256)).astype(np.float32) * 0.02
    w[3] = 0.0  # an all-zero row: llama.cpp writes d = 0 for its blocks, which is legal
    raw = quantize(w, qtype)
    weight = from_gguf(torch.from_numpy(raw), qtype, shape=(24, 256), name="t")
    expected = torch.from_numpy(np.array(dequantize(raw, qtype)))
    assert torch.equal(_bits(weight.dequantize()), _bits(expected))
    assert float((weight.dequantize() - torch.from_numpy(w)).abs().max()) < 0.01


def test_q4_1_keeps_float16_scales_and_mins_and_q4_k_exact_float32_ones():
    q41 = from_gguf(torch.from_numpy(random_blocks(Q.Q4_1, 4, 64)), Q.Q4_1, shape=(4, 64), name="t")
    assert (q41.scales.dtype, q41.offsets.dtype, q41.group_size) == (torch.float16,) * 2 + (32,)
    q4k = from_gguf(
        torch.from_numpy(random_blocks(Q.Q4_K, 4, 256)), Q.Q4_K, shape=(4, 256), name="t"
    )
    assert (q4k.scales.dtype, q4k.offsets.dtype, q4k.group_size) == (torch.float32,) * 2 + (32,)
    q40 = from_gguf(torch.from_numpy(random_blocks(Q.Q4_0, 4, 64)), Q.Q4_0, shape=(4, 64), name="t")
    assert q40.offsets is None


def test_the_embedded_smollm2_tensors_dequantize_like_gguf(smollm2_gguf_header):
    header = smollm2_gguf_header
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    names = ["blk.0.attn_q.weight", "blk.7.ffn_down.weight", "blk.29.attn_v.weight"]
    for name in names:
        info = header.tensors[name]
        raw = np.array(blob[info.offset : info.offset + info.num_bytes]).reshape(info.shape[0], -1)
        weight = from_gguf(torch.from_numpy(raw), info.ggml_type, shape=info.shape, name=name)
        assert info.ggml_type == Q.Q4_1
        expected = torch.from_numpy(np.array(dequantize(raw, Q.Q4_1)))
        assert torch.equal(_bits(weight.dequantize()), _bits(expected)), name


def test_llama_cpp_q_row_order_is_undone_on_the_quantized_rows(smollm2_gguf_header):
    # llama.cpp permutes Q/K rows for its interleaved RoPE; the loader undoes it on float rows
    # (`unpermute_qk`). The same permutation of the quantized rows gives the same weight.
    header = smollm2_gguf_header
    info = header.tensors["blk.3.attn_q.weight"]
    blob = np.memmap(header.path, dtype=np.uint8, mode="r")
    raw = np.array(blob[info.offset : info.offset + info.num_bytes]).reshape(info.shape[0], -1)
    weight = from_gguf(torch.from_numpy(raw), info.ggml_type, shape=info.shape, name="q")
    num_heads = header.metadata["llama.attention.head_count"]
    order = unpermute_qk(np.arange(info.shape[0])[:, None], num_heads)[:, 0]
    expected = unpermute_qk(np.array(dequantize(raw, info.ggml_type)), num_heads)
    reordered = select_rows(weight, torch.from_numpy(order))
    assert torch.equal(_bits(reordered.dequantize()), _bits(torch.from_numpy(expected)))


def test_bad_input_is_refused_naming_the_tensor():
    raw = torch.from_numpy(random_blocks(Q.Q4_1, 4, 64))
    with pytest.raises(QuantFormatError, match=r"blk.1.attn_k.weight has shape \(4, 36\)"):
        from_gguf(raw[:, :-4], Q.Q4_1, shape=(4, 64), name="blk.1.attn_k.weight")
    with pytest.raises(QuantFormatError, match=r"attn_k\.weight is Q6_K: kept quantized are"):
        from_gguf(raw, Q.Q6_K, shape=(4, 64), name="blk.1.attn_k.weight")
    with pytest.raises(QuantFormatError, match="not a whole number of 32-element blocks"):
        from_gguf(raw, Q.Q4_1, shape=(4, 48), name="t")
    nan = raw.clone()
    nan[2, 0:2] = torch.tensor(np.array([np.nan], dtype=np.float16).view(np.uint8))
    with pytest.raises(QuantFormatError, match=r"t \(block scales d\) holds NaN or Inf"):
        from_gguf(nan, Q.Q4_1, shape=(4, 64), name="t")
    inf_min = raw.clone()
    inf_min[0, 2:4] = torch.tensor(np.array([np.inf], dtype=np.float16).view(np.uint8))
    with pytest.raises(QuantFormatError, match=r"t \(block mins\) holds NaN or Inf"):
        from_gguf(inf_min, Q.Q4_1, shape=(4, 64), name="t")
