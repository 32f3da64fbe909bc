"""Checking a weights version: read its checkpoint, then check it against the serving model.

`load_version(path)` verifies the manifest (sizes and sha256 of every file; given the serving
dtype, the same read tests the values it can, `finite_scan`) and opens the checkpoint
(safetensors are memory-mapped: nothing is read until copied; pickles are refused).
`validate(loaded, serving)` checks, before any weight slot is touched, that the version can
replace the serving one: the same architecture (every `LlamaArch` field but `extra`, floats as
the kernels read them: `as_used`), the same
tokenizer (vocabulary and end-of-generation ids: requests in flight keep their detokenizer;
a version whose tokenizer files are the serving one's takes the serving tokenizer at load,
with nothing to parse or compare),
every dense tensor's name, shape and floating dtype, and finite values in the serving dtype
(those the verification's read did not test are read here in chunks, so memory stays bounded;
on CUDA on a side stream), and every module the
checkpoint stores quantized converted on the serving device with its format's checks (shapes
against the config, scales finite and non-zero: the message names the tensor). A failure raises
`VersionRejected` with the reason. Copying into the standby slot and the canary are
`sitsd.weights.staging`'s; when to stage is `sitsd.weights.swap`'s.

All of it runs on the stager's own thread, never the engine's (`sitsd.weights.offthread`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from sitsd.model.arch import LlamaArch
from sitsd.model.llama import WeightsError, check_tensors, expected_shapes, expected_tensors
from sitsd.model.weights import slot_fields
from sitsd.quant.errors import QuantFormatError
from sitsd.quant.source import QuantSource
from sitsd.runtime.weight_slots import PinnedUpload, row_chunks
from sitsd.types import TokenizerLike
from sitsd.weights import Checkpoint, CheckpointError, load_checkpoint
from sitsd.weights.finite_scan import FiniteScan
from sitsd.weights.hash_child import ChildFailed, hash_in_child
from sitsd.weights.manifest import (
    IncompleteVersion,
    Manifest,
    ManifestError,
    check_complete,
    check_hashes,
)
from sitsd.weights.tokenizer import Tokenizer

log = logging.getLogger("sitsd.swap")

Progress = Callable[[int, int], None]  # (bytes done, bytes total)


class VersionRejected(Exception):
    """The version cannot serve; the message is the reason shown to operators."""


@dataclass(frozen=True)
class ServingModel:
    """What a new version must match: the architecture, tokenizer and slot format serving."""

    arch: LlamaArch
    vocab: dict[str, int]  # the tokenizer's token -> id map
    eos_token_ids: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    # The serving tokenizer itself, for versions whose tokenizer files are the same (None:
    # not one built from files this way).
    tokenizer: Tokenizer | None = None

    @functools.cached_property
    def shapes(self) -> dict[str, tuple[int, ...]]:
        """Every tensor of the serving model by Hugging Face name, with its shape (made once:
        each push checks its table against it)."""
        return expected_shapes(self.arch)


@dataclass
class LoadedVersion:
    """A version read from disk (tensors memory-mapped) and its manifest."""

    checkpoint: Checkpoint
    manifest: Manifest | None  # None for the start-up model, which may have none
    # Tensors whose values the verification's read tested in the serving dtype: whether all
    # are finite (`FiniteScan`); `validate` checks the others.
    finite: Mapping[str, bool] = dataclasses.field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.checkpoint.tensors.values())


def serving_model_of(
    arch: LlamaArch, tokenizer: TokenizerLike, dtype: torch.dtype, device: torch.device
) -> ServingModel:
    """The `ServingModel` of the engine's architecture, tokenizer and weights format."""
    return ServingModel(
        arch,
        dict(tokenizer.backend.get_vocab()),
        tuple(sorted(tokenizer.eos_token_ids)),
        dtype,
        device,
        tokenizer if isinstance(tokenizer, Tokenizer) else None,
    )


