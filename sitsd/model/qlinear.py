"""The model's linear layers over any weight: dense tensors to the kernel set's 16-bit linears,
quantized layouts to their kernels, by row count.

`any_linear`, `any_swiglu_linear` and `any_norm_linear` wrap the kernel set's dense functions:
a dense weight in the activations' dtype goes to them unchanged (the 16-bit path: the same
kernels, the same CUDA graphs; on the host one `isinstance` per call while a graph is captured
or a step runs eagerly); a dense weight in another dtype (the bfloat16 lm_head of a CPU serving
float32 activations) gets x cast to its dtype and back; a quantized one goes to
`QuantizedLinears`, with the pre-norm and SwiGLU unfused (the fused 16-bit kernels read 16-bit
weights only).

`QuantizedLinears` picks the kernel of a layout: on CUDA an INT4 weight runs `int4_matmul` up to
`INT4_DEQUANT_FROM_ROWS` rows of x (decode, short chunks) and, past it, `int4_dequantize` into one
runner-owned workspace, then cuBLAS (long prefill chunks: the GEMM is compute-bound there and
cuBLAS' tensor-core tiles beat the Triton ones); every other layout and device takes
`sitsd.quant.linear.quantized_linear`'s route. `int4_matmul` runs as the kernel set's other
decode kernels do: with programmatic dependent launch at the row counts where it pays
(`int4_pdl_pays`: `routing.pdl_pays`, up to `INT4_PDL_MAX_ROWS`), and up to `INT4_MERGE_ROWS`
with split-K merged by each tile's last program in the runner's counters (one launch fewer per
layer) where they hold enough for the call's tiles. Past that a layer called with `unsummed`
returns its float32 partials for the next kernel to sum (the add + RMSNorm after o and down,
the rotary + cache kernel after qkv); otherwise a second kernel sums them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from sitsd.model.arch import LlamaArch
from sitsd.model.routing import pdl_pays
from sitsd.quant.layout import Int4Weight
from sitsd.quant.linear import LinearWeight, ServingWeight, quantized_linear

__all__ = [
    "INT4_DEQUANT_FROM_ROWS",
    "INT4_MERGE_ROWS",
    "INT4_PDL_MAX_ROWS",
    "QuantizedLinears",
    "any_linear",
    "any_norm_linear",
    "any_swiglu_linear",
    "int4_pdl_pays",
    "int4_split_counters",
]

# Rows of x from which INT4 runs dequantize + cuBLAS: on an H100 with Llama-3-8B's layers
# (bench/bench_quant_kernels.py, 2026-12-06) int4_matmul's mma tiles win every layer at 128
# rows (qkv 26.8 vs 45.8 us, gate_up 108 vs 210) and the four layers together at 256 (the
# sweep's best 374 against 421 us, with zero points 422 against 429); at 512 the dequantize
# wins (512 against 726 us): its cost does not grow with the rows.
INT4_DEQUANT_FROM_ROWS = 512
# The least tile of `int4_matmul`'s default configurations, on each side: `cdiv(N, 16) *
# cdiv(M, 16)` counters cover every call's tiles.
_LEAST_TILE = 16
# Rows of x up to which INT4 layers merge their split-K partials in the kernel; past them a
# second kernel sums them. On an H100 (`bench.probe_int4_launch`, `bench/results/
# quant-kernels-h100.txt` run 8) the merge was even at 8 rows and lost from 32 (the engine's
# zero-point format at 32 rows: o 15.8 against 12.0 us, down 36.8 against 26.3, where K splits
# 8 ways): each tile's last program reads every part of it alone, after all of them.
INT4_MERGE_ROWS = 16
# Rows of x up to which INT4 layers launch with programmatic dependent launch (where `pdl_pays`
# too). On an H100 it gained at 1 to 32 rows and lost at 64 (the four layers 2% slower in
# run 8) and at 128 (the 32 layers' INT4 linears 12.96 against 12.43 ms, run 2). Likely cause,
# not profiled: a dependent grid's programs, launched early, wait on SMs that a large batch's
# many-wave grid still needs.
INT4_PDL_MAX_ROWS = 32

DenseLinear = Callable[..., torch.Tensor]  # (x, weight, bias=None) -> y


@dataclass(frozen=True)
class QuantizedLinears:
    """`x @ W.T` for quantized layouts on one runner's device (see the module docstring)."""

    # [numel] in the activations' dtype, for `int4_dequantize` on CUDA; None: int4_matmul always
    workspace: torch.Tensor | None = None
    # Launch int4_matmul with programmatic dependent launch where `int4_pdl_pays` (sm_90+)
    pdl: bool = False
    # int32 zeros on the device, the runner's (left zero): int4_matmul's split-K merged in the
    # kernel when they cover the call's tiles; None, or too few: a second kernel sums them
    split_counters: torch.Tensor | None = None

    def __call__(
        self, x: torch.Tensor, weight: ServingWeight, *, unsummed: bool = False
    ) -> torch.Tensor:  # [M, N], or with `unsummed` maybe [split_k, M, N] float32
        """`x @ W.T`; `unsummed`: an INT4 layer split along K and not merged in the kernel
        returns its float32 partials for the consumer to sum (`fused_add_rms_norm` and
        `rotary_and_cache` take them)."""
        if not isinstance(weight, Int4Weight) or x.device.type != "cuda":
            return quantized_linear(x, weight)
        n, k = weight.shape
        w = weight
        if (
            x.shape[0] >= INT4_DEQUANT_FROM_ROWS
            and self.workspace is not None
            and self.workspace.numel() >= n * k
            and self.workspace.dtype == x.dtype
        ):
            from sitsd.kernels.int4_dequant import int4_dequantize  # triton: CUDA hosts only

            deq = int4_dequantize(w.qweight, w.scales, w.offsets, w.group_size, w.perm,
                                  out=self.workspace[: n * k].view(n, k),
                                  slice_major=w.slice_major)  # fmt: skip
            return F.linear(x, deq)
        from sitsd.kernels.int4_matmul import int4_matmul  # triton: CUDA hosts only

        rows = x.shape[0]
        return int4_matmul(x, w.qweight, w.scales, w.offsets, w.group_size, w.perm,
                           zeros=w.zeros, pdl=self.pdl and int4_pdl_pays(rows),
                           split_counters=self.counters_for(rows, n),
                           slice_major=w.slice_major, unsummed=unsummed)  # fmt: skip

    def counters_for(self, rows: int, n: int) -> torch.Tensor | None:
        """The split counters an `int4_matmul` call over `rows` rows of x and `n` outputs
        merges its split-K partials in: the runner's, up to `INT4_MERGE_ROWS` rows and where
        they cover the call's tiles; else None (a second kernel sums them)."""
        tiles = -(-n // _LEAST_TILE) * -(-rows // _LEAST_TILE)  # ceiling divisions
        counters = self.split_counters
        if counters is None or rows > INT4_MERGE_ROWS or counters.numel() < tiles:
            return None
        return counters


def int4_pdl_pays(rows: int) -> bool:
    """Whether an INT4 layer over `rows` rows of x launches with programmatic dependent launch."""
    return pdl_pays(rows) and rows <= INT4_PDL_MAX_ROWS


def int4_split_counters(
    arch: LlamaArch, device: torch.device, max_rows: int = INT4_MERGE_ROWS
) -> torch.Tensor:
    """Zeroed counters for `QuantizedLinears.split_counters`: enough for any linear of `arch`
    (the lm_head's vocabulary the widest, usually) up to `max_rows` rows."""
    widest = max(arch.vocab_size, 2 * arch.intermediate_size, arch.hidden_size,
                 arch.q_size + 2 * arch.kv_size)  # fmt: skip
    tiles = -(-widest // _LEAST_TILE) * -(-max_rows // _LEAST_TILE)
    return torch.zeros(tiles, dtype=torch.int32, device=device)


def any_linear(
    dense: DenseLinear,
    quantized: QuantizedLinears,
    x: torch.Tensor,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    *,
    unsummed: bool = False,
) -> torch.Tensor:
    """`F.linear(x, W, bias)` for a weight in any form, in x's dtype; `unsummed` (no bias):
    a quantized layer split along K may return its float32 partials `[parts, M, N]` instead
    (`split_partials`), for an add + RMSNorm to sum."""
    if isinstance(weight, torch.Tensor):
        if weight.dtype == x.dtype:
            return dense(x, weight, bias)
        b = None if bias is None else bias.to(weight.dtype)
        return dense(x.to(weight.dtype), weight, b).to(x.dtype)
    if bias is not None:
        return quantized(x, weight) + bias
    return quantized(x, weight, unsummed=unsummed)


def split_partials(hidden: torch.Tensor, residual: torch.Tensor | None) -> bool:
    """Whether `hidden`, on its way into an add + RMSNorm with `residual`, is a split layer's
    float32 partials (`any_linear(unsummed=True)`) rather than the layer's output."""
    return residual is not None and hidden.dim() == residual.dim() + 1


def any_swiglu_linear(
    dense_swiglu: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor],
    linear: Callable[..., torch.Tensor],
    gate_up: torch.Tensor,
    weight: LinearWeight,
    *,
    unsummed: bool = False,
) -> torch.Tensor:
    """The down projection of SwiGLU(gate_up): the kernel set's (maybe fused) path for a dense
    weight in gate_up's dtype, else the activation and then `linear` (`any_linear`, which
    takes `unsummed`)."""
    if isinstance(weight, torch.Tensor) and weight.dtype == gate_up.dtype:
        return dense_swiglu(gate_up, weight)
    return linear(silu_and_mul(gate_up), weight, unsummed=unsummed)


def any_norm_linear(
    dense_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    unfused_norm_linear: Callable[..., tuple[torch.Tensor, torch.Tensor]],
    hidden: torch.Tensor,
    residual: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    weight: LinearWeight,
    bias: torch.Tensor | None = None,
    *,
    unsummed: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The pre-norm projection: the kernel set's (maybe fused) path for a dense weight in
    hidden's dtype, else `unfused_norm_linear` (its linear is `any_linear`, given `unsummed`),
    which also takes split partials for `hidden` (`split_partials`: its add + RMSNorm sums
    them)."""
    dense = isinstance(weight, torch.Tensor) and weight.dtype == hidden.dtype
    if dense and not split_partials(hidden, residual):
        return dense_norm_linear(hidden, residual, norm_weight, eps, weight, bias)
    return unfused_norm_linear(hidden, residual, norm_weight, eps, weight, bias,
                               unsummed=unsummed)  # fmt: skip
