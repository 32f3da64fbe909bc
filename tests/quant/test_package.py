"""`sitsd.quant` works where triton is missing (the CPU runtime): every module imports, and the
CPU route multiplies."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]


def test_every_module_imports_and_the_cpu_route_runs_without_triton():
    code = textwrap.dedent(
        """
        import pkgutil, sys
        sys.modules["triton"] = None
        import torch
        import sitsd.quant
        for info in pkgutil.iter_modules(sitsd.quant.__path__):
            __import__(f"sitsd.quant.{info.name}")
        from sitsd.kernels.quant_layout import pack_int4
        from sitsd.quant.layout import Int4Weight
        from sitsd.quant.linear import quantized_linear, to_serving_layout
        codes = pack_int4(torch.randint(0, 16, (16, 64)))
        w = Int4Weight(codes, torch.ones(2, 16).half(), None, 32)
        y = quantized_linear(torch.randn(2, 64), to_serving_layout(w, "cpu"))
        assert y.shape == (2, 16)
        assert "triton" not in [m for m in sys.modules if sys.modules[m] is not None]
        print("ok")
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
