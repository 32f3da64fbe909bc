"""A version's values are tested in the read that hashes its files (`FiniteScan`), and
validation reads again only what that read could not decide."""

from __future__ import annotations

import dataclasses
import hashlib
import os
import random

import pytest
import torch
from safetensors.torch import save_file

from sitsd.weights import checks, load_checkpoint, manifest
from sitsd.weights.checks import (
    VersionRejected,
    load_version,
    serving_model_of,
    validate,
)
from sitsd.weights.finite_scan import FiniteScan
from sitsd.weights.manifest import sha256_file
from tests.weights.tiny_versions import edit_tensors, write_version

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# Stored in the first, finite in the second exactly when finite in the first.
DECIDED = {(d, d) for d in DTYPES} | {
    (torch.bfloat16, torch.float32),
    (torch.float16, torch.float32),
    (torch.float16, torch.bfloat16),
}


class Pieces:
    """An `AlsoRead` that records what it is given."""

    def __init__(self, cuts: list[int]) -> None:
        self._cuts = cuts
        self.got: list[tuple[int, bytes]] = []

    def cuts(self, path):
        return self._cuts

    def read(self, path, offset, piece):
        self.got.append((offset, bytes(piece)))


def test_the_hash_is_the_files_sha256_and_the_reader_beside_gets_each_byte_once_within_cuts(
    tmp_path, rng
):
    chunk = rng.choice([7, 64, 1000])
    data = os.urandom(rng.randrange(1, 5000))
    path = tmp_path / "f.bin"
    path.write_bytes(data)
    cuts = sorted({rng.randrange(0, len(data) + 3) for _ in range(rng.randrange(0, 12))})
    reader = Pieces(cuts)
    assert sha256_file(path, also=reader, chunk_bytes=chunk) == hashlib.sha256(data).hexdigest()
    assert max(len(piece) for _, piece in reader.got) <= chunk
    assert b"".join(piece for _, piece in reader.got) == data
    for offset, piece in reader.got:
        assert data[offset : offset + len(piece)] == piece
        assert not any(offset < cut < offset + len(piece) for cut in cuts), (offset, cuts)


def _tensors(rng: random.Random, serving: torch.dtype) -> dict[str, torch.Tensor]:
    """Tensors of every dtype, some holding NaN, Inf or -Inf at random places (first and last
    elements too), some holding each dtype's largest finite value; one of `serving` holds NaN."""
    bad = torch.randn(rng.randrange(1, 2000)).to(serving)
    bad[rng.randrange(bad.numel())] = float("nan")
    out = {"bad": bad}
    for i in range(12):
        dtype = rng.choice(DTYPES)
        t = torch.randn(rng.randrange(1, 40), rng.randrange(1, 40)).to(dtype)
        flat = t.view(-1)
        kind = rng.choice(["finite", "largest", "nan", "inf", "-inf"])
        where = rng.choice([0, flat.numel() - 1, rng.randrange(flat.numel())])
        if kind == "largest":
            flat[where] = torch.finfo(dtype).max * rng.choice([1, -1])
        elif kind != "finite":
            flat[where] = float(kind)
        out[f"t{i}.{kind}"] = t
    return out


@pytest.mark.parametrize("serving", DTYPES, ids=str)
def test_the_scan_finds_exactly_the_tensors_holding_nan_or_inf_of_those_it_can_decide(
    tmp_path, monkeypatch, rng, serving
):
    monkeypatch.setattr(manifest, "_HASH_CHUNK", rng.choice([8, 256, 4096]))  # pieces cut
    files = {}
    for f in range(rng.randrange(1, 4)):
        tensors = _tensors(rng, serving)
        path = tmp_path / f"model-{f}.safetensors"
        save_file({f"{f}.{name}": t for name, t in tensors.items()}, str(path))
        tensors = {f"{f}.{name}": t for name, t in tensors.items()}
        files[path] = tensors
    (tmp_path / "config.json").write_text("{}")  # not a safetensors file: skipped
    paths = [*files, tmp_path / "config.json"]
    scan = FiniteScan(paths, serving)
    manifest.sha256_files(paths, workers=rng.choice([1, 3]), also=scan)
    want = {
        name: bool(torch.isfinite(t).all())
        for tensors in files.values()
        for name, t in tensors.items()
        if (t.dtype, serving) in DECIDED
    }
    assert scan.finite() == want
    assert not all(want.values())


