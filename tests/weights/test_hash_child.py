"""A version hashed and scanned in a child process decides what hashing in the daemon would:
the same finite values, the same rejections, the same progress; and a child that cannot run
leaves the work to the daemon's own threads."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
from collections.abc import Callable

import pytest
import torch

from sitsd.children import module_command
from sitsd.weights.checks import VersionRejected, load_version
from sitsd.weights.hash_child import CHILD_MODULE, HashJob, hash_in_child
from sitsd.weights.manifest import ManifestError, read_manifest
from tests.weights.tiny_versions import BAD_DROPS, write_bad_version

NAN_TENSOR = "model.layers.1.mlp.gate_proj.weight"  # where the "nan" drop puts one


def progress_calls() -> tuple[list[tuple[int, int]], Callable[[int, int], None]]:
    calls: list[tuple[int, int]] = []
    return calls, lambda done, total: calls.append((done, total))


@pytest.mark.parametrize("workers", [1, 3])
def test_a_version_hashed_in_a_child_has_the_values_and_progress_hashing_here_gives(
    tmp_path, workers
):
    version = write_bad_version("nan", tmp_path / "v", tmp_path / "outside")
    here_calls, here_progress = progress_calls()
    here = load_version(version, dtype=torch.float32, hash_workers=workers, chunk_bytes=4096,
                        on_progress=here_progress)  # fmt: skip
    child_calls, child_progress = progress_calls()
    child = load_version(version, dtype=torch.float32, hash_workers=workers, chunk_bytes=4096,
                         on_progress=child_progress, in_child=True)  # fmt: skip
    assert child.finite == here.finite
    assert child.finite[NAN_TENSOR] is False
    assert sum(child.finite.values()) == len(child.finite) - 1
    total = sum(f.stat().st_size for f in version.iterdir() if f.name != "manifest.json")
    assert child_calls[-1] == (total, total) == here_calls[-1]
    assert len(child_calls) > 1, "progress as the child reads, not once at its end"
    assert child.checkpoint.tensors.keys() == here.checkpoint.tensors.keys()


def test_a_checksum_mismatch_found_in_the_child_rejects_the_version_naming_the_file(tmp_path):
    version = write_bad_version("checksum", tmp_path / "v", tmp_path / "outside")
    with pytest.raises(VersionRejected, match=BAD_DROPS["checksum"]):
        load_version(version, dtype=torch.float32, in_child=True)


def test_the_child_refuses_a_manifest_other_than_the_one_checked_here(tmp_path):
    version = write_bad_version("nan", tmp_path / "v", tmp_path / "outside")
    manifest = dataclasses.replace(read_manifest(version), digest="0" * 64)
    with pytest.raises(ManifestError, match=r"manifest\.json changed"):
        hash_in_child(version, manifest, dtype=torch.float32, workers=1, chunk_bytes=0)


def test_a_child_that_cannot_run_leaves_the_hashing_to_this_process(tmp_path, monkeypatch, caplog):
    version = write_bad_version("checksum", tmp_path / "v", tmp_path / "outside")
    monkeypatch.setattr(sys, "executable", "/bin/false")
    with (
        caplog.at_level(logging.WARNING, logger="sitsd.swap"),
        pytest.raises(VersionRejected, match=BAD_DROPS["checksum"]),
    ):
        load_version(version, dtype=torch.float32, in_child=True)
    assert "hashing in this process instead" in caplog.text
    assert "without an answer" in caplog.text


def test_a_child_whose_parent_is_gone_exits(tmp_path):
    # A listed file that is a named pipe: the child's read waits forever for a writer. Its
    # stdin closed (what the daemon's death does), it must exit all the same.
    version = write_bad_version("nan", tmp_path / "v", tmp_path / "outside")
    job = HashJob(str(version), read_manifest(version).digest, "float32", 1, 0)
    weights = version / "model.safetensors"
    weights.unlink()
    os.mkfifo(weights)
    argv, env = module_command(CHILD_MODULE)
    child = subprocess.Popen(argv, stdin=subprocess.PIPE, env=env, text=True)
    assert child.stdin is not None
    child.stdin.write(json.dumps(dataclasses.asdict(job)) + "\n")
    child.stdin.flush()
    child.stdin.close()
    try:
        assert child.wait(timeout=300) == 1  # a last guard: it exits as soon as it has started
    finally:
        child.kill()
