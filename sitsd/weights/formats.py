"""Checkpoint formats: which loader reads a given path, and what `--model` points at.

`load_checkpoint` looks at a path (a Hugging Face directory, a `.gguf` file, or a directory holding
one) and hands it to `sitsd.weights.hf` or `sitsd.weights.gguf_file`; both return a
`sitsd.weights.checkpoint.Checkpoint`. Pickle checkpoints are refused here. `resolve_model_path`
turns the `--model` flag into a path.

Putting tensors on a device, casting, and validating values (finiteness, canaries) are left to the
model and the hot-swap stager; the loaders check names and shapes against the architecture.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

from sitsd.weights.checkpoint import (
    PICKLE_SUFFIXES,
    Checkpoint,
    CheckpointError,
    find_pickles,
    pickle_refused,
)
from sitsd.weights.embedded import embedded_model_path

if TYPE_CHECKING:
    from sitsd.weights.tokenizer import Tokenizer


def load_checkpoint(
    path: str | os.PathLike[str],
    *,
    load_tensors: bool = True,
    keep_quantized: bool = True,
    tokenizer: Tokenizer | None = None,
) -> Checkpoint:
    """Load a checkpoint from a HF model directory, a `.gguf` file, or a directory with one.

    Args:
        path: Where the checkpoint is.
        load_tensors: False reads only the architecture and the tokenizer (fast); `tensors`
            is then empty.
        keep_quantized: GGUF: keep the linear weights of the types sitsd serves quantized as
            raw bytes (`Checkpoint.quant` says which); False dequantizes them to float32.
            Hugging Face quantized modules are always kept as they are.
        tokenizer: Hugging Face: a tokenizer built before, taken instead of parsing the
            directory's tokenizer files when they are the ones it was built from.

    Returns:
        The checkpoint.

    Raises:
        CheckpointError: Anything that stops the checkpoint from loading, including pickle
            files, missing or corrupt files, and unsupported architectures or tensor types.
    """
    # Imported here: the loaders pull in torch, which `import sitsd.weights` does without.
    from sitsd.weights import gguf_file, hf

    path = Path(path)
    kind, source = checkpoint_source(path)
    if kind == "hf":
        return hf.load_hf_dir(path, load_tensors=load_tensors, tokenizer=tokenizer)
    ckpt = gguf_file.load_gguf(source, load_tensors=load_tensors, keep_quantized=keep_quantized)
    if source != path:  # a directory holding one .gguf file is named by the directory
        ckpt.name, ckpt.path = path.name, path
    return ckpt


def checkpoint_source(path: Path) -> tuple[str, Path]:
    """("hf", the directory) or ("gguf", the file): which loader reads `path`.

    Decided from file names alone (nothing is read), so a daemon can refuse a bad `--model`
    before it loads anything.

    Raises:
        CheckpointError: `path` is missing, a pickle checkpoint, or nothing sitsd reads.
    """
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return "gguf", path
        if path.suffix.lower() in PICKLE_SUFFIXES:
            raise pickle_refused(path)
        if path.suffix.lower() == ".safetensors":
            raise CheckpointError(
                f"{path} is a bare safetensors file; pass its model directory (with config.json "
                "and tokenizer.json) instead"
            )
        raise CheckpointError(
            f"{path} is not a checkpoint sitsd reads: pass a Hugging Face model directory or a "
            ".gguf file"
        )
    pickles = find_pickles(path)
    has_safetensors = any(path.glob("*.safetensors")) or any(path.glob("*.safetensors.index.json"))
    if (path / "config.json").is_file():
        if pickles and not has_safetensors:
            raise pickle_refused(pickles[0])
        return "hf", path
    ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        return "gguf", ggufs[0]
    if len(ggufs) > 1:
        raise CheckpointError(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}); "
            "pass the one to serve"
        )
    if pickles:
        raise pickle_refused(pickles[0])
    if has_safetensors:
        raise CheckpointError(f"{path} has no config.json; a Hugging Face checkpoint needs one")
    raise CheckpointError(
        f"{path} is not a checkpoint: no config.json (Hugging Face) and no .gguf file"
    )


def resolve_model_path(model: str) -> Path:
    """Turn the `--model` value into a path.

    Args:
        model: "default" for the embedded SmolLM2-135M-Instruct, else a path.

    Raises:
        CheckpointError: The embedded model is not installed, or the path does not exist.
    """
    if model == "default":
        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"model path {model!r} does not exist; pass a Hugging Face directory, a .gguf file, "
            "or 'default' for the embedded SmolLM2-135M-Instruct"
        )
    return path
