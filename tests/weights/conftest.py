"""Fixtures for the weights tests: tiny checkpoints per test, the embedded SmolLM2 per session.

Everything expensive about SmolLM2 (our load, transformers' tokenizer) is loaded once per session.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from sitsd.weights import Checkpoint, load_checkpoint, resolve_model_path
from tests.weights.tiny_models import write_tiny_llama


@pytest.fixture
def seed() -> int:
    """A fresh seed per test; pytest prints it with the failing test's arguments."""
    return random.randrange(2**31)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path, seed: int) -> Path:
    return write_tiny_llama(tmp_path / "tiny-llama", seed=seed)


@pytest.fixture(scope="session")
def smollm2_path() -> Path:
    return resolve_model_path("default")


@pytest.fixture(scope="session")
def smollm2(smollm2_path: Path) -> Checkpoint:
    return load_checkpoint(smollm2_path)


@pytest.fixture(scope="session")
def smollm2_hf_tokenizer(smollm2_path: Path):
    """transformers' own tokenizer for the GGUF (its GGUF conversion, ~6 s)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_path.parent, gguf_file=smollm2_path.name)
