"""Checkpoint formats: what a loaded checkpoint is, and which loader reads a given path.

`load_checkpoint` looks at a path (a Hugging Face directory, a `.gguf` file, or a directory holding
one) and hands it to `sitsd.weights.hf` or `sitsd.weights.gguf_file`; both return a `Checkpoint`
whose tensors carry Hugging Face names and torch's `[out, in]` shapes, whatever the source format.
Pickle checkpoints are refused here. `resolve_model_path` turns the `--model` flag into a path.

Putting tensors on a device, casting, and validating values (finiteness, canaries) are left to the
model and the hot-swap stager; this module only checks names and shapes against the architecture.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sitsd.model.arch import LlamaArch
from sitsd.weights.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is only imported by the loaders, so `import sitsd.weights` stays light
    import torch

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message says what is wrong and what to do."""


@dataclass
class Checkpoint:
    """A model checkpoint read from disk, in one format-independent shape."""

    arch: LlamaArch
    # Hugging Face parameter names -> tensors, torch's [out, in] shapes; no "lm_head.weight"
    # when embeddings are tied. safetensors: memory-mapped, original dtype; GGUF: float32.
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str  # served model name derived from the path (directory name / file stem)
    path: Path
    format: str  # "hf" or "gguf"
    files: list[Path] = field(default_factory=list)  # every file of the checkpoint, weights too


def load_checkpoint(path: str | os.PathLike[str], *, load_tensors: bool = True) -> Checkpoint:
    """Load a checkpoint from a HF model directory, a `.gguf` file, or a directory with one.

    Args:
        path: Where the checkpoint is.
        load_tensors: False reads only the architecture and the tokenizer (fast); `tensors`
            is then empty.

    Returns:
        The checkpoint.

    Raises:
        CheckpointError: Anything that stops the checkpoint from loading, including pickle
            files, missing or corrupt files, and unsupported architectures or tensor types.
    """
    # The format modules import this one for CheckpointError, so they are imported here.
    from sitsd.weights import gguf_file, hf

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"checkpoint path {path} does not exist")
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return gguf_file.load_gguf(path, load_tensors=load_tensors)
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
    if (path / "config.json").is_file():
        return hf.load_hf_dir(path, load_tensors=load_tensors)
    ggufs = sorted(p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file())
    if len(ggufs) == 1:
        ckpt = gguf_file.load_gguf(ggufs[0], load_tensors=load_tensors)
        ckpt.name, ckpt.path = path.name, path
        return ckpt
    if len(ggufs) > 1:
        raise CheckpointError(
            f"{path} holds {len(ggufs)} .gguf files ({', '.join(p.name for p in ggufs)}); "
            "pass the one to serve"
        )
    pickles = find_pickles(path)
    if pickles:
        raise pickle_refused(pickles[0])
    if any(path.glob("*.safetensors")):
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
        from sitsd.weights.embedded import embedded_model_path

        return embedded_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise CheckpointError(
            f"model path {model!r} does not exist; pass a Hugging Face directory, a .gguf file, "
            "or 'default' for the embedded SmolLM2-135M-Instruct"
        )
    return path


def find_pickles(directory: Path) -> list[Path]:
    """Pickle weight files in `directory`, sorted."""
    return sorted(p for p in directory.iterdir() if p.suffix.lower() in PICKLE_SUFFIXES)


def pickle_refused(path: Path) -> CheckpointError:
    """The error for a pickle checkpoint: why it is refused, and how to convert it."""
    model_dir = path.parent if path.is_file() else path
    return CheckpointError(
        f"{path} is a pickle checkpoint; sitsd refuses pickles because loading one can run "
        "arbitrary code. Convert it once, in a trusted environment, to safetensors, e.g.: "
        'python -c "from transformers import AutoModelForCausalLM as M; '
        f"M.from_pretrained('{model_dir}').save_pretrained('{model_dir}-safetensors', "
        'safe_serialization=True)" and copy the tokenizer files next to it'
    )


def expected_tensor_shapes(arch: LlamaArch) -> dict[str, tuple[int, ...]]:
    """Every parameter a Llama-family checkpoint must hold, with its torch shape."""
    h, i = arch.hidden_size, arch.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {
        "model.embed_tokens.weight": (arch.vocab_size, h),
        "model.norm.weight": (h,),
    }
    if not arch.tie_word_embeddings:
        shapes["lm_head.weight"] = (arch.vocab_size, h)
    for n in range(arch.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (arch.q_size, h),
            p + "self_attn.k_proj.weight": (arch.kv_size, h),
            p + "self_attn.v_proj.weight": (arch.kv_size, h),
            p + "self_attn.o_proj.weight": (h, arch.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
        }
        if arch.attention_bias:
            shapes |= {
                p + "self_attn.q_proj.bias": (arch.q_size,),
                p + "self_attn.k_proj.bias": (arch.kv_size,),
                p + "self_attn.v_proj.bias": (arch.kv_size,),
            }
    return shapes


def check_tensor_shapes(
    arch: LlamaArch, shapes: Mapping[str, tuple[int, ...]], source: Path
) -> None:
    """Raise CheckpointError unless `shapes` holds exactly the parameters `arch` needs."""
    expected = expected_tensor_shapes(arch)
    missing = sorted(set(expected) - set(shapes))
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [
        f"{name} {tuple(shapes[name])} (expected {shape})"
        for name, shape in expected.items()
        if name in shapes and tuple(shapes[name]) != shape
    ]
    problems = []
    if missing:
        problems.append(f"missing {_some(missing)}")
    if unexpected:
        problems.append(f"unexpected {_some(unexpected)}")
    if wrong:
        problems.append(f"wrong shape {_some(wrong)}")
    if problems:
        raise CheckpointError(
            f"{source}: tensors do not match the architecture in its config: " + "; ".join(problems)
        )


def _some(items: list[str], limit: int = 4) -> str:
    more = f" and {len(items) - limit} more" if len(items) > limit else ""
    return ", ".join(items[:limit]) + more
