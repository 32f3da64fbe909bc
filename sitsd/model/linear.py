"""The model's linear layers: cuBLAS (torch) by default, the Triton `gemv` where it measured
faster.

A decode step at batch 1 is nothing but GEMVs: the weights stream once through the cores and
the time is bytes / bandwidth. cuBLAS runs the smaller ones of Llama-3-8B at 0.6-0.75 of copy
bandwidth on an H200, and adds a split-K reduce kernel to the o and down projections;
`sitsd.kernels.gemv` streams each weight once for all rows, in one launch.
`bench/bench_gemv.py` timed both inside CUDA graphs, shape by shape (H200, bf16, 2026-11-30;
`bench/NOTES.md`), and `GEMV_MEASURED_FASTER` below holds exactly the shapes and row counts
where gemv won; everything else goes to cuBLAS. At one row the down projection also takes the
SwiGLU activation in its prologue (one launch fewer per layer); from two rows the fused form
measured slower, so the activation runs on its own first.

The table is for sm_90 (H100/H200); elsewhere every layer goes to cuBLAS until measured.
This module imports triton: only `ops.triton_kernels` uses it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from sitsd.kernels.gemv import GemvConfig, choose_gemv_config, gemv
from sitsd.kernels.norm_gemv import norm_gemv

# (N, K) of the weight -> (most rows at which gemv beat cuBLAS, its one-row launch config).
# From two rows, gemv's default (tensor-core) config, the sweep's winner on every shape.
# Speed-ups over cuBLAS at 1 / 2 / 4 / 8 rows.
GEMV_MEASURED_FASTER: dict[tuple[int, int], tuple[int, GemvConfig]] = {
    # Llama-3-8B qkv: 1.12 / 1.15 / 1.10 / 1.06
    (6144, 4096): (8, GemvConfig(4, 2048, 8, 2, use_dot=False)),
    # o: 1.34 / 1.23 / 1.23 / 1.20 (cuBLAS adds a split-K reduce)
    (4096, 4096): (8, GemvConfig(4, 1024, 4, 2, use_dot=False)),
    # gate_up: 1.04 at one row; 0.98 from two
    (28672, 4096): (1, GemvConfig(4, 1024, 4, 2, use_dot=False)),
    # down: 1.11 / 1.04 / 1.03 / 1.05; with SwiGLU fused at one row 1.07 against
    # silu_and_mul + cuBLAS
    (4096, 14336): (8, GemvConfig(4, 1024, 4, 2, use_dot=False)),
    # lm_head (128256 vocabulary): 1.08 / 1.04 / 1.04 / 1.05
    (128256, 4096): (8, GemvConfig(4, 2048, 8, 2, use_dot=False)),
}
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def measured_device(device: torch.device | str | None = None) -> bool:
    """Whether `GEMV_MEASURED_FASTER` applies to the CUDA device (sm_90: H100, H200)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


@dataclass(frozen=True)
class TunedLinear:
    """`linear`, `swiglu_linear` and `norm_linear` for one model runner; `use_gemv` False:
    cuBLAS always."""

    use_gemv: bool
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # `ops.norm_linear` bound to the norm kernels: (linear, hidden, residual, ...) -> (out, res)
    unfused_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    measured: dict[tuple[int, int], tuple[int, GemvConfig]] = field(
        default_factory=lambda: dict(GEMV_MEASURED_FASTER)
    )
    # One row: add + RMSNorm inside the projection's kernel (`norm_gemv`). Not yet measured
    # against fused_add_rms_norm + gemv on a GPU (`bench/bench_gemv.py` does): off until then.
    fuse_norm: bool = False

    def _gemv_config(self, x: torch.Tensor, weight: torch.Tensor) -> GemvConfig | None:
        """The gemv launch for this call, or None when cuBLAS was measured as fast or faster."""
        if not self.use_gemv or x.dtype not in _GEMV_DTYPES:
            return None
        entry = self.measured.get(tuple(weight.shape))  # type: ignore[arg-type]
        if entry is None or not 0 < x.shape[0] <= entry[0]:
            return None
        if x.shape[0] == 1:
            return entry[1]
        return choose_gemv_config(x.shape[0], *weight.shape, x.dtype)

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for 2-D `x`."""
        config = self._gemv_config(x, weight) if bias is None and x.dim() == 2 else None
        if config is None:
            return F.linear(x, weight, bias)
        return _gemv(x, weight, config, swiglu=False)

    def norm_linear(
        self,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        norm_weight: torch.Tensor,
        eps: float,
        weight: torch.Tensor,
        bias: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The pre-norm projection (`ops.norm_linear`), in one `norm_gemv` launch at one row
        where `fuse_norm` is on and the shape is measured."""
        if self.fuse_norm and bias is None and hidden.dim() == 2 and hidden.shape[0] == 1:
            config = self._gemv_config(hidden, weight)
            if config is not None:
                return norm_gemv(hidden, residual, norm_weight, eps, weight,
                                 block_n=config.block_n, block_k=config.block_k,
                                 num_warps=config.num_warps)  # fmt: skip
        return self.unfused_norm_linear(
            self.linear, hidden, residual, norm_weight, eps, weight, bias
        )

    def swiglu_linear(self, gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """`F.linear(silu_and_mul(gate_up), weight)`: the MLP's down projection."""
        if gate_up.dim() == 2 and gate_up.shape[0] == 1:
            half = gate_up[:, : gate_up.shape[1] // 2]
            config = self._gemv_config(half, weight)
            if config is not None:
                return _gemv(gate_up, weight, config, swiglu=True)
        return self.linear(self.silu_and_mul(gate_up), weight)


def _gemv(
    x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, *, swiglu: bool
) -> torch.Tensor:
    return gemv(
        x, weight, swiglu=swiglu, block_n=config.block_n, block_k=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, use_dot=config.use_dot,
    )  # fmt: skip
