"""Weight versions of the tiny Llama for hot-swap tests: good ones, and every kind of bad drop.

A version is a Hugging Face directory with a `manifest.json` (what the daemon takes). Good
versions are the seed-0 tiny model with small relative noise (`scale`), so the canary sees them
close to each other; bad drops are what an operator could get wrong, each with the text its
rejection reason must contain.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sitsd.weights.manifest import write_manifest
from tests.weights.tiny_models import write_tiny_llama

BASE_SEED = 0


def write_version(
    directory: Path, noise_seed: int | None = None, scale: float = 0.2, **tiny_kwargs
) -> Path:
    """The tiny model (seed 0), with relative noise `scale` drawn from `noise_seed` if given."""
    write_tiny_llama(directory, seed=tiny_kwargs.pop("seed", BASE_SEED), **tiny_kwargs)
    if noise_seed is not None:
        edit_tensors(directory, lambda tensors: _perturb(tensors, noise_seed, scale))
    write_manifest(directory)
    return directory


def _perturb(tensors: dict[str, torch.Tensor], seed: int, scale: float) -> None:
    gen = torch.Generator().manual_seed(seed)
    for name, t in tensors.items():
        tensors[name] = t * (1 + scale * torch.randn(t.shape, generator=gen))


def edit_tensors(directory: Path, edit) -> None:
    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


# The bad drops: name -> (how to make it, what its rejection reason says).
BAD_DROPS = {
    "checksum": "checksum mismatch: model.safetensors",
    "truncated": "truncated or corrupt",
    "shapes": "wrong shape model.layers.1.mlp.gate_proj.weight",
    "dtype": "expected a floating-point type",
    "nan": "holds NaN or Inf",
    "inf": "holds NaN or Inf",
    "pickle": "pickle",
    "architecture": "architecture differs from the serving one: num_kv_heads 4 (serving: 2)",
    "symlink": "outside the watched directory",
}


def write_bad_version(kind: str, directory: Path, outside: Path) -> Path:
    """A bad version of kind `kind` (a key of BAD_DROPS) in `directory`.

    `outside` is scratch space out of the watched directory (for the symlink drop).
    """
    if kind == "architecture":
        return write_version(directory, num_kv_heads=4)
    write_tiny_llama(directory, seed=BASE_SEED)
    weights = directory / "model.safetensors"
    gate = "model.layers.1.mlp.gate_proj.weight"
    if kind == "truncated":  # the manifest matches the truncated file: it is the file that's bad
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) * 2 // 3])
    elif kind == "shapes":
        edit_tensors(directory, lambda t: t.update({gate: t[gate].T.contiguous()}))
    elif kind == "dtype":
        edit_tensors(directory, lambda t: t.update({gate: t[gate].to(torch.int32)}))
    elif kind in ("nan", "inf"):
        value = float("nan") if kind == "nan" else float("inf")
        edit_tensors(directory, lambda t: t[gate].view(-1).__setitem__(7, value))
    elif kind == "pickle":
        (directory / "pytorch_model.bin").write_bytes(b"\x80\x04\x95 not to be unpickled")
    elif kind == "symlink":
        outside.mkdir(parents=True, exist_ok=True)
        target = outside / f"{directory.name}.safetensors"
        shutil.move(str(weights), target)
        os.symlink(target, weights)
    write_manifest(directory)
    if kind == "checksum":  # same size, other bytes, after the manifest was written
        data = bytearray(weights.read_bytes())
        data[len(data) // 2] ^= 0x01
        weights.write_bytes(bytes(data))
    return directory
