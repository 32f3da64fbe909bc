"""The model's linear layers: cuBLAS (torch) by default, the Triton `gemv` or `skinny_gemm`
where they measured faster.

A decode step at batch 1 is nothing but GEMVs: the weights stream once through the cores and
the time is bytes / bandwidth. cuBLAS runs the smaller ones of Llama-3-8B at 0.6-0.75 of copy
bandwidth on an H200, and adds a split-K reduce kernel to the o and down projections;
`sitsd.kernels.gemv` streams each weight once for all rows, in one launch.
`bench/bench_gemv.py` timed both inside CUDA graphs, shape by shape (H200, bf16, 2026-11-30;
`bench/NOTES.md`), and `GEMV_MEASURED_FASTER` below holds exactly the shapes and row counts
where gemv won; everything else goes to cuBLAS. At one row the down projection also takes the
SwiGLU activation in its prologue (one launch fewer per layer); from two rows the fused form
measured slower, so the activation runs on its own first.

From 9 to 64 rows (decode batches of 9-64) gemv's narrow tiles re-read x more than the weight;
`sitsd.kernels.skinny_gemm` (swapped MMA operands, split-K) took over where `bench/bench_skinny.py`
measured it at least 3% faster than cuBLAS (H200, bf16, 2026-11-30), per row tile of 16, 32
and 64 rows: `SKINNY_MEASURED_FASTER`. cuBLAS kept gate_up (0.97 of copy bandwidth already),
qkv past 16 rows and o at 64.

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
from sitsd.kernels.skinny_gemm import MAX_ROWS as SKINNY_MAX_ROWS
from sitsd.kernels.skinny_gemm import SkinnyConfig, skinny_gemm
from sitsd.model.routing import pdl_pays

# (N, K) of the weight -> (most rows at which gemv beat cuBLAS, its one-row launch config).
# From two rows, gemv's default (tensor-core) config, the sweep's winner on every shape.
# Speed-ups over cuBLAS at 1 / 2 / 4 / 8 rows.
GEMV_MEASURED_FASTER: dict[tuple[int, int], tuple[int, GemvConfig]] = {
    # Llama-3-8B qkv: 1.12 / 1.15 / 1.10 / 1.06 (one row: 1.17 with 1024-wide chunks, the best
    # of nine in the 2026-11-30 rerun)
    (6144, 4096): (8, GemvConfig(4, 1024, 4, 2, use_dot=False)),
    # o: 1.34 / 1.23 / 1.23 / 1.20 (cuBLAS adds a split-K reduce)
    (4096, 4096): (8, GemvConfig(4, 1024, 4, 2, use_dot=False)),
    # gate_up: 1.13 at one row with 2048-wide chunks and 8 warps (54.6 against 56.6 us with
    # 1024 and 4, 2026-11-30 rerun); 0.98 from two
    (28672, 4096): (1, GemvConfig(4, 2048, 8, 2, use_dot=False)),
    # down: 1.11 / 1.04 / 1.03 / 1.05; with SwiGLU fused at one row 1.07 against
    # silu_and_mul + cuBLAS
    (4096, 14336): (8, GemvConfig(4, 1024, 4, 2, use_dot=False)),
    # lm_head (128256 vocabulary): 1.08 / 1.04 / 1.04 / 1.05
    (128256, 4096): (8, GemvConfig(4, 2048, 8, 2, use_dot=False)),
}
# (N, K) -> {row tile: config}: 9-16 rows of x go to skinny_gemm with the config of tile 16,
# 17-32 with tile 32's, 33-64 with tile 64's (each measured at the tile's row count; gemv
# keeps 1-8 rows). Speed-ups over cuBLAS inside CUDA graphs.
SKINNY_MEASURED_FASTER: dict[tuple[int, int], dict[int, SkinnyConfig]] = {
    # qkv: 1.03 at 16 rows; 1.00 at 32, 0.94 at 64
    (6144, 4096): {16: SkinnyConfig(64, 256, 1, 4, 3)},
    # o: 1.15 / 1.14 (cuBLAS: 0.58-0.59 of copy bandwidth); 0.93 at 64
    (4096, 4096): {16: SkinnyConfig(64, 128, 2, 4, 4), 32: SkinnyConfig(64, 128, 2, 4, 4)},
    # down: 1.02 at 16 (kept on cuBLAS), 1.03 at 32, 1.04 at 64
    (4096, 14336): {32: SkinnyConfig(128, 64, 4, 4, 6), 64: SkinnyConfig(64, 128, 2, 4, 4)},
    # lm_head (128256 vocabulary): 1.03 / 1.06 / 1.07
    (128256, 4096): {rows: SkinnyConfig(128, 128, 1, 4, 4) for rows in (16, 32, 64)},
}
_GEMV_DTYPES = (torch.bfloat16, torch.float16)


def measured_device(device: torch.device | str | None = None) -> bool:
    """Whether `GEMV_MEASURED_FASTER` applies to the CUDA device (sm_90: H100, H200)."""
    return torch.cuda.is_available() and torch.cuda.get_device_capability(device) == (9, 0)


@dataclass(frozen=True)
class TunedLinear:
    """`linear`, `swiglu_linear` and `norm_linear` for one model runner; `use_gemv` False:
    cuBLAS always (neither table applies)."""

    use_gemv: bool
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    # `ops.norm_linear` bound to the norm kernels: (linear, hidden, residual, ...) -> (out, res)
    unfused_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]]
    measured: dict[tuple[int, int], tuple[int, GemvConfig]] = field(
        default_factory=lambda: dict(GEMV_MEASURED_FASTER)
    )
    skinny: dict[tuple[int, int], dict[int, SkinnyConfig]] = field(
        default_factory=lambda: dict(SKINNY_MEASURED_FASTER)
    )
    # One row: add + RMSNorm inside the projection's kernel (`norm_gemv`). Measured slower
    # than fused_add_rms_norm + gemv over 32 layers (3.80 against 3.69 ms, `bench_gemv.py`:
    # every program re-reads the row to norm it): off.
    fuse_norm: bool = False
    # Launch gemv and skinny_gemm with programmatic dependent launch (`kernels/_pdl.py`) at
    # the row counts where it measured faster (`pdl_pays`).
    pdl: bool = False

    def _gemv_config(self, x: torch.Tensor, weight: torch.Tensor) -> GemvConfig | None:
        """The gemv launch for this call, or None when cuBLAS was measured as fast or faster."""
        if not self.use_gemv or x.dtype not in _GEMV_DTYPES:
            return None
        entry = self.measured.get(tuple(weight.shape))  # type: ignore[arg-type]
        if entry is None or not 0 < x.shape[0] <= entry[0]:
            return None
        if x.shape[0] == 1:
            return entry[1]
        n, k = weight.shape
        return choose_gemv_config(x.shape[0], n, k, x.dtype)

    def _pdl(self, x: torch.Tensor) -> bool:
        return self.pdl and pdl_pays(x.shape[0])

    def _skinny_config(self, x: torch.Tensor, weight: torch.Tensor) -> SkinnyConfig | None:
        """The skinny_gemm launch for this call, or None: not measured faster for its rows."""
        if not self.use_gemv or x.dtype not in _GEMV_DTYPES:
            return None
        tiles = self.skinny.get(tuple(weight.shape))  # type: ignore[arg-type]
        rows = x.shape[0]
        if tiles is None or not 8 < rows <= SKINNY_MAX_ROWS:
            return None
        return tiles.get(max(16, 1 << (rows - 1).bit_length()))

    def linear(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """`F.linear(x, weight, bias)` for 2-D `x`."""
        if bias is not None or x.dim() != 2:
            return F.linear(x, weight, bias)
        config = self._gemv_config(x, weight)
        if config is not None:
            return _gemv(x, weight, config, swiglu=False, pdl=self._pdl(x))
        skinny = self._skinny_config(x, weight)
        if skinny is not None:
            return skinny_gemm(
                x, weight, block_n=skinny.block_n, block_k=skinny.block_k,
                split_k=skinny.split_k, num_warps=skinny.num_warps,
                num_stages=skinny.num_stages, pdl=self._pdl(x),
            )  # fmt: skip
        return F.linear(x, weight)

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
                return _gemv(gate_up, weight, config, swiglu=True, pdl=self._pdl(gate_up))
        return self.linear(self.silu_and_mul(gate_up), weight)


def _gemv(
    x: torch.Tensor, weight: torch.Tensor, config: GemvConfig, *, swiglu: bool, pdl: bool
) -> torch.Tensor:
    return gemv(
        x, weight, swiglu=swiglu, block_n=config.block_n, block_k=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages, use_dot=config.use_dot,
        pdl=pdl,
    )  # fmt: skip
