"""manifest.json: writing one, and telling a complete version from a partial or a bad one."""

from __future__ import annotations

import hashlib
import json
import os

import pytest

from sitsd.weights.manifest import (
    MANIFEST_NAME,
    IncompleteVersion,
    ManifestError,
    read_manifest,
    verify_version_dir,
    write_manifest,
)

BLOCK = 4096  # the smallest block a manifest may list


@pytest.fixture
def version_dir(tmp_path, rng):
    d = tmp_path / "watch" / "tiny" / "v1"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"n": rng.randrange(10**6)}))
    (d / "model.safetensors").write_bytes(os.urandom(rng.randrange(5000, 9000)))
    (d / "sub").mkdir()
    (d / "sub" / "extra.json").write_text("{}")
    return d


def test_written_manifest_lists_every_file_with_size_and_sha256(version_dir):
    progress = []
    manifest = write_manifest(
        version_dir, model="tiny", on_progress=lambda done, total: progress.append(done)
    )
    body = json.loads((version_dir / MANIFEST_NAME).read_text())
    assert body["format"] == 1
    assert body["model"] == "tiny"
    assert body["created"]
    names = [f["name"] for f in body["files"]]
    assert names == ["config.json", "model.safetensors", "sub/extra.json"]
    for entry in body["files"]:
        data = (version_dir / entry["name"]).read_bytes()
        assert entry["size"] == len(data)
        assert entry["sha256"] == hashlib.sha256(data).hexdigest()
    assert progress[-1] == sum(f["size"] for f in body["files"])
    assert manifest.digest == hashlib.sha256((version_dir / MANIFEST_NAME).read_bytes()).hexdigest()
    assert verify_version_dir(version_dir).digest == manifest.digest


def test_hashing_files_in_parallel_writes_and_checks_the_same_manifest(version_dir):
    for i in range(6):
        (version_dir / f"shard-{i}.safetensors").write_bytes(os.urandom(300_000 + i))
    serial = write_manifest(version_dir)
    progress = []
    parallel = write_manifest(
        version_dir, workers=4, on_progress=lambda done, total: progress.append((done, total))
    )
    assert [(f.name, f.size, f.sha256) for f in parallel.files] == [
        (f.name, f.size, f.sha256) for f in serial.files
    ]
    assert progress[-1] == (serial.total_bytes, serial.total_bytes)
    assert [done for done, _ in progress] == sorted(done for done, _ in progress)
    assert verify_version_dir(version_dir, workers=4).digest == parallel.digest
    shard = version_dir / "shard-4.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"checksum mismatch: shard-4.safetensors"):
        verify_version_dir(version_dir, workers=4)


def test_a_file_larger_than_a_block_lists_each_blocks_sha256_and_a_bad_block_is_named(
    version_dir, rng
):
    blocks = rng.randrange(2, 6)
    big = version_dir / "model-00001.safetensors"
    big.write_bytes(os.urandom(blocks * 2 * BLOCK - rng.randrange(1, 2 * BLOCK)))  # last shorter
    small = version_dir / "model.safetensors"  # 5000-9000 bytes: at most one block
    progress = []
    manifest = write_manifest(
        version_dir,
        block_bytes=2 * BLOCK,
        workers=rng.choice([1, 3]),
        on_progress=lambda done, total: progress.append((done, total)),
    )
    body = {f["name"]: f for f in json.loads((version_dir / MANIFEST_NAME).read_text())["files"]}
    data = big.read_bytes()
    entry = body[big.name]
    assert entry["sha256"] == hashlib.sha256(data).hexdigest()  # what sha256sum checks
    assert entry["block_bytes"] == 2 * BLOCK
    assert entry["blocks"] == [
        hashlib.sha256(data[i : i + 2 * BLOCK]).hexdigest() for i in range(0, len(data), 2 * BLOCK)
    ]
    assert len(entry["blocks"]) == blocks
    assert ("blocks" in body[small.name]) == (small.stat().st_size > 2 * BLOCK)
    assert progress[-1] == (manifest.total_bytes, manifest.total_bytes)
    for workers in (1, 4):
        assert verify_version_dir(version_dir, workers=workers).digest == manifest.digest
    bad = rng.randrange(1, blocks)  # a block after the first
    corrupt = bytearray(data)
    corrupt[rng.randrange(bad * 2 * BLOCK, min(len(data), (bad + 1) * 2 * BLOCK))] ^= 0x01
    big.write_bytes(bytes(corrupt))
    with pytest.raises(ManifestError, match=rf"checksum mismatch: {big.name} \(bytes "
                       rf"{bad * 2 * BLOCK} to \d+, block {bad + 1} of {blocks}\)"):  # fmt: skip
        verify_version_dir(version_dir, workers=rng.choice([1, 4]))


def test_a_manifest_without_blocks_is_checked_file_by_file(version_dir):
    (version_dir / "model.safetensors").write_bytes(os.urandom(5 * BLOCK))
    write_manifest(version_dir, block_bytes=BLOCK)
    body = json.loads((version_dir / MANIFEST_NAME).read_text())
    for entry in body["files"]:
        entry.pop("blocks", None)
        entry.pop("block_bytes", None)
    (version_dir / MANIFEST_NAME).write_text(json.dumps(body))  # as an earlier sitsd wrote it
    assert not any(f.blocks for f in verify_version_dir(version_dir, workers=2).files)
    data = bytearray((version_dir / "model.safetensors").read_bytes())
    data[3 * BLOCK] ^= 0x01
    (version_dir / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"checksum mismatch: model.safetensors does not"):
        verify_version_dir(version_dir, workers=2)


def test_a_block_size_that_is_not_a_multiple_of_4096_is_refused_when_writing(version_dir):
    with pytest.raises(ValueError, match="multiple of 4096"):
        write_manifest(version_dir, block_bytes=1000)


def test_no_manifest_yet_is_incomplete(version_dir):
    with pytest.raises(IncompleteVersion):
        verify_version_dir(version_dir)


def test_a_file_shorter_than_listed_is_incomplete_until_it_is_whole(version_dir):
    weights = version_dir / "model.safetensors"
    data = weights.read_bytes()
    write_manifest(version_dir)
    weights.write_bytes(data[: len(data) // 2])  # still being copied
    with pytest.raises(IncompleteVersion, match=r"model.safetensors"):
        verify_version_dir(version_dir)
    weights.write_bytes(data)
    verify_version_dir(version_dir)


def test_a_missing_file_is_incomplete(version_dir):
    write_manifest(version_dir)
    (version_dir / "sub" / "extra.json").unlink()
    with pytest.raises(IncompleteVersion, match="missing"):
        verify_version_dir(version_dir)


def test_same_size_other_bytes_is_a_checksum_mismatch(version_dir):
    write_manifest(version_dir)
    weights = version_dir / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 3] ^= 0xFF
    weights.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"checksum mismatch: model.safetensors"):
        verify_version_dir(version_dir)


def test_a_longer_file_an_unlisted_file_and_a_pickle_are_refused(version_dir):
    write_manifest(version_dir)
    (version_dir / "config.json").write_text((version_dir / "config.json").read_text() + " ")
    with pytest.raises(ManifestError, match=r"config.json has"):
        verify_version_dir(version_dir)
    write_manifest(version_dir)
    (version_dir / "notes.txt").write_text("hi")
    with pytest.raises(ManifestError, match=r"notes.txt is not listed"):
        verify_version_dir(version_dir)
    (version_dir / "notes.txt").unlink()
    (version_dir / "pytorch_model.bin").write_bytes(b"\x80\x04")
    with pytest.raises(ManifestError, match="pickle"):
        verify_version_dir(version_dir)


def test_hidden_temporary_files_are_ignored(version_dir):
    write_manifest(version_dir)
    (version_dir / ".model.safetensors.XyZ123").write_bytes(b"partial rsync file")
    verify_version_dir(version_dir)


def test_a_symlink_out_of_the_watched_directory_is_refused(version_dir, tmp_path):
    outside = tmp_path / "elsewhere.json"
    outside.write_text("{}")
    (version_dir / "sub" / "extra.json").unlink()
    (version_dir / "sub" / "extra.json").symlink_to(outside)
    write_manifest(version_dir)
    verify_version_dir(version_dir)  # no containment rule without a root (Admin.Deploy)
    with pytest.raises(ManifestError, match="outside the watched directory"):
        verify_version_dir(version_dir, root=tmp_path / "watch")


def test_a_version_directory_that_is_a_symlink_out_of_the_root_is_refused(version_dir, tmp_path):
    write_manifest(version_dir)
    link = tmp_path / "watch" / "tiny" / "v2"
    link.symlink_to(version_dir.rename(tmp_path / "real-v1"))
    with pytest.raises(ManifestError, match="outside"):
        verify_version_dir(link, root=tmp_path / "watch")


HEX = "0" * 64


def _one_file(**fields: object) -> dict[str, object]:
    """A manifest of one 9000-byte file, with `fields` in its entry."""
    return {"format": 1, "files": [{"name": "a", "size": 9000, "sha256": HEX, **fields}]}


@pytest.mark.parametrize(
    "body",
    [
        "not json",
        {"format": 2, "files": [{"name": "a", "size": 1, "sha256": "0" * 64}]},
        {"format": 1, "files": []},
        {"format": 1, "files": [{"name": "../a", "size": 1, "sha256": "0" * 64}]},
        {"format": 1, "files": [{"name": "/etc/passwd", "size": 1, "sha256": "0" * 64}]},
        {"format": 1, "files": [{"name": "a", "size": -1, "sha256": "0" * 64}]},
        {"format": 1, "files": [{"name": "a", "size": 1}]},
        {"format": 1, "files": [{"name": "a", "size": 1, "sha256": "z" * 64}]},
        # blocks: a count that does not cover the size, a size not a multiple of 4096, one
        # without the other, a digest that is not one
        _one_file(block_bytes=4096, blocks=[HEX] * 2),
        _one_file(block_bytes=3000, blocks=[HEX] * 3),
        _one_file(block_bytes=4096),
        _one_file(blocks=[HEX] * 3),
        _one_file(block_bytes=4096, blocks=[HEX, HEX[:-1], HEX]),
        _one_file(block_bytes=4096, blocks=[HEX, "0x" + HEX[2:], HEX]),  # int(_, 16) takes it
        {"format": 1, "files": [{"name": "a", "size": 1, "sha256": " " + HEX[1:]}]},
    ],
)
def test_malformed_manifests_are_refused(version_dir, body):
    text = body if isinstance(body, str) else json.dumps(body)
    (version_dir / MANIFEST_NAME).write_text(text)
    with pytest.raises(ManifestError):
        read_manifest(version_dir)
