"""sitsd's Triton kernels, one per module, each checked against `sitsd.kernels.reference`.

The public wrappers are exposed lazily: `sitsd.kernels.decode_attention` imports
`sitsd.kernels.decode_attention` (and triton) on first access, so `import sitsd.kernels` and
`import sitsd.kernels.reference` work where triton is not installed (the CPU runtime runs the
references). Accessing a wrapper without triton raises ImportError naming the missing package.

    decode_attention       one query token per sequence over its paged context (GQA, split-K)
    prefill_attention      causal ragged prompt chunks over the paged cache (GQA)
    rms_norm               RMSNorm
    fused_add_rms_norm     residual add + RMSNorm in one pass
    rotary_and_cache       rotate-half RoPE in place + the K/V cache write, in one launch
    silu_and_mul           SwiGLU activation on a fused gate/up output
    gemv                   x @ weight.T for up to 64 rows (decode's linear layers), SwiGLU fusable
    norm_gemv              residual add + RMSNorm + x @ weight.T for one row, in one launch
    skinny_gemm            x @ weight.T for 2-64 rows, swapped MMA operands, split over K
    int4_matmul            x @ W.T for an INT4 group-quantized W (W4A16), 1 to hundreds of rows
    int4_dequantize        an INT4 group-quantized W as a 16-bit [N, K] matrix (then cuBLAS)
    per_token_quant_fp8    each row of x to float8_e4m3fn with its own scale
    fp8_matmul             x @ W.T for an FP8 W, x quantized per token (W8A8)

A wrapper checks its arguments and picks its own launch configuration from the shapes. Which
kernel runs when (device, dtype, row counts, programmatic dependent launch) is the model's
decision: `sitsd.model.ops`, `sitsd.model.linear`, `sitsd.model.routing`.

Imported by its bare name `kernels` (the repository root is on `sys.path` whenever Python runs
from a checkout: `python -m bench.bench_cpu`, `python -m pytest`, a REPL), this directory would
shadow the `kernels` distribution that transformers imports; it hands that name over to the
installed distribution instead (`_hand_over_bare_name`), or, where none is installed, stays
what it was: transformers 4 imports whatever `kernels` it finds to read its version and lets an
error out of that import stop `from transformers import LlamaConfig`. sitsd itself never
imports `kernels`.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from importlib.machinery import PathFinder
from pathlib import Path
from typing import Any


def _hand_over_bare_name() -> None:
    """Replace this module under the name `kernels` with the installed distribution of that
    name, found on `sys.path` without this directory's parent (Python keeps what a module puts
    in `sys.modules` under its own name as the result of the import); none: leave it be."""
    root = Path(__file__).resolve().parent.parent
    others = [p for p in sys.path if Path(p or ".").resolve() != root]
    spec = PathFinder.find_spec("kernels", others)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["kernels"] = module
    spec.loader.exec_module(module)


if __name__ == "kernels":
    _hand_over_bare_name()

# public name -> submodule that defines it
_WRAPPERS = {
    "decode_attention": "decode_attention",
    "prefill_attention": "prefill_attention",
    "rms_norm": "rmsnorm",
    "fused_add_rms_norm": "rmsnorm",
    "rotary_and_cache": "rotary_cache",
    "silu_and_mul": "activation",
    "gemv": "gemv",
    "norm_gemv": "norm_gemv",
    "skinny_gemm": "skinny_gemm",
    "int4_matmul": "int4_matmul",
    "int4_dequantize": "int4_dequant",
    "per_token_quant_fp8": "fp8_matmul",
    "fp8_matmul": "fp8_matmul",
}

__all__ = sorted(_WRAPPERS)


def __getattr__(name: str) -> Any:
    module_name = _WRAPPERS.get(name)
    if module_name is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(f"{__name__}.{module_name}")
    except ModuleNotFoundError as exc:
        if exc.name != "triton" and not (exc.name or "").startswith("triton."):
            raise
        raise ImportError(
            f"sitsd.kernels.{name} needs triton (pip install 'sitsd[triton]'); "
            "on CPU use sitsd.kernels.reference"
        ) from exc
    wrapper = getattr(module, name)
    globals()[name] = wrapper  # later lookups skip __getattr__
    return wrapper


def __dir__() -> list[str]:
    return sorted([*globals(), *_WRAPPERS])


class _KernelsPackage(types.ModuleType):
    """The package's module type: keeps wrapper names bound to the wrappers.

    Importing a submodule binds it as an attribute of its package, and most submodules share
    their wrapper's name (`decode_attention.py` defines `decode_attention`). Without this,
    `from sitsd.kernels import decode_attention` would give the module or the function depending
    on what was imported before. Reach a module's other names with `from sitsd.kernels.<module>
    import <name>`.
    """

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _WRAPPERS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


if __name__ != "kernels":  # not handed over
    sys.modules[__name__].__class__ = _KernelsPackage
