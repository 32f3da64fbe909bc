"""Fixtures for the quantized-weight tests: fresh seeds (printed for replay), the SmolLM2 GGUF
header.

Every test draws fresh random inputs; a failure's captured output gives the seed to replay it
with (`torch.manual_seed(seed); np.random.seed(seed); random.seed(seed)`).
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch

from sitsd.weights.gguf_file import GgufHeader, read_gguf_header


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    """Seed torch, numpy and `random` from fresh entropy for each test; print the seed."""
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    np.random.seed(seed)
    random.seed(seed)
    print(f"seed {seed}")
    return seed


@pytest.fixture(scope="session")
def smollm2_gguf_header(smollm2_path: Path) -> GgufHeader:
    """The embedded SmolLM2-135M-Instruct file's metadata and tensor table."""
    return read_gguf_header(smollm2_path)