def load_version(
    path: Path,
    *,
    root: Path | None = None,
    on_progress: Progress | None = None,
    hash_workers: int = 1,
    tokenizer: Tokenizer | None = None,
    dtype: torch.dtype | None = None,
    chunk_bytes: int = 0,
    in_child: bool = False,
) -> LoadedVersion:
    """Verify a version directory against its manifest and open its checkpoint.

    Args:
        path: the version directory (it must hold `manifest.json`).
        root: the watched directory, for versions found there: every file must resolve in it.
        on_progress: called with (bytes hashed, bytes total).
        hash_workers: files (or blocks of them) hashed at once.
        tokenizer: the serving one, taken when the version's tokenizer files are its own
            (`load_checkpoint`).
        dtype: the serving dtype: the hashing's read also tests the values it can
            (`FiniteScan`; `LoadedVersion.finite`, which `validate` reads).
        chunk_bytes: the pieces the files are read in (0: `manifest.sha256_file`'s default).
        in_child: hash (and scan) in a child process (`hash_child`), off this process's
            interpreter; in this one where the child gives no answer.

    Raises:
        VersionRejected: incomplete, a checksum mismatch, a pickle, an unreadable or truncated
            checkpoint (the message says which).
    """
    if not path.is_dir():
        raise VersionRejected(f"{path} is not a directory (a version is a directory)")
    try:
        manifest = check_complete(path, root=root)
        finite = None
        if in_child:
            try:
                finite = hash_in_child(
                    path, manifest, dtype=dtype, workers=hash_workers, chunk_bytes=chunk_bytes,
                    on_progress=on_progress,
                )  # fmt: skip
            except ChildFailed as exc:
                log.warning("%s: hashing in this process instead: %s", path, exc)
        if finite is None:
            scan = None
            if dtype is not None:
                scan = FiniteScan([path / entry.name for entry in manifest.files], dtype)
            check_hashes(path, manifest, on_progress=on_progress, workers=hash_workers,
                         also=scan, chunk_bytes=chunk_bytes)  # fmt: skip
            finite = scan.finite() if scan is not None else {}
    except IncompleteVersion as exc:
        raise VersionRejected(f"incomplete: {exc}") from None
    except ManifestError as exc:
        raise VersionRejected(str(exc)) from None
    try:
        checkpoint = load_checkpoint(path, tokenizer=tokenizer)
    except CheckpointError as exc:
        raise VersionRejected(str(exc)) from None
    return LoadedVersion(checkpoint, manifest, finite)


def validate(
    loaded: LoadedVersion,
    serving: ServingModel,
    *,
    chunk_bytes: int,
    on_progress: Progress | None = None,
    uploads: PinnedUpload | None = None,
) -> None:
    """Check a loaded version against the serving model (see the module docstring).
    `uploads`: pinned buffers made before serving (CUDA; see `check_finite`).

    Raises:
        VersionRejected: with the first problem found.
    """
    ckpt = loaded.checkpoint
    if as_used(ckpt.arch) != as_used(serving.arch):
        raise VersionRejected(
            f"architecture differs from the serving one: {_arch_diff(ckpt.arch, serving.arch)}"
        )
    tokenizer = ckpt.tokenizer
    same = tokenizer is serving.tokenizer  # built from the same files: nothing to compare
    if not same and dict(tokenizer.backend.get_vocab()) != serving.vocab:
        raise VersionRejected("the tokenizer's vocabulary differs from the serving one")
    if not same and tuple(sorted(tokenizer.eos_token_ids)) != serving.eos_token_ids:
        raise VersionRejected(
            f"end-of-generation ids differ: {sorted(tokenizer.eos_token_ids)} vs "
            f"{list(serving.eos_token_ids)}"
        )
    try:
        check_tensors(serving.arch, ckpt.tensors, ckpt.quant)
    except WeightsError as exc:
        raise VersionRejected(str(exc)) from None
    expected = expected_tensors(serving.arch, ckpt.tensors, ckpt.quant)
    dense = [name for name, shape in expected.items() if shape is not None]
    for name in dense:
        if not loaded.finite.get(name, True):
            raise _nonfinite(name, serving.dtype)
    check_finite(
        ckpt.tensors,
        [name for name in dense if name not in loaded.finite],
        serving,
        chunk_bytes=chunk_bytes,
        on_progress=on_progress,
        uploads=uploads,
    )
    if ckpt.quant is not None:
        check_quantized(serving.arch, ckpt.tensors, ckpt.quant, serving.device)


