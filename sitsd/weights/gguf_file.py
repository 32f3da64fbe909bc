"""GGUF files (llama.cpp): architecture, tokenizer and chat template from metadata; tensors
dequantized to float32 under Hugging Face names.

The header is parsed here rather than by `gguf.GGUFReader`, which builds a numpy view per element
of the 49k-entry token and merge arrays (2 s for SmolLM2); a plain struct walk over a memory map
takes a few tens of milliseconds. Dequantization is `gguf.quants.dequantize`, the same code
`transformers` uses. Tensors are renamed to HF names and llama.cpp's Q/K row permutation (made for
its interleaved RoPE) is undone, so the model sees exactly what a HF checkpoint would give it.

Building the `tokenizers` object from the vocabulary is `tokenizer.backend_from_gguf_vocab`'s job;
choosing this loader for a path is `formats.load_checkpoint`'s.
"""

from __future__ import annotations

import math
import mmap
import re
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize

from sitsd.model.arch import LlamaArch
from sitsd.weights.checkpoint import Checkpoint, CheckpointError, check_tensor_shapes
from sitsd.weights.tokenizer import (
    GgufVocab,
    Tokenizer,
    backend_from_gguf_vocab,
    end_of_generation_ids,
)

SUPPORTED_TYPES = (
    GGMLQuantizationType.F32,
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
)
_GGUF_MAGIC = b"GGUF"
# Scalar metadata value types of the GGUF spec -> struct format.
_SCALARS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
_STRING, _ARRAY = 8, 9
_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_GLOBAL_NAMES = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass(frozen=True)
class GgufTensorInfo:
    """Where one tensor lives in the file."""

    name: str  # GGUF name, e.g. "blk.0.attn_q.weight"
    shape: tuple[int, ...]  # torch order: [out, in]
    ggml_type: int
    offset: int  # absolute byte offset in the file
    num_bytes: int


@dataclass(frozen=True)
class GgufHeader:
    """A GGUF file's metadata and tensor table (no tensor data)."""

    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, GgufTensorInfo]


def read_gguf_header(path: Path) -> GgufHeader:
    """Parse the metadata and tensor table of a GGUF (v2/v3, little-endian) file.

    Raises:
        CheckpointError: Not a GGUF file, an unsupported version, or truncated/corrupt.
    """
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
        try:
            return _parse_header(path, buf, len(buf))
        except (struct.error, UnicodeDecodeError, ValueError, IndexError, OverflowError) as exc:
            raise CheckpointError(f"{path} is truncated or corrupt: {exc}") from exc