def test_a_version_verified_block_by_block_on_several_threads_decides_the_same_tensors(
    tmp_path, monkeypatch, rng
):
    """Blocks of 4096 bytes cut tensors in the middle, and threads read one file's blocks at
    once: the scan's verdicts are those of one thread reading each file whole."""
    monkeypatch.setattr(manifest, "_HASH_CHUNK", rng.choice([512, 4096]))
    serving = rng.choice(DTYPES)
    paths = []
    for f in range(2):
        tensors = _tensors(rng, serving)
        big = torch.randn(rng.randrange(3000, 9000)).to(serving)  # across several blocks
        big[rng.randrange(big.numel())] = float(rng.choice(["nan", "inf", "1.0"]))
        tensors["big"] = big
        path = tmp_path / f"model-{f}.safetensors"
        save_file({f"{f}.{name}": t for name, t in tensors.items()}, str(path))
        paths.append(path)
    written = manifest.write_manifest(tmp_path, block_bytes=4096)
    assert all(entry.blocks for entry in written.files)
    whole = FiniteScan(paths, serving)
    manifest.sha256_files(paths, workers=1, also=whole)
    blocks = FiniteScan(paths, serving)
    manifest.check_hashes(tmp_path, written, workers=rng.choice([3, 8]), also=blocks)
    assert blocks.finite() == whole.finite()
    assert not all(whole.finite().values())


def test_a_truncated_tensor_is_left_undecided(tmp_path):
    path = tmp_path / "model.safetensors"
    save_file({"a": torch.ones(64), "b": torch.full((64,), float("nan"))}, str(path))
    data = path.read_bytes()
    path.write_bytes(data[:-10])  # b's last values are gone
    scan = FiniteScan([path], torch.float32)
    sha256_file(path, also=scan)
    assert scan.finite() == {"a": True}


def _checked_names(monkeypatch) -> list[list[str]]:
    """The names each call of `check_finite` (validation's own read) was given."""
    calls: list[list[str]] = []
    real = checks.check_finite

    def recording(tensors, names, *args, **kwargs):
        calls.append(list(names))
        return real(tensors, names, *args, **kwargs)

    monkeypatch.setattr(checks, "check_finite", recording)
    return calls


@pytest.mark.parametrize(
    ("serving", "read_again"), [(torch.float32, False), (torch.float16, True)], ids=str
)
def test_validation_reads_only_the_values_the_hashing_read_could_not_decide(
    tmp_path, monkeypatch, serving, read_again
):
    path = write_version(tmp_path / "v2", noise_seed=random.randrange(100))  # float32 stored
    checkpoint = load_checkpoint(path)
    model = serving_model_of(checkpoint.arch, checkpoint.tokenizer, serving, torch.device("cpu"))
    calls = _checked_names(monkeypatch)
    loaded = load_version(path, dtype=serving)
    validate(loaded, model, chunk_bytes=4096)
    read = [name for names in calls for name in names]
    if read_again:  # float32 for float16: a finite value may overflow, so it is cast and read
        assert set(read) == set(checkpoint.tensors)
        assert not loaded.finite
    else:
        assert read == []
        assert set(loaded.finite) == set(checkpoint.tensors)
        assert all(loaded.finite.values())


def test_a_value_finite_as_stored_that_overflows_the_serving_dtype_is_still_rejected(tmp_path):
    path = write_version(tmp_path / "v2")
    gate = "model.layers.1.mlp.gate_proj.weight"
    edit_tensors(path, lambda t: t[gate].view(-1).__setitem__(3, 1e6))  # float16 max: 65504
    manifest.write_manifest(path)
    checkpoint = load_checkpoint(path)
    model = serving_model_of(
        checkpoint.arch, checkpoint.tokenizer, torch.float16, torch.device("cpu")
    )
    loaded = load_version(path, dtype=torch.float16)
    with pytest.raises(VersionRejected, match=rf"{gate} holds NaN or Inf values \(in float16\)"):
        validate(loaded, model, chunk_bytes=4096)
    in_float32 = dataclasses.replace(model, dtype=torch.float32)
    validate(load_version(path, dtype=torch.float32), in_float32, chunk_bytes=4096)