def check_quantized(
    arch: LlamaArch, tensors: Mapping[str, torch.Tensor], source: QuantSource, device: torch.device
) -> None:
    """Convert every module the checkpoint stores quantized on `device` (a side stream on
    CUDA), with its format's checks; nothing is kept.

    Raises:
        VersionRejected: naming the tensor that does not fit its format.
    """
    side = torch.cuda.stream(torch.cuda.Stream(device)) if device.type == "cuda" else None
    with torch.inference_mode(), side or contextlib.nullcontext():
        for f in slot_fields(arch):
            for module, shape in f.parts if f.linear else ():
                if not source.is_quantized(tensors, module):
                    continue
                try:
                    source.convert(tensors, module, (shape[0], shape[1]), device)
                except QuantFormatError as exc:
                    raise VersionRejected(str(exc)) from None


def check_finite(
    tensors: Mapping[str, torch.Tensor],
    names: Sequence[str],
    serving: ServingModel,
    *,
    chunk_bytes: int,
    on_progress: Progress | None = None,
    uploads: PinnedUpload | None = None,
) -> None:
    """Every value finite once cast to the serving dtype (a float32 1e38 is inf in float16).
    On CUDA host tensors go up through `uploads`, pinned buffers made before serving (made
    here without them: allocating pinned memory takes driver locks that stall the engine).

    Raises:
        VersionRejected: naming the first tensor holding NaN or Inf.
    """
    if not names:
        return  # no side stream made for nothing (a stream's creation takes driver locks)
    total = sum(tensors[n].numel() * tensors[n].element_size() for n in names)
    done = 0
    on_cuda = serving.device.type == "cuda"
    side = torch.cuda.stream(torch.cuda.Stream(serving.device)) if on_cuda else None
    if on_cuda and uploads is None:
        uploads = PinnedUpload(serving.device, chunk_bytes)
    with torch.inference_mode(), side or contextlib.nullcontext():
        for name in names:
            src = tensors[name]
            finite = []  # one flag per chunk; read once per tensor
            for rows in row_chunks(src, chunk_bytes):
                if uploads is not None and src.device.type == "cpu":
                    piece = uploads.upload(src[rows]).to(serving.dtype)  # [rows, ...]
                else:
                    piece = src[rows].to(device=serving.device, dtype=serving.dtype)
                finite.append(torch.isfinite(piece).all())
                done += piece.numel() * src.element_size()
                if on_progress is not None:
                    on_progress(done, total)
            if not bool(torch.stack(finite).all()):  # host sync, this thread
                raise _nonfinite(name, serving.dtype)


def _nonfinite(name: str, dtype: torch.dtype) -> VersionRejected:
    """The rejection of a version whose tensor `name` holds NaN or Inf in `dtype`."""
    return VersionRejected(
        f"{name} holds NaN or Inf values (in {str(dtype).removeprefix('torch.')})"
    )


def as_used(arch: LlamaArch) -> LlamaArch:
    """`arch` as the model uses it: its floats in float32, the precision the kernels read them
    in (RMSNorm adds eps to float32 sums; the rotary tables are computed in float32 from
    rope_theta and the rope_scaling factors). A GGUF stores `rms_norm_eps` as float32
    (9.9999997e-06) where the same model's config.json says 1e-05: the same model, which a
    comparison of Python floats would refuse."""
    scaling = arch.rope_scaling
    return dataclasses.replace(
        arch,
        rms_norm_eps=_float32(arch.rms_norm_eps),
        rope_theta=_float32(arch.rope_theta),
        rope_scaling=None
        if scaling is None
        else {k: _float32(v) if isinstance(v, float) else v for k, v in scaling.items()},
    )


def _float32(value: float) -> float:
    return float(np.float32(value))


def _arch_diff(new: LlamaArch, serving: LlamaArch) -> str:
    """Each field that differs as the model uses it, with by how much when it is a number."""
    new_used, serving_used = as_used(new), as_used(serving)
    diffs = []
    for f in dataclasses.fields(LlamaArch):
        theirs, ours = getattr(new_used, f.name), getattr(serving_used, f.name)
        if not f.compare or theirs == ours:
            continue
        diff = f"{f.name} {getattr(new, f.name)!r} (serving: {getattr(serving, f.name)!r})"
        numbers = all(
            isinstance(x, int | float) and not isinstance(x, bool) for x in (theirs, ours)
        )
        if numbers and ours:
            diff += f", off by {theirs - ours:+.6g} ({(theirs - ours) / abs(ours):+.3%})"
        diffs.append(diff)
    return "; ".join(diffs)
