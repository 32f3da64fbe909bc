"""GGUF files (llama.cpp): architecture, tokenizer and chat template from metadata; tensors under
Hugging Face names, the linear weights of types sitsd serves quantized (`sitsd.quant.from_gguf.
GGUF_KEPT`: Q4_0, Q4_1, Q4_K, Q8_0) kept as their raw bytes, every other tensor dequantized to
float32 (a log line names the types dequantized that way).

The header is parsed here rather than by `gguf.GGUFReader`, which builds a numpy view per element
of the 49k-entry token and merge arrays (2 s for SmolLM2); a plain struct walk over a memory map
takes a few tens of milliseconds. Dequantization is `gguf.quants.dequantize`, the same code
`transformers` uses. Tensors are renamed to HF names and llama.cpp's Q/K row permutation (made for
its interleaved RoPE) is undone, so the model sees exactly what a HF checkpoint would give it; a
raw tensor is `[N, bytes per row]` uint8 (a copy-on-write map of the file), and the checkpoint's
`QuantSource` names its type and, for Q/K, the head count its converter undoes the permutation
with. The token embedding is always dequantized (a lookup table, not a linear layer).

Building the `tokenizers` object from the vocabulary is `tokenizer.backend_from_gguf_vocab`'s job;
choosing this loader for a path is `formats.load_checkpoint`'s.
"""

from __future__ import annotations

import logging
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
from sitsd.quant.from_gguf import GGUF_KEPT
from sitsd.quant.source import QuantSource
from sitsd.weights import gguf_rope
from sitsd.weights.checkpoint import Checkpoint, CheckpointError, check_tensor_shapes
from sitsd.weights.gguf_rope import llama3_freq_factors, llama3_scaling_from_freq_factors
from sitsd.weights.tokenizer import (
    GgufVocab,
    Tokenizer,
    backend_from_gguf_vocab,
    end_of_generation_ids,
)

__all__ = [
    "GgufHeader",
    "GgufTensorInfo",
    "llama3_freq_factors",
    "llama3_scaling_from_freq_factors",
    "load_gguf",
    "load_gguf_tensors",
    "read_gguf_header",
    "unpermute_qk",
]

log = logging.getLogger(__name__)

_T = GGMLQuantizationType
# Read here: the float types, and every quantized type `gguf.quants` dequantizes (those not in
# GGUF_KEPT are dequantized at load).
SUPPORTED_TYPES = (
    _T.F32, _T.F16, _T.BF16, _T.Q4_0, _T.Q4_1, _T.Q5_0, _T.Q5_1, _T.Q8_0, _T.Q2_K, _T.Q3_K,
    _T.Q4_K, _T.Q5_K, _T.Q6_K,
)  # fmt: skip
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
            f"supported: {', '.join(t.name for t in SUPPORTED_TYPES)} (re-quantize with "
            "llama.cpp's llama-quantize, e.g. to Q4_K_M)"
        )
    block_size, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
    if shape and shape[-1] % block_size:
        raise CheckpointError(f"{path}: tensor {name} rows are not whole quantization blocks")
    return math.prod(shape) // block_size * type_size


def load_gguf(path: Path, *, load_tensors: bool = True, keep_quantized: bool = True) -> Checkpoint:
    """Load a `.gguf` file.

    Args:
        path: The file.
        load_tensors: False reads only metadata (architecture, tokenizer).
        keep_quantized: Keep linear weights of the types in `GGUF_KEPT` as raw bytes (see the
            module docstring); False dequantizes every tensor to float32.

    Raises:
        CheckpointError: Unreadable file, unsupported architecture, tensor type or tokenizer.
    """
    header = read_gguf_header(path)
    arch = arch_from_gguf(header)
    tensors: dict[str, torch.Tensor] = {}
    quant = QuantSource()
    shapes = {
        hf_name(name, path): info.shape
        for name, info in header.tensors.items()
        if name != "rope_freqs.weight"
    }
    check_tensor_shapes(arch, shapes, path)
    if load_tensors:
        tensors, quant = load_gguf_tensors(header, arch, keep_quantized=keep_quantized)
    tokenizer = tokenizer_from_gguf(header, arch.vocab_size)
    return Checkpoint(
        arch=arch,
        tensors=tensors,
        tokenizer=tokenizer,
        name=path.stem,
        path=path,
        format="gguf",
        files=[path],
        quant=quant,
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
    freqs = header.tensors.get("rope_freqs.weight")
    factors = None if freqs is None else _read_array(_map(path), freqs)  # [head_dim // 2]
    rope_scaling = gguf_rope.rope_scaling(meta, factors, rope_theta, head_dim, path)
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


def _map(path: Path) -> np.ndarray:
    """The whole file as read-only bytes; pages are read when a tensor is dequantized."""
    # Copy-on-write: the raw tensors kept quantized are torch views of it, which torch wants
    # writable (nothing writes them; a page is copied only if something did).
    return np.memmap(path, dtype=np.uint8, mode="c")


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


def load_gguf_tensors(
    header: GgufHeader, arch: LlamaArch, *, keep_quantized: bool = True
) -> tuple[dict[str, torch.Tensor], QuantSource]:
    """Every model tensor under HF names: linear weights of a `GGUF_KEPT` type as raw bytes
    (with `keep_quantized`), the others float32 with Q/K rows back in HF's rotate-half order;
    and the `QuantSource` that says which are raw."""
    blob, tensors = _map(header.path), {}
    types: dict[str, int] = {}
    qk_heads: dict[str, int] = {}
    dequantized: set[str] = set()
    for name, info in header.tensors.items():
        if name == "rope_freqs.weight":
            continue  # folded into arch.rope_scaling
        heads = 0
        if ".attn_q." in name:
            heads = arch.num_heads
        elif ".attn_k." in name:
            heads = arch.num_kv_heads
        hf = hf_name(name, header.path)
        kept = keep_quantized and info.ggml_type in GGUF_KEPT and _is_linear(name, info)
        if kept:
            raw = blob[info.offset : info.offset + info.num_bytes].reshape(info.shape[0], -1)
            tensors[hf] = torch.from_numpy(raw)  # [N, bytes per row], copy-on-write
            types[hf] = info.ggml_type
            if heads:
                qk_heads[hf] = heads
            continue
        weight = _read_array(blob, info)
        if heads:
            weight = unpermute_qk(weight, heads)
        tensors[hf] = torch.from_numpy(weight)
        if info.ggml_type not in _FLOAT_TYPES:
            dequantized.add(GGMLQuantizationType(info.ggml_type).name)
    if dequantized and keep_quantized:
        log.info(
            "%s: tensors of type %s dequantized to float32 at load (kept quantized: %s, "
            "linear weights only)", header.path.name, ", ".join(sorted(dequantized)),
            ", ".join(t.name for t in GGUF_KEPT),
        )  # fmt: skip
    return tensors, QuantSource(gguf_types=types, gguf_qk_heads=qk_heads)


_FLOAT_TYPES = (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16)


def _is_linear(name: str, info: GgufTensorInfo) -> bool:
    """A linear layer's weight (not the token embedding, a norm or a bias)."""
    return len(info.shape) == 2 and name != "token_embd.weight" and name.endswith(".weight")


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
