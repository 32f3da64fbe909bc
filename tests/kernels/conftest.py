"""Fixtures for the Triton kernel tests: interpreter switch, gpu marker, fresh seeds, device.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
`tests/conftest.py` before anything imports triton), slowly: the marker-free tests keep their
shapes tiny. Tests marked `gpu`
are deselected without CUDA (tests/conftest.py); on the GPU machine every test runs there.
Shared helpers (paged caches, error checks) live in `tests.kernels.helpers`.

Every test draws fresh random inputs: the seed is printed, so a failure's captured output
says how to replay it (`torch.manual_seed(seed); random.seed(seed)`).
"""

from __future__ import annotations

import random

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture(autouse=True)
def fresh_seed() -> int:
    """Seed torch and `random` from fresh entropy for each test; print the seed for replay."""
    seed = random.SystemRandom().randrange(2**31)
    torch.manual_seed(seed)
    random.seed(seed)
    print(f"torch seed {seed}")
    return seed


@pytest.fixture
def device() -> torch.device:
    """The GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
