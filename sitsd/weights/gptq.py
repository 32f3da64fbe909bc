"""GPTQ: the INT4 codes of one linear weight that minimise its output error on calibration inputs.

For W `[N, K]` and the inputs X `[n, K]` the layer saw on the calibration text, the output error
of codes Q is `||X (W - Q)^T||^2`, a quadratic form in each row of W - Q with the Hessian
`H = 2 X^T X / n` (`hessian`). GPTQ (Frantar et al., 2022; AutoGPTQ's `fasterquant`) quantizes
W one input column at a time and hands each column's rounding error to the columns not yet
quantized, weighted by the inverse Hessian, so that they make up for it (`gptq_quantize`):

    damp     `H += damp * mean(diag H) * I` (`--gptq-damp`, 0.01); an input channel no
             calibration token used (`H_kk = 0`) gets `H_kk = 1` and zero weights
    order    act-order (`act_order`): columns by decreasing `H_kk`, the loudest inputs first;
             the groups are runs of `group_size` columns in that order (`Int4Codes.perm`, which
             the GPTQ layout writes as `g_idx`), or, with `static_groups`, the inputs' own
             consecutive runs, whose grids are all fixed from W before the first column (no
             permutation in the codes: llm-compressor's `actorder: weight`)
    factor   U, the upper Cholesky factor of `H^-1`: row j of U weighs column j's error onto
             the columns after it
    columns  per block of `BLOCK` columns, for each column j: at a group's first column the
             group's scale and zero point from the group's current (already corrected) weights
             (`quantize_group`: RTN, or the clipping search; static groups: fixed up front),
             `q_j = round(w_j / s) + z`, the error `e = (w_j - (q_j - z) s) / U_jj`, and the
             block's later columns `w_l -= e U_jl`; then every column after the block at once,
             `W[:, after] -= E U[block, after]` (the lazy batch update: one matmul per block
             instead of one per column)

With `H = I` no error moves and the codes are RTN's. The grid is `sitsd.quant.rtn`'s (float16
scales, zero points 0..15), so the codes write into every layout `sitsd quantize` writes.
Float32 throughout, on the weight's device. Which inputs a module sees is the caller's
(`sitsd.weights.quantize` runs layer by layer, each module on the outputs of the modules
quantized before it).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from sitsd.quant.errors import QuantFormatError
from sitsd.quant.rtn import Int4Codes

__all__ = ["BLOCK", "GroupQuantizer", "gptq_quantize", "hessian"]

BLOCK = 128  # columns per lazy batch update (a multiple of every group size)

# (a group's current weights [N, g], its inputs' energy diag H [g]) -> that group's codes: GPTQ
# rounds each of the group's columns with their scales and zero points
GroupQuantizer = Callable[[torch.Tensor, torch.Tensor], Int4Codes]


def hessian(x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [K, K] float32
    """`2 X^T X / n` over the rows of `x`: the Hessian of a linear module's squared output
    error with respect to each row of its weight."""
    flat = x.reshape(-1, x.shape[-1]).float()
    return flat.T @ flat * (2.0 / flat.shape[0])


def _inverse_factor(h: torch.Tensor, damp: float, name: str) -> torch.Tensor:  # [K, K]
    """The upper Cholesky factor of `(H + damp * mean(diag H) * I)^-1`."""
    k = h.shape[0]
    damped = h + damp * float(torch.diagonal(h).mean()) * torch.eye(k, device=h.device)
    try:
        inverse = torch.cholesky_inverse(torch.linalg.cholesky(damped))
        factor: torch.Tensor = torch.linalg.cholesky(inverse, upper=True)
        return factor
    except torch.linalg.LinAlgError as exc:
        raise QuantFormatError(f"{name}: the calibration Hessian is not positive definite with "
                               f"--gptq-damp {damp}: raise it") from exc  # fmt: skip


def gptq_quantize(
    w: torch.Tensor,
    h: torch.Tensor,
    group_size: int,
    quantize_group: GroupQuantizer,
    *,
    damp: float = 0.01,
    act_order: bool = False,
    static_groups: bool = False,
    name: str = "weight",
) -> Int4Codes:
    """GPTQ codes of `w` `[N, K]` for the Hessian `h` `[K, K]` (see the module docstring).

    Raises:
        QuantFormatError: K not a multiple of `group_size`, a damping outside (0, 1], or a
            Hessian that damping does not make positive definite.
    """
    n, k = w.shape
    if k % group_size or BLOCK % group_size:
        raise QuantFormatError(f"{name}: K = {k} is not a multiple of the group size {group_size}")
    if not 0 < damp <= 1:
        raise QuantFormatError(f"--gptq-damp {damp}: the damping is a fraction in (0, 1]")
    w, h = w.float().clone(), h.float().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1.0
    w[:, dead] = 0.0
    grids = _Grids(n, k // group_size, w.device)
    if static_groups:  # every group's grid from W as it is
        for g in range(k // group_size):
            cols = slice(g * group_size, (g + 1) * group_size)
            grids.set(g, quantize_group(w[:, cols], torch.diagonal(h)[cols]))
    order = torch.arange(k, device=w.device)  # column j of the loop is input column order[j]
    if act_order:
        order = torch.argsort(torch.diagonal(h), descending=True, stable=True)
        w, h = w[:, order], h[order][:, order]
    energy = torch.diagonal(h).clone()
    u = _inverse_factor(h, damp, name)
    codes = torch.empty(n, k, dtype=torch.uint8, device=w.device)
    group = -1
    for b0 in range(0, k, BLOCK):
        b1 = min(b0 + BLOCK, k)
        block = w[:, b0:b1].clone()  # [N, b] the block's columns as the errors correct them
        errors = torch.empty_like(block)
        for i in range(b1 - b0):
            j = b0 + i
            if static_groups:
                group = int(order[j]) // group_size
            elif j % group_size == 0:  # the group's grid, from its current weights
                group = j // group_size
                grids.set(group, quantize_group(block[:, i : i + group_size],
                                                energy[j : j + group_size]))  # fmt: skip
            scale, zero = grids.scales[group].float(), grids.zeros[group].float()
            q = (torch.round(block[:, i] / scale) + zero).clamp(0, 15)
            codes[:, j] = q.to(torch.uint8)
            error = (block[:, i] - (q - zero) * scale) / u[j, j]
            block[:, i:] -= error[:, None] * u[j, j:b1][None, :]
            errors[:, i] = error
        w[:, b1:] -= errors @ u[b0:b1, b1:]
    perm = order.to(torch.int32) if act_order else None
    if static_groups and perm is not None:  # the groups are the inputs' own: no permutation
        natural = torch.empty_like(codes)
        natural[:, order] = codes
        codes, perm = natural, None
    zeros = None if grids.symmetric else grids.zeros
    return Int4Codes(codes, grids.scales, zeros, group_size, perm)


class _Grids:
    """The scale and zero point of every group, as `quantize_group` chose them."""

    def __init__(self, n: int, groups: int, device: torch.device) -> None:
        self.scales = torch.empty(groups, n, dtype=torch.float16, device=device)
        self.zeros = torch.empty(groups, n, dtype=torch.uint8, device=device)
        self.symmetric = False

    def set(self, g: int, codes: Int4Codes) -> None:
        self.scales[g] = codes.scales[0]
        self.symmetric = codes.zeros is None
        self.zeros[g] = 8 if codes.zeros is None else codes.zeros[0]
