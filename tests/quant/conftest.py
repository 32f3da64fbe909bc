"""Fixtures for the quantized-weight tests: the SmolLM2 GGUF header.

Every test draws fresh random inputs (`fresh_seed` in tests/conftest.py): a failure names its
seed, and `SITSD_TEST_SEED=N` replays it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from sitsd.weights.gguf_file import GgufHeader, read_gguf_header


@pytest.fixture(scope="session")
def smollm2_gguf_header(smollm2_path: Path) -> GgufHeader:
    """The embedded SmolLM2-135M-Instruct file's metadata and tensor table."""
    return read_gguf_header(smollm2_path)