def _parse_header(path: Path, buf: mmap.mmap, file_size: int) -> GgufHeader:
    if buf[:4] != _GGUF_MAGIC:
        raise CheckpointError(f"{path} is not a GGUF file (bad magic bytes)")
    version, num_tensors, num_kv = struct.unpack_from("<IQQ", buf, 4)
    if version not in (2, 3):
        raise CheckpointError(
            f"{path} is GGUF version {version} (big-endian or unknown); sitsd reads v2 and v3"
        )
    pos, metadata = 24, {}
    for _ in range(num_kv):
        key, pos = _read_str(buf, pos)
        (value_type,) = struct.unpack_from("<I", buf, pos)
        metadata[key], pos = _read_value(buf, pos + 4, value_type)
    entries = []
    for _ in range(num_tensors):
        name, pos = _read_str(buf, pos)
        (num_dims,) = struct.unpack_from("<I", buf, pos)
        dims = struct.unpack_from(f"<{num_dims}Q", buf, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", buf, pos + 4 + 8 * num_dims)
        pos += 4 + 8 * num_dims + 12
        entries.append((name, tuple(reversed(dims)), ggml_type, offset))  # ggml lists in-dim first
    alignment = int(metadata.get("general.alignment", 32))
    data_start = -(-pos // alignment) * alignment
    tensors = {}
    for name, shape, ggml_type, offset in entries:
        num_bytes = _num_bytes(ggml_type, shape, name, path)
        start = data_start + offset
        if start + num_bytes > file_size:
            raise CheckpointError(f"{path} is truncated: tensor {name} ends past the end of file")
        tensors[name] = GgufTensorInfo(name, shape, ggml_type, start, num_bytes)
    return GgufHeader(path, metadata, tensors)


def _read_str(buf: mmap.mmap, pos: int) -> tuple[str, int]:
    (length,) = struct.unpack_from("<Q", buf, pos)
    end = pos + 8 + length
    if end > len(buf):
        raise ValueError("string runs past the end of the file")
    return buf[pos + 8 : end].decode("utf-8"), end


def _read_value(buf: mmap.mmap, pos: int, value_type: int) -> tuple[Any, int]:
    if value_type in _SCALARS:
        fmt = "<" + _SCALARS[value_type]
        return struct.unpack_from(fmt, buf, pos)[0], pos + struct.calcsize(fmt)
    if value_type == _STRING:
        return _read_str(buf, pos)
    if value_type != _ARRAY:
        raise ValueError(f"unknown metadata value type {value_type}")
    item_type, count = struct.unpack_from("<IQ", buf, pos)
    pos += 12
    if item_type in _SCALARS:
        # One vectorized read: token types and scores hold ~50k entries.
        dtype = np.dtype("<" + _SCALARS[item_type])  # struct and numpy share the type codes
        values = np.frombuffer(buf, dtype=dtype, count=count, offset=pos).tolist()
        return values, pos + count * dtype.itemsize
    items = []
    for _ in range(count):
        item, pos = _read_value(buf, pos, item_type)
        items.append(item)
    return items, pos


def _num_bytes(ggml_type: int, shape: tuple[int, ...], name: str, path: Path) -> int:
    if ggml_type not in SUPPORTED_TYPES:
        try:
            type_name = GGMLQuantizationType(ggml_type).name
        except ValueError:
            type_name = f"unknown ggml type {ggml_type}"
        raise CheckpointError(
            f"{path}: tensor {name} is stored as {type_name}, which sitsd does not read; "
            "supported: F32, F16, BF16, Q8_0, Q4_0, Q4_1 (re-quantize with llama.cpp's "
            "llama-quantize, e.g. to Q8_0)"
        )
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if shape and shape[-1] % block_size:
        raise CheckpointError(f"{path}: tensor {name} rows are not whole quantization blocks")
    return math.prod(shape) // block_size * type_size


def load_gguf(path: Path, *, load_tensors: bool = True) -> Checkpoint:
    """Load a `.gguf` file.

    Args:
        path: The file.
        load_tensors: False reads only metadata (architecture, tokenizer).

    Raises:
        CheckpointError: Unreadable file, unsupported architecture, tensor type or tokenizer.
    """
    header = read_gguf_header(path)
    arch = arch_from_gguf(header)
    tensors: dict[str, torch.Tensor] = {}
    shapes = {
        hf_name(name, path): info.shape
        for name, info in header.tensors.items()
        if name != "rope_freqs.weight"
    }
    check_tensor_shapes(arch, shapes, path)
    if load_tensors:
        tensors = load_gguf_tensors(header, arch)
    tokenizer = tokenizer_from_gguf(header, arch.vocab_size)
    return Checkpoint(
        arch=arch,
        tensors=tensors,
        tokenizer=tokenizer,
        name=path.stem,
        path=path,
        format="gguf",
        files=[path],
    )


def hf_name(gguf_name: str, path: Path) -> str:
    """The Hugging Face parameter name of a llama.cpp tensor name."""
    match = _BLOCK_NAME.fullmatch(gguf_name)
    if match and match.group(2) in _LAYER_NAMES:
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_NAMES[part]}.{kind}"
    stem, _, kind = gguf_name.rpartition(".")
    if stem in _GLOBAL_NAMES:
        return f"{_GLOBAL_NAMES[stem]}.{kind}"
    raise CheckpointError(f"{path}: tensor {gguf_name} is not part of a Llama model")


def arch_from_gguf(header: GgufHeader) -> LlamaArch:
    """The architecture from `general.architecture` and `{arch}.*` metadata."""
    meta, path = header.metadata, header.path
    name = meta.get("general.architecture")
    if name != "llama":
        raise CheckpointError(
            f"{path}: GGUF architecture {name!r} is not supported; sitsd serves 'llama' "
            "(Llama 2/3, SmolLM2, Mistral)"
        )
    if int(meta.get("split.count", 1)) > 1:
        raise CheckpointError(f"{path} is one part of a split GGUF; merge it with gguf-split")

    def get(key: str, default: Any = None) -> Any:
        value = meta.get(f"llama.{key}", default)
        if value is None:
            raise CheckpointError(f"{path}: GGUF metadata lacks llama.{key}")
        if isinstance(value, list):
            raise CheckpointError(f"{path}: per-layer llama.{key} is not supported")
        return value

    hidden, num_heads = int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // num_heads))
    if int(get("rope.dimension_count", head_dim)) != head_dim:
        raise CheckpointError(f"{path}: partial rotary embeddings are not supported")
    embed = header.tensors.get("token_embd.weight")
    vocab_size = (
        embed.shape[0]
        if embed
        else int(get("vocab_size", len(meta.get("tokenizer.ggml.tokens", [])) or None))
    )
    rope_theta = _f32(get("rope.freq_base", 10000.0))
    rope_scaling = _rope_scaling(header, rope_theta, head_dim)
    try:
        return LlamaArch(
            vocab_size=vocab_size,
            hidden_size=hidden,
            intermediate_size=int(get("feed_forward_length")),
            num_layers=int(get("block_count")),
            num_heads=num_heads,
            num_kv_heads=int(get("attention.head_count_kv", num_heads)),
            head_dim=head_dim,
            rms_norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(get("context_length", 4096)),
            tie_word_embeddings="output.weight" not in header.tensors,
            architecture="llama",
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _f32(value: float) -> float:
    """The shortest decimal of a float32 metadata value (1e-05, not 9.99999974e-06)."""
    return float(str(np.float32(value)))


def _rope_scaling(header: GgufHeader, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF-style `rope_scaling` from `llama.rope.scaling.*`, or from a Llama-3 `rope_freqs`."""
    meta = header.metadata
    kind = meta.get("llama.rope.scaling.type", "none")
    factor = meta.get("llama.rope.scaling.factor", meta.get("llama.rope.scale_linear"))
    if kind == "none" and factor is not None and factor != 1.0:
        kind = "linear"  # older files: only rope.scale_linear
    if kind in ("linear", "yarn"):
        if factor is None:
            raise CheckpointError(f"{header.path}: {kind} rope scaling without a factor")
        scaling: dict[str, Any] = {"rope_type": kind, "factor": _f32(factor)}
        if kind == "yarn":
            scaling["original_max_position_embeddings"] = int(
                meta["llama.rope.scaling.original_context_length"]
            )
        return scaling
    if kind != "none":
        raise CheckpointError(f"{header.path}: rope scaling {kind!r} is not supported")
    info = header.tensors.get("rope_freqs.weight")
    if info is None:
        return None
    factors = _read_array(_map(header.path), info)  # [head_dim // 2]
    return llama3_scaling_from_freq_factors(factors, theta, head_dim, header.path)


def llama3_scaling_from_freq_factors(
    factors: np.ndarray, theta: float, head_dim: int, path: Path
) -> dict[str, Any]:
    """Recover Llama-3 `rope_scaling` from llama.cpp's per-frequency divisors (`rope_freqs`).

    The divisors depend on (original context, low/high freq factor) only through their ratios,
    so the common Llama-3.1 values (8192, 1, 4) are tried first, then fitted.
    """
    factors = np.asarray(factors, dtype=np.float64).reshape(-1)
    factor = float(factors.max())
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim // 2]
    candidates = [(8192, 1.0, 4.0)]
    medium = (factors > 1.0 + 1e-6) & (factors < factor - 1e-6)
    if medium.sum() >= 2:
        # In the medium band 1/f = 1/F + s(1 - 1/F), s = (ctx / wavelen - low) / (high - low).
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        slope, intercept = np.polyfit(1 / wavelen[medium], smooth, 1)
        if intercept < 0:
            candidates.append((round(-slope / intercept), 1.0, 1.0 - 1.0 / intercept))
    for ctx, low, high in candidates:
        scaling = {
            "rope_type": "llama3",
            "factor": _f32(factor),
            "low_freq_factor": low,
            "high_freq_factor": high,
            "original_max_position_embeddings": int(ctx),
        }
        if np.allclose(llama3_freq_factors(scaling, theta, head_dim), factors, rtol=1e-3):
            return scaling
    raise CheckpointError(f"{path}: rope_freqs.weight does not match Llama-3 rope scaling")


def llama3_freq_factors(scaling: dict[str, Any], theta: float, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` for HF Llama-3 `rope_scaling`: the divisor of each frequency."""
    factor, ctx = scaling["factor"], scaling["original_max_position_embeddings"]
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    wavelen = 2 * math.pi * theta ** (np.arange(0, head_dim, 2) / head_dim)  # [head_dim // 2]
    smooth = (ctx / wavelen - low) / (high - low)
    medium = 1.0 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < ctx / high, 1.0, np.where(wavelen > ctx / low, factor, medium))


def _map(path: Path) -> np.ndarray:
    """The whole file as read-only bytes; pages are read when a tensor is dequantized."""
    return np.memmap(path, dtype=np.uint8, mode="r")


def _read_array(blob: np.ndarray, info: GgufTensorInfo) -> np.ndarray:
    """One tensor, dequantized to a float32 array of its torch shape."""
    raw = blob[info.offset : info.offset + info.num_bytes]
    ggml_type = GGMLQuantizationType(info.ggml_type)
    if ggml_type == GGMLQuantizationType.F32:
        return np.array(raw.view(np.float32).reshape(info.shape))
    if ggml_type == GGMLQuantizationType.F16:
        return raw.view(np.float16).reshape(info.shape).astype(np.float32)
    rows = raw.reshape(*info.shape[:-1], -1)  # [..., bytes per row]
    values = dequantize(rows, ggml_type)  # a fresh float32 array, not a view of the file
    return values if values.flags.writeable else np.array(values)


def load_gguf_tensors(header: GgufHeader, arch: LlamaArch) -> dict[str, torch.Tensor]:
    """Every model tensor, float32, HF names, Q/K rows back in HF's rotate-half order."""
    blob, tensors = _map(header.path), {}
    for name, info in header.tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into arch.rope_scaling
        weight = _read_array(blob, info)
        if ".attn_q." in name:
            weight = unpermute_qk(weight, arch.num_heads)
        elif ".attn_k." in name:
            weight = unpermute_qk(weight, arch.num_kv_heads)
        tensors[hf_name(name, header.path)] = torch.from_numpy(weight)
    return tensors


def unpermute_qk(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's permutation of Q/K rows (HF rotate-half -> ggml interleaved pairs)."""
    rows = weight.shape[0]
    return np.ascontiguousarray(
        weight.reshape(num_heads, rows // num_heads // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def tokenizer_from_gguf(header: GgufHeader, vocab_size: int) -> Tokenizer:
    """The tokenizer described by `tokenizer.ggml.*` and `tokenizer.chat_template`."""
    meta, path = header.metadata, header.path
    tokens = meta.get("tokenizer.ggml.tokens")
    if not tokens:
        raise CheckpointError(f"{path} has no tokenizer (tokenizer.ggml.tokens is missing)")
    model = meta.get("tokenizer.ggml.model", "gpt2")
    vocab = GgufVocab(
        model=model,
        pre=meta.get("tokenizer.ggml.pre", "default"),
        tokens=tokens,
        token_types=meta.get("tokenizer.ggml.token_type", []),
        merges=meta.get("tokenizer.ggml.merges", []),
        scores=meta.get("tokenizer.ggml.scores", []),
        unk_token_id=meta.get("tokenizer.ggml.unknown_token_id"),
        add_space_prefix=meta.get("tokenizer.ggml.add_space_prefix", model == "llama"),
    )
    if model == "llama" and len(vocab.scores) != len(tokens):
        raise CheckpointError(f"{path}: a SentencePiece vocabulary needs tokenizer.ggml.scores")
    try:
        backend = backend_from_gguf_vocab(vocab)
        eos_id = meta.get("tokenizer.ggml.eos_token_id")
        declared = [
            eos_id,
            meta.get("tokenizer.ggml.eot_token_id"),
            meta.get("tokenizer.ggml.eom_token_id"),
        ]
        return Tokenizer(
            backend,
            vocab_size=vocab_size,
            bos_token_id=meta.get("tokenizer.ggml.bos_token_id"),
            eos_token_ids=end_of_generation_ids(backend, declared),
            pad_token_id=meta.get("tokenizer.ggml.padding_token_id"),
            unk_token_id=vocab.unk_token_id,
            # llama.cpp adds BOS to SentencePiece vocabularies that do not say otherwise.
            add_bos_token=meta.get("tokenizer.ggml.add_bos_token", model == "llama"),
            add_eos_token=meta.get("tokenizer.ggml.add_eos_token", False),
            chat_template=meta.get("tokenizer.chat_template"),
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc
