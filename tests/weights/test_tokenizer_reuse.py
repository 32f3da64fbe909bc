"""A version whose tokenizer files are the serving model's own takes the serving tokenizer when it
loads: nothing is parsed (parsing tokenizer.json holds the GIL throughout, so the engine's steps
and the event loop of a daemon staging while it serves wait for it) and there is nothing to
compare. A version with other tokenizer files is parsed and compared as before."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import tokenizers
import torch

from sitsd.weights import load_checkpoint
from sitsd.weights.checks import VersionRejected, load_version, serving_model_of, validate
from sitsd.weights.manifest import write_manifest
from tests.weights.tiny_versions import write_version


@pytest.fixture
def parses(monkeypatch) -> list[str]:
    """The tokenizer.json files `sitsd.weights.hf` parses from now on."""
    seen: list[str] = []

    def from_file(path: str) -> tokenizers.Tokenizer:
        seen.append(path)
        return tokenizers.Tokenizer.from_file(path)

    namespace = SimpleNamespace(Tokenizer=SimpleNamespace(from_file=from_file))
    monkeypatch.setattr("sitsd.weights.hf.tokenizers", namespace)
    return seen


def serving_of(path: Path):
    checkpoint = load_checkpoint(path)
    return serving_model_of(checkpoint.arch, checkpoint.tokenizer, torch.float32,
                            torch.device("cpu"))  # fmt: skip


def edit_json(path: Path, edit) -> None:
    data = json.loads(path.read_text(encoding="utf-8"))
    edit(data)
    path.write_text(json.dumps(data), encoding="utf-8")
    write_manifest(path.parent)


def test_a_version_with_the_serving_tokenizer_files_takes_the_serving_tokenizer(tmp_path, parses):
    serving = serving_of(write_version(tmp_path / "v1"))
    assert serving.tokenizer is not None
    assert len(parses) == 1
    loaded = load_version(write_version(tmp_path / "v2", noise_seed=random.randrange(100)),
                          tokenizer=serving.tokenizer)  # fmt: skip
    assert loaded.checkpoint.tokenizer is serving.tokenizer
    assert len(parses) == 1, "nothing parsed again"
    names = {p.name for p in loaded.checkpoint.files}
    assert {"tokenizer.json", "tokenizer_config.json", "config.json"} <= names
    validate(loaded, serving, chunk_bytes=4096)


def test_other_tokenizer_files_are_parsed_and_compared(tmp_path, parses):
    serving = serving_of(write_version(tmp_path / "v1"))
    # Another chat template: the same vocabulary, so the version still validates.
    v2 = write_version(tmp_path / "v2", noise_seed=1)
    edit_json(v2 / "tokenizer_config.json",
              lambda c: c.update(chat_template="{{ messages[0]['content'] }}"))  # fmt: skip
    loaded = load_version(v2, tokenizer=serving.tokenizer)
    assert loaded.checkpoint.tokenizer is not serving.tokenizer
    assert loaded.checkpoint.tokenizer.chat_template == "{{ messages[0]['content'] }}"
    assert len(parses) == 2
    validate(loaded, serving, chunk_bytes=4096)
    # Two tokens' ids swapped: the vocabulary differs, and the version is refused.
    v3 = write_version(tmp_path / "v3", noise_seed=2)

    def swap_two(data: dict) -> None:
        vocab = data["model"]["vocab"]
        a, b = sorted(vocab, key=vocab.get)[-2:]
        vocab[a], vocab[b] = vocab[b], vocab[a]

    edit_json(v3 / "tokenizer.json", swap_two)
    loaded = load_version(v3, tokenizer=serving.tokenizer)
    assert loaded.checkpoint.tokenizer is not serving.tokenizer
    with pytest.raises(VersionRejected, match="vocabulary differs from the serving one"):
        validate(loaded, serving, chunk_bytes=4096)
