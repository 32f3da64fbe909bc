"""Fixtures for the Triton kernel tests: interpreter switch, gpu marker, device.

Without a GPU the kernels run in Triton's CPU interpreter (TRITON_INTERPRET=1, set by
`tests/conftest.py` before anything imports triton), slowly: the marker-free tests keep their
shapes tiny. Tests marked `gpu`
are deselected without CUDA (tests/conftest.py); on the GPU machine every test runs there.
Shared helpers (paged caches, error checks) live in `tests.kernels.helpers`.

Every test draws fresh random inputs (`fresh_seed` in tests/conftest.py): a failure names its
seed, and `SITSD_TEST_SEED=N` replays it.
"""

from __future__ import annotations

import pytest
import torch

HAS_CUDA = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    """The GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if HAS_CUDA else "cpu")
