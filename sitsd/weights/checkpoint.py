"""What a loaded checkpoint is, how loading one fails, and the checks every loader shares.

`Checkpoint` is the one format-independent shape the loaders (`sitsd.weights.hf`,
`sitsd.weights.gguf_file`) return: tensors under Hugging Face names in torch's `[out, in]`
shapes, whatever the source format. `CheckpointError` is what every loader raises.
`check_tensor_shapes` holds a checkpoint's tensors against its architecture, and
`pickle_refused` says why pickle files are refused and how to convert them.

Which loader reads a path is `sitsd.weights.formats`'; this module imports no loader, so every
loader can import it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sitsd.model.arch import LlamaArch
from sitsd.weights.tokenizer import Tokenizer

if TYPE_CHECKING:  # torch is only imported by the loaders, so `import sitsd.weights` stays light
    import torch

    from sitsd.quant.source import QuantSource

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded; the message says what is wrong and what to do."""


@dataclass
class Checkpoint:
    """A model checkpoint read from disk, in one format-independent shape."""

    arch: LlamaArch
    # Hugging Face parameter names -> tensors, torch's [out, in] shapes; no "lm_head.weight"
    # when embeddings are tied. safetensors: memory-mapped, original dtype (quantized modules'
    # tensors as their format names them); GGUF: float32, or raw bytes for what `quant` keeps
    tensors: Mapping[str, torch.Tensor]
    tokenizer: Tokenizer
    name: str  # served model name derived from the path (directory name / file stem)
    path: Path
    format: str  # "hf" or "gguf"
    files: list[Path] = field(default_factory=list)  # every file of the checkpoint, weights too
    # What the checkpoint stores quantized (None: nothing; `sitsd.quant.source.QuantSource`)
    quant: QuantSource | None = None


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


def check_tensor_shapes(
    arch: LlamaArch,
    shapes: Mapping[str, tuple[int, ...]],
    source: Path,
    quant: QuantSource | None = None,
) -> None:
    """Raise CheckpointError unless `shapes` holds exactly the parameters `arch` needs (the
    tensors of modules `quant` says are quantized: by name; their converters check shapes)."""
    # Imported here: the model pulls in torch, which `import sitsd.weights` does not need.
    from sitsd.model.llama import expected_tensors

    expected = expected_tensors(arch, shapes, quant)
    missing = sorted(n for n, shape in expected.items() if shape is not None and n not in shapes)
    unexpected = sorted(set(shapes) - set(expected))
    wrong = [
        f"{name} {tuple(shapes[name])} (expected {shape})"
        for name, shape in expected.items()
        if shape is not None and name in shapes and tuple(shapes[name]) != shape
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
