"""Without a GPU, Triton kernels in these tests run in the CPU interpreter.

Triton decides at decoration time (`import triton` decorates its own `tl.sum` & co.) whether a
`@triton.jit` function is interpreted, so TRITON_INTERPRET=1 must be set before anything here
imports triton (transformers may, at collection): hence at conftest import, as
`tests/kernels/conftest.py` does. The CPU runtime itself never runs Triton.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
