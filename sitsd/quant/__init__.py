"""Quantized weights: the internal layouts, and every checkpoint format converted into them.

One layout per kernel (`layout`: `Int4Weight` for the W4A16 GEMM, `Fp8Weight` for the FP8 W8A8
GEMM, `Int8Weight` for Q8_0; `cpu.CpuInt4Weight`, torch's CPU int4 packing, made from an
`Int4Weight`); loaders know formats (`config` reads a `quantization_config`, `convert` picks the
format module: `from_awq`, `from_gptq`, `from_compressed_tensors`, `from_fp8`, `from_gguf`),
kernels know only their layout. Each conversion runs once, on the device that will serve the
weight, and gives the format's own dequantization bit for bit. `linear` multiplies any layout on
any device. Reading files, PTQ (computing quantized weights) and routing by measurement live
elsewhere.
"""

from sitsd.quant.errors import QuantFormatError

__all__ = ["QuantFormatError"]
