"""Fixtures for the weights tests: tiny checkpoints per test, the embedded SmolLM2 per session.

The SmolLM2 fixtures (our load, transformers' tokenizer and model) live in tests/conftest.py.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from tests.weights.tiny_models import write_tiny_llama


@pytest.fixture
def seed() -> int:
    """A fresh seed per test; pytest prints it with the failing test's arguments."""
    return random.randrange(2**31)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path, seed: int) -> Path:
    return write_tiny_llama(tmp_path / "tiny-llama", seed=seed)
