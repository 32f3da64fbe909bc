"""Hugging Face model directories: `config.json`, `*.safetensors`, `tokenizer.json` and friends.

Reads the architecture from `config.json` (and its `quantization_config`, or AutoAWQ's
`quant_config.json`: the checkpoint's `QuantSource`, its quantized modules' tensors kept as they
are), memory-maps every safetensors shard (the index is optional), and builds the tokenizer
from `tokenizer.json` plus the special tokens, BOS/EOS behaviour and chat template spread over
`tokenizer_config.json`, `special_tokens_map.json`, `generation_config.json` and
`chat_template.jinja`.

Choosing between formats and refusing bare pickle paths is `formats.load_checkpoint`'s job;
copying tensors to a device is the model's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import tokenizers
import torch
from safetensors import safe_open

from sitsd.model.arch import arch_from_hf_config
from sitsd.quant.config import parse_quantization_config
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.source import QuantSource
from sitsd.weights.checkpoint import (
    Checkpoint,
    CheckpointError,
    check_tensor_shapes,
    find_pickles,
    pickle_refused,
)
from sitsd.weights.tokenizer import Tokenizer, end_of_generation_ids

SAFETENSORS_INDEX = "model.safetensors.index.json"
# Buffers some exporters save next to the parameters; the model recomputes them.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# The files a directory's tokenizer is built from (config.json: the vocabulary size and EOS
# ids), in the order `_load_tokenizer` lists them.
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                    "generation_config.json", "chat_template.jinja")  # fmt: skip


def tokenizer_digest(path: Path) -> str:
    """SHA-256 over the names and bytes of the files a directory's tokenizer is built from
    (those present, config.json included): two directories with one digest build one
    tokenizer. Reading and hashing release the GIL; parsing tokenizer.json does not."""
    digest = hashlib.sha256()
    for name in ("config.json", *_TOKENIZER_FILES):
        file = path / name
        if file.is_file():
            data = file.read_bytes()
            digest.update(f"{name}\0{len(data)}\0".encode())
            digest.update(data)
    return digest.hexdigest()


def load_hf_dir(
    path: Path, *, load_tensors: bool = True, tokenizer: Tokenizer | None = None
) -> Checkpoint:
    """Load a Hugging Face model directory.

    Args:
        path: The directory (holding `config.json`).
        load_tensors: False skips the weights (their files are still listed in `files`).
        tokenizer: One built before (the serving model's): the checkpoint takes it when its
            tokenizer files are byte for byte the ones it was built from (`tokenizer_digest`)
            instead of parsing them again. Parsing holds the GIL throughout (70 ms for
            SmolLM2's tokenizer.json, more for larger vocabularies), which stalls the engine's
            steps and the event loop of a daemon staging a version while it serves.

    Raises:
        CheckpointError: A file is missing, corrupt or unsupported, or tensors do not match
            the config.
    """
    files: list[Path] = []
    config = _read_json(path / "config.json", files, required=True)
    try:
        arch = arch_from_hf_config(config)
    except (KeyError, ValueError, TypeError) as exc:
        raise CheckpointError(f"{path / 'config.json'}: unsupported or incomplete: {exc}") from exc
    quant = _quant_source(path, config, files)
    weight_files = _weight_files(path)
    digest = tokenizer_digest(path)
    if tokenizer is not None and tokenizer.source_digest == digest:
        files += [path / name for name in _TOKENIZER_FILES if (path / name).is_file()]
    else:
        tokenizer = _load_tokenizer(path, config, arch.vocab_size, files, digest)
    files += weight_files
    tensors: dict[str, torch.Tensor] = {}
    if load_tensors:
        tensors = _load_safetensors(weight_files)
        if arch.tie_word_embeddings:
            tensors.pop("lm_head.weight", None)  # a saved copy of the tied embedding
        shapes = {k: tuple(v.shape) for k, v in tensors.items()}
        check_tensor_shapes(arch, shapes, path, quant)
    return Checkpoint(
        arch=arch,
        tensors=tensors,
        tokenizer=tokenizer,
        name=path.name,
        path=path,
        format="hf",
        files=files,
        quant=quant,
    )


def _quant_source(path: Path, config: dict[str, Any], files: list[Path]) -> QuantSource | None:
    """The checkpoint's quantization scheme: `config.json`'s `quantization_config`, else
    AutoAWQ's `quant_config.json`; None for a 16-bit checkpoint."""
    qconfig = config.get("quantization_config")
    where = "config.json"
    if qconfig is None and (path / "quant_config.json").is_file():
        qconfig, where = _read_json(path / "quant_config.json", files), "quant_config.json"
        qconfig.setdefault("quant_method", "awq")
    if qconfig is None:
        return None
    if not isinstance(qconfig, dict):
        raise CheckpointError(f"{path / where}: quantization_config must be a JSON object")
    try:
        return QuantSource(scheme=parse_quantization_config(qconfig))
    except QuantFormatError as exc:
        raise CheckpointError(f"{path / where}: {exc}") from None


def _read_json(file: Path, files: list[Path], *, required: bool = False) -> dict[str, Any]:
    if not file.is_file():
        if required:
            raise CheckpointError(f"{file.name} is missing from {file.parent}")
        return {}
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{file} is not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise CheckpointError(f"{file} must hold a JSON object")
    files.append(file)
    return data


def _weight_files(path: Path) -> list[Path]:
    """The safetensors shards: those the index names, else every `*.safetensors`."""
    index_file = path / SAFETENSORS_INDEX
    if index_file.is_file():
        index = _read_json(index_file, [])
        shard_names = sorted(set(index.get("weight_map", {}).values()))
        missing = [name for name in shard_names if not (path / name).is_file()]
        if missing or not shard_names:
            raise CheckpointError(
                f"{path}: {SAFETENSORS_INDEX} names shards that are missing: "
                f"{', '.join(missing) or '(none listed)'}"
            )
        return [index_file] + [path / name for name in shard_names]
    shards = sorted(path.glob("*.safetensors"))
    if shards:
        return shards
    pickles = find_pickles(path)
    if pickles:
        raise pickle_refused(pickles[0])
    raise CheckpointError(f"{path} has no *.safetensors weights")


def _load_safetensors(weight_files: list[Path]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for file in weight_files:
        if file.suffix != ".safetensors":
            continue
        try:
            # safe_open memory-maps the file: pages are read when the tensor is first touched.
            with safe_open(file, framework="pt") as f:
                shard = {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118
        except Exception as exc:  # safetensors raises its own SafetensorError and OSErrors
            raise CheckpointError(
                f"{file} is truncated or corrupt and cannot be read ({exc}); copy it again"
            ) from exc
        for name, tensor in shard.items():
            if name.endswith(_IGNORED_SUFFIXES):
                continue
            if name in tensors:
                raise CheckpointError(f"tensor {name} appears in more than one file ({file.name})")
            tensors[name] = tensor
    return tensors


def _load_tokenizer(
    path: Path, config: dict[str, Any], vocab_size: int, files: list[Path], digest: str
) -> Tokenizer:
    tokenizer_file = path / "tokenizer.json"
    if not tokenizer_file.is_file():
        hint = ""
        if (path / "tokenizer.model").exists():
            hint = (
                " (only tokenizer.model found: re-save the tokenizer with transformers' "
                "AutoTokenizer.save_pretrained to get one)"
            )
        raise CheckpointError(f"tokenizer.json is missing from {path}{hint}")
    try:
        backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # tokenizers raises bare Exceptions on malformed files
        raise CheckpointError(f"{tokenizer_file} cannot be read: {exc}") from exc
    files.append(tokenizer_file)
    tok_config = _read_json(path / "tokenizer_config.json", files)
    special_map = _read_json(path / "special_tokens_map.json", files)
    gen_config = _read_json(path / "generation_config.json", files)

    def token_id(key: str) -> int | None:
        # A named token string wins; the numeric ids in the configs are the fallback.
        text = _token_text(tok_config.get(key)) or _token_text(special_map.get(key))
        found = backend.token_to_id(text) if text else None
        if found is not None:
            return found
        for cfg in (gen_config, config):
            value = cfg.get(f"{key}_id")
            if isinstance(value, list):
                value = value[0] if value else None
            if isinstance(value, int):
                return value
        return None

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    declared_eos = [
        eos_id,
        *_id_list(gen_config.get("eos_token_id")),
        *_id_list(config.get("eos_token_id")),
    ]
    add_bos, add_eos = _adds_bos_eos(backend, tok_config, bos_id, eos_id)
    try:
        return Tokenizer(
            backend,
            vocab_size=vocab_size,
            bos_token_id=bos_id,
            eos_token_ids=end_of_generation_ids(backend, declared_eos),
            pad_token_id=token_id("pad_token"),
            unk_token_id=token_id("unk_token"),
            add_bos_token=add_bos,
            add_eos_token=add_eos,
            chat_template=_chat_template(path, tok_config, files),
            source_digest=digest,
        )
    except ValueError as exc:
        raise CheckpointError(f"{path}: {exc}") from exc


def _token_text(value: Any) -> str | None:
    """A special token as `tokenizer_config.json` spells it: a string or an AddedToken dict."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _id_list(value: Any) -> list[int]:
    if isinstance(value, int):
        return [value]
    return [v for v in value if isinstance(v, int)] if isinstance(value, list) else []


def _adds_bos_eos(
    backend: tokenizers.Tokenizer,
    tok_config: dict[str, Any],
    bos_id: int | None,
    eos_id: int | None,
) -> tuple[bool, bool]:
    """Whether a sequence starts with BOS / ends with EOS: the config's flags, else what the
    `tokenizer.json` post-processor does (Llama 3 says it only there)."""
    add_bos, add_eos = tok_config.get("add_bos_token"), tok_config.get("add_eos_token")
    if add_bos is None or add_eos is None:
        probe = backend.encode("a", add_special_tokens=True).ids
        bare = backend.encode("a", add_special_tokens=False).ids
        if add_bos is None:
            add_bos = bos_id is not None and probe[:1] == [bos_id] and bare[:1] != [bos_id]
        if add_eos is None:
            add_eos = eos_id is not None and probe[-1:] == [eos_id] and bare[-1:] != [eos_id]
    return bool(add_bos), bool(add_eos)


def _chat_template(path: Path, tok_config: dict[str, Any], files: list[Path]) -> str | None:
    """`chat_template.jinja` (newer transformers), else `tokenizer_config.json`'s entry, which
    is a string or a list of named templates (the one named "default" is served)."""
    jinja_file = path / "chat_template.jinja"
    if jinja_file.is_file():
        files.append(jinja_file)
        return jinja_file.read_text(encoding="utf-8")
    template = tok_config.get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) and template else None
